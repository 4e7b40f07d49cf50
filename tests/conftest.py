"""
Shared fixtures: a session-wide base directory holding the builtin corpus and a tiny tokenizer (built once),
and per-test base directories that reuse them, so no test writes into ~/.cache/nanotrain.
"""

import json
import os
import pathlib

import pytest
import torch
from helpers import TINY_VOCAB

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: one torch thread per worker, so N workers fill N cores
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def shared_base_dir(tmp_path_factory):
    """A base dir with data/builtin and a TINY_VOCAB tokenizer trained on 300k characters of it. With
    NANOTRAIN_TEST_SHARED_BASE set (dev/mutation_score.py sets it: one pytest session per mutant), it is built
    there once and reused by later sessions."""
    from nanotrain.dataset import iter_documents, resolve_data_files
    from nanotrain.tokenizer import Tokenizer

    cached = os.environ.get("NANOTRAIN_TEST_SHARED_BASE")
    if cached and os.path.exists(os.path.join(cached, "complete")):
        return pathlib.Path(cached)
    base = pathlib.Path(cached) if cached else tmp_path_factory.mktemp("shared_base")
    base.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("NANOTRAIN_BASE_DIR")
    os.environ["NANOTRAIN_BASE_DIR"] = str(base)
    try:
        files = resolve_data_files("builtin", "train")

        def texts(limit=300_000):
            n = 0
            for _, t in iter_documents(files):
                yield t[:10_000]
                n += len(t[:10_000])
                if n >= limit:
                    return
        Tokenizer.train_from_iterator(texts(), TINY_VOCAB).save(str(base / "tokenizer"))
        (base / "complete").touch()  # a cached copy may be reused from now on
    finally:
        if old is None:
            os.environ.pop("NANOTRAIN_BASE_DIR", None)
        else:
            os.environ["NANOTRAIN_BASE_DIR"] = old
    return base


@pytest.fixture
def base_dir(shared_base_dir, tmp_path, monkeypatch):
    """A fresh base dir (NANOTRAIN_BASE_DIR is set to it) that links the shared corpus and tokenizer."""
    base = tmp_path / "base"
    base.mkdir()
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(base))
    return base


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A gloo process group of one rank (this process, so in-process code takes its torch.distributed paths) and its
    1-D CPU device mesh; the group is destroyed afterwards."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "pg_store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def byte_tokenizer():
    """A real nanotrain tokenizer without merges: every ASCII letter is one token (its byte), BOS is 256."""
    from nanotrain.tokenizer import Tokenizer
    tok = Tokenizer.train_from_iterator(iter(["ab"]), 265)
    assert tok.get_bos_token_id() == 256 and tok.encode("abc") == [97, 98, 99]
    return tok


@pytest.fixture
def four_docs(tmp_path):
    """Documents of 4, 2, 6, 1 letters: 5, 3, 7, 2 tokens with BOS, 17 per epoch."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["abcd", "ef", "ghijkl", "m"]))
    return [str(path)]


@pytest.fixture
def tiny_tokenizer(base_dir):
    from nanotrain.tokenizer import get_tokenizer
    return get_tokenizer()
