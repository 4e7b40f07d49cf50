"""
What a CORE bundle zip or an own bundle's core.yaml may not do (nanotrain/evaluation/core_bundle.py): a zip bomb is never
extracted, a member core.yaml does not name is never written, a num_fewshot that is not a count is one line. The
zips are small and hand-made; a "3 GiB" member only declares its size (the central directory is edited), so no test
writes or reads more than a few MB.
"""
import json
import os
import re
import shutil
import struct
import zipfile

import pytest
from helpers import REPO

from nanotrain.errors import UserError
from nanotrain.evaluation import core_bundle

pytestmark = pytest.mark.unit

BUNDLE = os.path.join(REPO, "tests", "data", "core_bundle")


@pytest.fixture
def base(tmp_path, monkeypatch):
    """An empty base dir (NANOTRAIN_BASE_DIR)."""
    b = tmp_path / "base"
    b.mkdir()
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(b))
    return b


def _zip_bundle(path, extra=None, drop=(), method=zipfile.ZIP_DEFLATED):
    """The fixture bundle zipped under eval_bundle/ as the real zip is, without the files `drop` (paths in the
    bundle), plus the members `extra` (name -> bytes)."""
    with zipfile.ZipFile(path, "w", method) as z:
        for root, _, files in os.walk(BUNDLE):
            for f in files:
                rel = os.path.relpath(os.path.join(root, f), BUNDLE)
                if rel not in drop:
                    z.write(os.path.join(root, f), "eval_bundle/" + rel)
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return path


def _declare_size(path, member, size):
    """Rewrites the uncompressed size `member` declares in the zip's central directory (the field readers trust)."""
    data = bytearray(path.read_bytes())
    name = member.encode()
    at = data.index(b"PK\x01\x02")  # the first central directory header
    while data[at + 46:at + 46 + len(name)] != name or struct.unpack_from("<H", data, at + 28)[0] != len(name):
        at = data.index(b"PK\x01\x02", at + 4)
    struct.pack_into("<I", data, at + 24, size)
    path.write_bytes(bytes(data))
    return path


def _left(base):
    return sorted(n for n in os.listdir(base) if n.startswith("eval_bundle") and n != "eval_bundle.lock")


def test_a_member_the_index_does_not_name_is_never_extracted(base, tmp_path, monkeypatch):
    """
    A good bundle with an extra 4 MB member beside it (a bomb compresses ~1000x, so this stands for any size): the
    bundle is accepted and the extra member is not on disk, nor in the manifest. Catches extracting every member under
    eval_bundle/ (the 3 GiB extra member of a 3 MB zip was written out and hashed on every load).
    """
    z = _zip_bundle(tmp_path / "extra.zip", {"eval_bundle/padding.bin": b"\0" * (4 << 20)})
    assert os.path.getsize(z) < 100_000
    monkeypatch.setenv(core_bundle.URL_ENV, z.as_uri())
    path = core_bundle.ensure_bundle()
    assert not os.path.exists(os.path.join(path, "padding.bin"))
    on_disk = sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs)
    assert on_disk == ["bundle.json", "core.yaml", "eval_data/invented/lm_test.jsonl",
                       "eval_data/invented/mc_test.jsonl", "eval_data/invented/schema_test.jsonl", "eval_meta_data.csv"]


def test_a_named_member_declaring_3_gib_is_refused_before_anything_is_read(base, tmp_path, monkeypatch):
    """
    A task file that declares 3 GiB uncompressed (its real data is a few bytes): refused in one line naming the URL and
    the limit, nothing left in the base dir. Catches a cap applied after extracting (or none: decompressing to the
    declared size), and a cap on the zip's own size instead of what it unpacks to.
    """
    z = _declare_size(_zip_bundle(tmp_path / "bomb.zip"), "eval_bundle/eval_data/invented/lm_test.jsonl", 3 << 30)
    monkeypatch.setenv(core_bundle.URL_ENV, z.as_uri())
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle()
    msg = str(e.value)
    assert "more than the limit of" in msg and z.as_uri() in msg and "\n" not in msg
    assert _left(base) == []


