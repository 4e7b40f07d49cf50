"""
Shared fixtures: a session-wide base directory holding the builtin corpus and a tiny tokenizer (built once),
and per-test base directories that reuse them, so no test writes into ~/.cache/nanotrain.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from nanotrain.gpt import GPT, GPTConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_VOCAB = 512  # tokenizer vocab (including the 9 special tokens) of the test runs
# the tiny base_train configuration the smoke tests use (seconds on 2 cores)
TINY_TRAIN = ["--depth=2", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=512",
              "--eval_tokens=2048", "--eval_every=-1", "--sample_every=-1", "--save_every=-1", "--keep_last=0"]


@pytest.fixture(scope="session")
def shared_base_dir(tmp_path_factory):
    """A base dir with data/builtin and a TINY_VOCAB tokenizer trained on 300k characters of it. With
    NANOTRAIN_TEST_SHARED_BASE set (scripts/mutation_score.py sets it: one pytest session per mutant), it is built
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


def run_script(script, *args, base_dir, nproc=1, timeout=300, env=None):
    """
    Runs scripts/<script> through the command line (python, or torchrun --standalone with nproc > 1 on gloo)
    with NANOTRAIN_BASE_DIR=base_dir. Returns the CompletedProcess (stdout and stderr as text).
    """
    path = os.path.join(REPO, "scripts", script)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", path]
    else:
        cmd = [sys.executable, path]
    full_env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


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


def copy_run(src_base, dst_base, stage, run):
    shutil.copytree(os.path.join(src_base, stage, run), os.path.join(dst_base, stage, run))


def tiny_model(seed=0):
    """A 2-layer GPT (vocab 64, 16 positions) with every weight nonzero, seeded: the numeric tests' model."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, model_dim=32))
    model.init_weights()
    with torch.no_grad():  # give the zero-initialised projections some weight so every path matters
        for name, p in model.named_parameters():
            if "c_proj" in name or "lm_head" in name:
                p.normal_(0, 0.05)
    return model


def grads(model):
    """All parameter gradients as one flat tensor."""
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def rel(a, b):
    """Relative distance |a - b| / |b| (float)."""
    return ((a - b).norm() / b.norm()).item()
