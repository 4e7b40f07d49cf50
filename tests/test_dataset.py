"""Tests of nanotrain/dataset.py: the builtin corpus, local files, fineweb-edu offline behaviour, iter_documents."""

import json
import os
import re
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanotrain.builtin_corpus import build_builtin_corpus, builtin_stats, content_hash
from nanotrain.dataset import fineweb_shard_name, iter_documents, resolve_data_files
from nanotrain.errors import UserError


@pytest.fixture(autouse=True)
def base_dir(tmp_path, monkeypatch):
    # shadows conftest's base_dir (which links the shared corpus/tokenizer): these tests write their own
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path / "base"))
    return tmp_path / "base"


@pytest.fixture(scope="module")
def builtin_base(tmp_path_factory):
    """A base dir with the builtin corpus built once for the module."""
    base = tmp_path_factory.mktemp("builtin_base")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOTRAIN_BASE_DIR", str(base))
        build_builtin_corpus()
    return base


def texts(files, start=0):
    return [t for _, t in iter_documents(files, start)]


def write_parquet(path, docs, row_group_size=2, **kwargs):
    pq.write_table(pa.table({"text": docs}), path, row_group_size=row_group_size, **kwargs)


# -----------------------------------------------------------------------------
# builtin

@pytest.mark.unit
def test_builtin_corpus_shape(builtin_base, monkeypatch):
    """Catches a corpus far off its size (grouping/skipping broken), overlapping splits, a marker not matching data."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(builtin_base))
    train, val = resolve_data_files("builtin", "train"), resolve_data_files("builtin", "val")
    assert [os.path.basename(f) for f in train] == [f"train_{i:05d}.parquet" for i in range(4)]
    assert [os.path.basename(f) for f in val] == ["val_00000.parquet"]
    train_docs, val_docs = texts(train), texts(val)
    stats = builtin_stats()
    assert 1500 <= stats["docs"] <= 4000 and 1_000_000 <= stats["chars"] <= 4_000_000
    assert len(train_docs) == stats["train_docs"] and len(val_docs) == stats["val_docs"] > 0
    assert 0.03 <= len(val_docs) / stats["docs"] <= 0.07
    assert not set(train_docs) & set(val_docs)
    assert content_hash(train_docs + val_docs) == stats["sha256"]
    assert sum(map(len, train_docs + val_docs)) == stats["chars"]
    for f in train + val:
        md = pq.ParquetFile(f).metadata
        assert all(md.row_group(g).num_rows <= 256 for g in range(md.num_row_groups))
    # docstrings from parsed sources, not from tests/idlelib; real prose present
    titles = [d.split("\n", 1)[0] for d in train_docs + val_docs]
    assert not any(t.startswith(("# test.", "# idlelib")) or ".tests." in t or ".test." in t for t in titles)
    assert any(t.startswith("# json") for t in titles) and any("statement" in d[:200] for d in train_docs + val_docs)


@pytest.mark.unit
def test_builtin_corpus_deterministic(builtin_base, base_dir):
    """Catches unsorted file walking or an unseeded shuffle (two builds would differ)."""
    d = build_builtin_corpus()
    assert d.startswith(str(base_dir))
    other = json.load(open(os.path.join(builtin_base, "data", "builtin", "_SUCCESS")))
    assert builtin_stats()["sha256"] == other["sha256"]
    assert build_builtin_corpus() == d  # reused, not rebuilt
    assert sorted(os.listdir(os.path.dirname(d))) == ["builtin"]  # no temp dirs left


@pytest.mark.unit
def test_builtin_concurrent_builds(tmp_path):
    """
    Catches building in place or crashing when another rank renamed its copy first: two processes released at the
    same moment both build, both must return the same complete corpus, and no temp dir may be left behind.
    """
    base = tmp_path / "concurrent"
    go = tmp_path / "go"
    code = (
        "import os, sys, time\n"
        "from nanotrain.builtin_corpus import build_builtin_corpus\n"
        "open(sys.argv[1], 'w').close()\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        "print(build_builtin_corpus())\n"
    )
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base))
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in ready]
    t_end = time.time() + 60
    while not all(r.exists() for r in ready) and time.time() < t_end:
        time.sleep(0.01)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    assert outs[0][0].strip() == outs[1][0].strip() == str(base / "data" / "builtin")
    assert sorted(os.listdir(base / "data")) == ["builtin"]
    marker = json.load(open(base / "data" / "builtin" / "_SUCCESS"))
    files = sorted(str(base / "data" / "builtin" / f) for f in marker["shards"])
    docs = texts([f for f in files if "train" in f]) + texts([f for f in files if "val" in f])
    assert content_hash(docs) == marker["sha256"]


@pytest.mark.unit
def test_iter_documents_start_matches_tail(builtin_base, monkeypatch):
    """Catches off-by-one errors when skipping whole files or row groups (indices 255/256/257 are boundaries)."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(builtin_base))
    files = resolve_data_files("builtin", "train")
    full = list(iter_documents(files))
    assert [i for i, _ in full] == list(range(len(full)))
    first_file = pq.ParquetFile(files[0]).metadata.num_rows
    for start in [0, 1, 255, 256, 257, first_file - 1, first_file, first_file + 1, len(full) - 1, len(full),
                  len(full) + 10]:
        assert list(iter_documents(files, start)) == full[start:], start