def test_the_cap_counts_every_named_file(base, tmp_path, monkeypatch):
    """
    With the cap one byte under the fixture's total, the bundle is refused; at the total it is accepted. Catches a cap
    on each file alone, or one that leaves out core.yaml or eval_meta_data.csv.
    """
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(BUNDLE) for f in fs)
    z = _zip_bundle(tmp_path / "good.zip", {"eval_bundle/README": b"x" * 100})
    monkeypatch.setenv(core_bundle.URL_ENV, z.as_uri())
    monkeypatch.setattr(core_bundle, "MAX_UNPACKED_BYTES", total - 1)
    with pytest.raises(UserError, match=f"declare {total} bytes uncompressed, more than the limit of {total - 1}"):
        core_bundle.ensure_bundle()
    monkeypatch.setattr(core_bundle, "MAX_UNPACKED_BYTES", total)
    assert os.path.isfile(os.path.join(core_bundle.ensure_bundle(), "core.yaml"))


def test_a_huge_core_yaml_is_refused_before_it_is_parsed(base, tmp_path, monkeypatch):
    """core.yaml declaring 2 GiB is refused in one line. Catches reading the index whole before any cap."""
    z = _declare_size(_zip_bundle(tmp_path / "yaml.zip"), "eval_bundle/core.yaml", 2 << 30)
    monkeypatch.setenv(core_bundle.URL_ENV, z.as_uri())
    with pytest.raises(UserError, match="core.yaml declares 2147483648 bytes"):
        core_bundle.ensure_bundle()
    assert _left(base) == []


@pytest.mark.parametrize("shots", ["[two]", "two", "[]", "[-1]", "[true]", "[1.5]"])
def test_num_fewshot_that_is_not_a_count_is_one_line(tmp_path, shots):
    """
    An own bundle whose core.yaml says num_fewshot: [two] (or empty, negative, a bool, a float): one line naming the
    file, the task and the value. Catches int() on the value (a ValueError traceback, or 1.5 -> 1 and true -> 1
    silently) and [0] on an empty list (IndexError).
    """
    own = tmp_path / "own"
    shutil.copytree(BUNDLE, own)
    yaml_path = own / "core.yaml"
    yaml_path.write_text(yaml_path.read_text().replace("num_fewshot: [2]", f"num_fewshot: {shots}"))
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle(str(own), own=True)
    msg = str(e.value)
    assert str(yaml_path) in msg and "mc_test: num_fewshot" in msg and "expected a count" in msg and "\n" not in msg


def test_missing_files_are_counted_in_the_line(base, tmp_path, monkeypatch):
    """One task file missing: the line names it alone; two: the first and "and 1 more files". Catches a count that is
    off by one or always (never) shown."""
    one = _zip_bundle(tmp_path / "one.zip", drop=("eval_data/invented/lm_test.jsonl",))
    two = _zip_bundle(tmp_path / "two.zip", drop=("eval_data/invented/lm_test.jsonl",
                                                  "eval_data/invented/mc_test.jsonl"))
    for z, tail in ((one, "lm_test.jsonl: not a complete CORE eval bundle"),
                    (two, "lm_test.jsonl and 1 more files: not a complete CORE eval bundle")):
        monkeypatch.setenv(core_bundle.URL_ENV, z.as_uri())
        with pytest.raises(UserError) as e:
            core_bundle.ensure_bundle()
        assert str(e.value).endswith(tail), str(e.value)
        assert _left(base) == []


@pytest.mark.parametrize("method", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_a_named_member_with_damaged_bytes_is_refused(base, tmp_path, monkeypatch, method):
    """
    One byte of a task file's stored data flipped (its CRC, or for deflate its stream, no longer holds): one line
    "not a readable zip", nothing extracted. Catches checking only the index (names and sizes) and not the data, and a
    zlib.error escaping as a traceback.
    """
    z = _zip_bundle(tmp_path / "damaged.zip", method=method)
    data = bytearray(z.read_bytes())
    with zipfile.ZipFile(z) as zf:
        info = zf.getinfo("eval_bundle/eval_data/invented/lm_test.jsonl")
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start + info.compress_size // 2] ^= 0xFF
    z.write_bytes(bytes(data))
    monkeypatch.setenv(core_bundle.URL_ENV, z.as_uri())
    with pytest.raises(UserError, match="is not a readable zip") as e:
        core_bundle.ensure_bundle()
    assert "\n" not in str(e.value)
    assert _left(base) == []


def test_leftovers_of_a_killed_extraction_are_cleared_and_progress_is_shown(base, tmp_path, monkeypatch, capsys):
    """
    A process killed while extracting leaves eval_bundle.tmp and eval_bundle.unzip (with files): the next download
    removes both, says what it downloads, and succeeds. Catches leftovers kept (a stale file would end up in the
    bundle) or cleared under another name than the one written.
    """
    for name in ("eval_bundle.tmp", "eval_bundle.unzip"):
        os.makedirs(base / name / "eval_data")
        (base / name / "eval_data" / "stale.jsonl").write_text("{}\n")
    z = _zip_bundle(tmp_path / "good.zip")
    monkeypatch.setenv(core_bundle.URL_ENV, z.as_uri())
    path = core_bundle.ensure_bundle()
    assert _left(base) == ["eval_bundle"] and not os.path.exists(os.path.join(path, "eval_data", "stale.jsonl"))
    out = capsys.readouterr().out
    assert f"downloading the CORE eval bundle (~162 MB) from {z.as_uri()}" in out
    assert re.search(rf"eval bundle ready at {re.escape(path)} \(\d{{1,2}}s\)", out), out
    marker = json.loads((base / "eval_bundle" / "bundle.json").read_text())
    assert marker["url"] == z.as_uri() and re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", marker["downloaded"])


def test_a_bundle_with_a_bad_row_is_not_usable(base, tmp_path, monkeypatch):
    """A zip whose task file has a row without its fields: one line naming the URL and "not usable", nothing left."""
    z = _zip_bundle(tmp_path / "badrow.zip", drop=("eval_data/invented/lm_test.jsonl",),
                    extra={"eval_bundle/eval_data/invented/lm_test.jsonl": b'{"context": "a"}\n'})
    monkeypatch.setenv(core_bundle.URL_ENV, z.as_uri())
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle()
    assert str(e.value).startswith(f"the eval bundle from {z.as_uri()} is not usable: ") and "\n" not in str(e.value)
    assert _left(base) == []


def test_offline_says_what_to_do(base, monkeypatch):
    """No network: the one line says how to get the bundle another way (a file:// copy, or an own bundle)."""
    monkeypatch.setenv(core_bundle.URL_ENV, "http://127.0.0.1:9/eval_bundle.zip")
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle()
    msg = str(e.value)
    assert "no network? fetch eval_bundle.zip elsewhere" in msg and "--own_eval_bundle=True" in msg
    assert "\n" not in msg and _left(base) == []


def test_a_bundle_that_changes_after_its_check_is_refused(base, tmp_path, monkeypatch):
    """
    The downloaded bundle, a hand copy of it (accepted as the pinned one) and an own bundle: each passes
    verify_bundle as accepted, and each fails it in one line once a task file changes. A copy that differs from the
    pinned record, and a path that is not a directory, are refused. Catches a manifest not recorded at acceptance,
    verify_bundle checking nothing, and a hand copy compared with nothing.
    """
    monkeypatch.setenv(core_bundle.URL_ENV, _zip_bundle(tmp_path / "good.zip").as_uri())
    pinned = core_bundle.ensure_bundle()
    copy, own = tmp_path / "copy", tmp_path / "own"
    shutil.copytree(pinned, copy)
    shutil.copytree(BUNDLE, own)
    assert core_bundle.ensure_bundle(str(copy)) == str(copy)
    assert core_bundle.ensure_bundle(str(own), own=True) == str(own)
    for path in (pinned, str(copy), str(own)):
        core_bundle.verify_bundle(path)
        with open(os.path.join(path, "eval_data", "invented", "lm_test.jsonl"), "a") as f:
            f.write('{"context": "b", "continuation": "b"}\n')
        with pytest.raises(UserError, match="the CORE eval bundle changed after it was checked") as e:
            core_bundle.verify_bundle(path)
        assert "lm_test.jsonl" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="not the pinned CORE bundle"):
        core_bundle.ensure_bundle(str(copy))
    with pytest.raises(UserError, match=f"--eval_bundle={tmp_path}/none: not a directory"):
        core_bundle.ensure_bundle(str(tmp_path / "none"))