@pytest.mark.unit
def test_iter_documents_skips_row_groups_unread(tmp_path):
    """Catches an implementation that reads everything and slices: a corrupt row group before `start` must not be read."""
    path = str(tmp_path / "rg.parquet")
    docs = [f"document {i} " * 20 for i in range(10)]
    write_parquet(path, docs, row_group_size=4, compression="none", use_dictionary=False)
    col = pq.ParquetFile(path).metadata.row_group(0).column(0)
    raw = bytearray(open(path, "rb").read())
    raw[col.data_page_offset:col.data_page_offset + col.total_compressed_size] = b"\xff" * col.total_compressed_size
    open(path, "wb").write(bytes(raw))
    assert list(iter_documents([path], start=4)) == list(enumerate(docs))[4:]
    with pytest.raises(UserError, match="rg.parquet"):
        list(iter_documents([path]))


# -----------------------------------------------------------------------------
# local files

def make_local_dir(d):
    d.mkdir()
    write_parquet(str(d / "a.parquet"), ["p0", "p1", "p2"])
    (d / "b.jsonl").write_text('{"text": "j0"}\n\n{"text": "j1 ünïcode", "id": 5}\n')
    (d / "c.txt").write_text("whole file\n\nis one document\n")
    (d / "notes.md").write_text("ignored: not a data file")
    (d / "val.jsonl").write_text('{"text": "v0"}\n{"text": "v1"}\n')
    return d


@pytest.mark.unit
def test_local_dir_formats_and_val_rule(tmp_path):
    """Catches a wrong split rule, a format parsed wrongly, or indices not global across files."""
    d = make_local_dir(tmp_path / "data")
    train = resolve_data_files(str(d), "train")
    assert [os.path.basename(f) for f in train] == ["a.parquet", "b.jsonl", "c.txt"]
    assert resolve_data_files(str(d), "val") == [str(d / "val.jsonl")]
    assert list(iter_documents(train)) == list(enumerate(["p0", "p1", "p2", "j0", "j1 ünïcode",
                                                          "whole file\n\nis one document\n"]))
    assert texts(train, start=4) == ["j1 ünïcode", "whole file\n\nis one document\n"]
    assert texts(resolve_data_files(str(d), "val")) == ["v0", "v1"]
    # without a val* file the last file in sorted order is validation
    os.remove(d / "val.jsonl")
    assert resolve_data_files(str(d), "val") == [str(d / "c.txt")]
    assert resolve_data_files(str(d), "train") == [str(d / "a.parquet"), str(d / "b.jsonl")]


@pytest.mark.unit
def test_local_glob(tmp_path):
    """Catches a glob treated as a literal path."""
    d = make_local_dir(tmp_path / "data")
    assert resolve_data_files(str(d / "*.jsonl"), "train") == [str(d / "b.jsonl")]
    assert resolve_data_files(str(d / "*.jsonl"), "val") == [str(d / "val.jsonl")]


@pytest.mark.unit
def test_local_errors(tmp_path):
    """Catches raw tracebacks (or silent empty data) instead of one-line errors naming the path and the rule."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match=re.escape(str(empty)) + ".*no .parquet, .jsonl or .txt files"):
        resolve_data_files(str(empty), "train")
    with pytest.raises(UserError, match="no such"):
        resolve_data_files(str(tmp_path / "missing"), "train")
    with pytest.raises(UserError, match="nomatch"):
        resolve_data_files(str(tmp_path / "nomatch*.parquet"), "train")
    single = tmp_path / "single"
    single.mkdir()
    (single / "docs.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(UserError, match="only one file.*val"):
        resolve_data_files(str(single), "train")
    only_val = tmp_path / "only_val"
    only_val.mkdir()
    (only_val / "val.txt").write_text("x")
    with pytest.raises(UserError, match="validation"):
        resolve_data_files(str(only_val), "train")
    with pytest.raises(UserError, match="split"):
        resolve_data_files(str(single), "test")


@pytest.mark.unit
def test_split_without_text_is_refused(tmp_path):
    """
    Catches a split whose documents are all empty passing resolution (on the old code: resolve_data_files returned
    the files and base_train trained on BOS-only rows to a val bpb of inf, exit 0). Covers empty and whitespace-only
    .txt, .jsonl of blank lines and empty "text" strings, zero-row and null-text parquet, each split on its own, and
    checks the search stops at the first document with text (a corrupt later file is not read).
    """
    def split_error(d, split):
        return re.escape(f"--data={d}: the {split} split") + ".*no document with any text"

    d = tmp_path / "empty_txt"
    d.mkdir()
    (d / "train.txt").write_text("")
    (d / "val.txt").write_text(" \n\t\n")
    for split in ("train", "val"):
        with pytest.raises(UserError, match=split_error(d, split)):
            resolve_data_files(str(d), split)

    d = tmp_path / "empty_val"
    d.mkdir()
    (d / "a.txt").write_text("some text")
    (d / "val.jsonl").write_text('{"text": ""}\n\n{"text": "  "}\n')
    assert resolve_data_files(str(d), "train") == [str(d / "a.txt")]
    with pytest.raises(UserError, match=split_error(d, "val")):
        resolve_data_files(str(d), "val")

    d = tmp_path / "empty_parquet"
    d.mkdir()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), str(d / "a.parquet"))
    write_parquet(str(d / "b.parquet"), [None, "", "   "])
    (d / "val.txt").write_text("v")
    with pytest.raises(UserError, match=split_error(d, "train")):
        resolve_data_files(str(d), "train")
    assert resolve_data_files(str(d), "val") == [str(d / "val.txt")]

    d = tmp_path / "stops_early"
    d.mkdir()
    (d / "a.txt").write_text("")
    (d / "b.txt").write_text("text")
    (d / "c.jsonl").write_text("not json\n")
    (d / "val.txt").write_text("v")
    assert resolve_data_files(str(d), "train") == [str(d / f) for f in ("a.txt", "b.txt", "c.jsonl")]


@pytest.mark.unit
def test_corrupt_files_name_the_file(tmp_path):
    """Catches pyarrow/json exceptions escaping without the file (and line for jsonl) named."""
    d = tmp_path / "bad"
    d.mkdir()
    write_parquet(str(d / "a.parquet"), ["x" * 100] * 10)
    raw = open(d / "a.parquet", "rb").read()
    (d / "trunc.parquet").write_bytes(raw[: len(raw) // 2])
    (d / "bad.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": broken\n')
    (d / "notext.jsonl").write_text('{"body": "no text field"}\n')
    pq.write_table(pa.table({"body": ["x"]}), str(d / "nocol.parquet"))
    (d / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    cases = [("trunc.parquet", r"trunc\.parquet"), ("bad.jsonl", r"bad\.jsonl:3:"),
             ("notext.jsonl", r"notext\.jsonl:1:.*text"), ("nocol.parquet", r"nocol\.parquet.*'text'"),
             ("latin1.txt", r"latin1\.txt.*UTF-8")]
    for name, pattern in cases:
        with pytest.raises(UserError, match=pattern):
            list(iter_documents([str(d / name)]))
    # the bad jsonl line is reported even after good documents were yielded
    it = iter_documents([str(d / "bad.jsonl")])
    assert next(it) == (0, "ok")
    with pytest.raises(UserError):
        list(it)
    with pytest.raises(UserError, match="no such file"):
        list(iter_documents([str(d / "gone.parquet")]))


# -----------------------------------------------------------------------------
# fineweb-edu

@pytest.mark.unit
def test_fineweb_offline_fails_fast(monkeypatch):
    """Catches huggingface_hub's ~25 s of retries (or a hang) when offline, and an error without the way out."""
    for split in ["train", "val"]:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        t0 = time.time()
        with pytest.raises(UserError, match="--data=builtin") as e:
            resolve_data_files("fineweb-edu", split)
        assert time.time() - t0 < 10 and "shard_0" in str(e.value)
        # network unreachable (not flagged offline): a refused connection must fail fast too
        monkeypatch.delenv("HF_HUB_OFFLINE")
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
        for var in ["http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"]:
            monkeypatch.delenv(var, raising=False)
        t0 = time.time()
        with pytest.raises(UserError, match="--data=builtin"):
            resolve_data_files("fineweb-edu", split)
        assert time.time() - t0 < 10


@pytest.mark.unit
def test_fineweb_local_shards_used_offline(base_dir, monkeypatch):
    """Catches a network access (or a download attempt) for shards that are already on disk."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    d = base_dir / "data" / "fineweb-edu"
    d.mkdir(parents=True)
    for i in [0, 1, 1822]:
        write_parquet(str(d / fineweb_shard_name(i)), [f"shard {i} doc {j}" for j in range(3)])
    train = resolve_data_files("fineweb-edu", "train", num_shards=2)
    assert train == [str(d / "shard_00000.parquet"), str(d / "shard_00001.parquet")]
    assert resolve_data_files("fineweb-edu", "val") == [str(d / "shard_01822.parquet")]
    assert texts(train, start=2) == ["shard 0 doc 2", "shard 1 doc 0", "shard 1 doc 1", "shard 1 doc 2"]
    monkeypatch.setenv("NANOTRAIN_FINEWEB_SHARDS", "1")
    assert resolve_data_files("fineweb-edu", "train") == [str(d / "shard_00000.parquet")]
    monkeypatch.setenv("NANOTRAIN_FINEWEB_SHARDS", "3")  # shard_00002 is missing -> offline error names it
    with pytest.raises(UserError, match="shard_00002"):
        resolve_data_files("fineweb-edu", "train")
    with pytest.raises(UserError, match="num_shards"):
        resolve_data_files("fineweb-edu", "train", num_shards=0)


# -----------------------------------------------------------------------------
# CLI

@pytest.mark.smoke
def test_dataset_cli(builtin_base):
    """Catches a broken `python -m nanotrain.dataset` (it reuses the module's corpus, so it is fast)."""
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(builtin_base))
    r = subprocess.run([sys.executable, "-m", "nanotrain.dataset"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    stats = json.load(open(os.path.join(builtin_base, "data", "builtin", "_SUCCESS")))
    assert f"documents: {stats['docs']:,}" in r.stdout and f"characters: {stats['chars']:,}" in r.stdout
