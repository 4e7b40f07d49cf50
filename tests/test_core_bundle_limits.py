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


MC, SCHEMA, LM = "multiple_choice", "schema", "language_modeling"
CHOICES_MSG, OPTIONS_MSG = "choices must be a list of 2 or more strings", "context_options must be a list of 2 or more strings"


@pytest.mark.parametrize("row, task_type, problem", [
    ({"query": "q", "choices": ["a", "b"]}, MC, None),  # gold defaults to 0
    ({"query": "q", "choices": ["a", "b"], "gold": 1}, MC, None),
    ({"context_options": ["a", "b"], "continuation": "c", "gold": 1}, SCHEMA, None),
    ({"context": "a", "continuation": "b"}, LM, None),
    (["q", ["a", "b"]], MC, "expected a JSON object"),
    ({"query": "q"}, MC, "a multiple_choice row needs query, choices (no choices)"),
    ({"choices": ["a", "b"]}, MC, "a multiple_choice row needs query, choices (no query)"),
    ({"context_options": ["a", "b"]}, SCHEMA, "a schema row needs context_options, continuation (no continuation)"),
    ({"continuation": "b"}, LM, "a language_modeling row needs context, continuation (no context)"),
    ({"context": 1, "continuation": "b"}, LM, "context and continuation must be strings"),
    ({"context": "a", "continuation": ["b"]}, LM, "context and continuation must be strings"),
    ({"query": "q", "choices": ["a"]}, MC, CHOICES_MSG),
    ({"query": "q", "choices": "ab"}, MC, CHOICES_MSG),
    ({"query": "q", "choices": ["a", 2]}, MC, CHOICES_MSG),
    ({"context_options": ["a"], "continuation": "c"}, SCHEMA, OPTIONS_MSG),
    ({"query": "q", "choices": ["a", "b"], "gold": 2}, MC, "gold 2 is not the index of one of its 2 options"),
    ({"query": "q", "choices": ["a", "b"], "gold": -1}, MC, "gold -1 is not the index of one of its 2 options"),
    ({"query": "q", "choices": ["a", "b"], "gold": True}, MC, "gold True is not the index of one of its 2 options"),
    ({"query": "q", "choices": ["a", "b"], "gold": "0"}, MC, "gold '0' is not the index of one of its 2 options"),
    ({"context_options": ["a", "b", "c"], "continuation": "d", "gold": 3}, SCHEMA,
     "gold 3 is not the index of one of its 3 options")])
def test_check_row_says_what_is_wrong(row, task_type, problem):
    """Rows of each task type, well formed (None) or not (the phrase a bad-row line carries). Catches a field looked
    up in the wrong row type (choices for schema), one condition of a check alone (`and` for `or`), a gold of 1 or
    len(options) accepted or of 0 refused, a bool taken for an index, and a phrase naming the wrong field."""
    assert core_bundle.check_row(row, task_type) == problem


TASK = "{label: %s, dataset_uri: x.jsonl, num_fewshot: %s, icl_task_type: %s}"


@pytest.mark.parametrize("text, problem", [
    ("icl_tasks: [", "W: not valid YAML (while parsing a flow node)"),
    ("- 1\n- 2\n", "W: expected a non-empty 'icl_tasks' list"),
    ("icl_tasks: []", "W: expected a non-empty 'icl_tasks' list"),
    ("icl_tasks: [5]", "W: task 5: needs label, dataset_uri, num_fewshot and icl_task_type"),
    ("icl_tasks: [{label: a, dataset_uri: x.jsonl, num_fewshot: [0]}]", "W: task {'label': 'a', 'dataset_uri': "
     "'x.jsonl', 'num_fewshot': [0]}: needs label, dataset_uri, num_fewshot and icl_task_type"),
    ("icl_tasks: [" + TASK % ("a", "[0]", "generation") + "]",
     "W: task a: icl_task_type 'generation', expected one of multiple_choice, schema, language_modeling")])
def test_a_task_list_that_is_not_one_is_one_line(text, problem):
    """core.yaml texts that are not task lists: one line naming the file (`where`) and the task. Catches a check on
    one condition alone, a message that drops the YAML error's first line or the unknown type."""
    with pytest.raises(UserError) as e:
        core_bundle.parse_task_list(text, "W")
    assert str(e.value) == problem


def test_a_task_list_is_read_as_written():
    """num_fewshot a list (its first item), a bare count, or 0; the label a number; the delimiter given (kept, a
    newline too) or absent (" "). Catches the second item of the list taken, a bare count indexed, 0 shots refused,
    and another default delimiter."""
    text = ("icl_tasks:\n- " + TASK % (7, "[5, 10]", "schema") + "\n- " + TASK % ("b", 3, "multiple_choice")
            + "\n- {label: c, dataset_uri: y.jsonl, num_fewshot: 0, icl_task_type: language_modeling, "
              "continuation_delimiter: \"\\n\"}\n")
    assert core_bundle.parse_task_list(text, "W") == [
        {"label": "7", "dataset_uri": "x.jsonl", "num_fewshot": 5, "task_type": "schema", "delimiter": " "},
        {"label": "b", "dataset_uri": "x.jsonl", "num_fewshot": 3, "task_type": "multiple_choice", "delimiter": " "},
        {"label": "c", "dataset_uri": "y.jsonl", "num_fewshot": 0, "task_type": "language_modeling",
         "delimiter": "\n"}]


@pytest.mark.parametrize("damage, problem", [
    ("no core.yaml", "{d} is not a CORE eval bundle: core.yaml is missing (expected core.yaml, eval_meta_data.csv "
                     "and eval_data/)"),
    ("no eval_meta_data.csv", "{d} is not a CORE eval bundle: eval_meta_data.csv is missing"),
    ("no data file", "{d}: task lm_test: eval_data/invented/lm_test.jsonl is missing"),
    ("no baseline", "{d}/eval_meta_data.csv: no random baseline for task lm_test"),
    ("baseline 'x'", "{d}/eval_meta_data.csv:3: expected the columns 'Eval Task' and 'Random baseline' with a number, "
                     "got {{'Eval Task': 'schema_test'"),
    ("baseline 100", "{d}/eval_meta_data.csv:3: task schema_test: random baseline '100', expected a number in "
                     "[0, 100) (percent)"),
    ("baseline 150", "{d}/eval_meta_data.csv:3: task schema_test: random baseline '150'"),
    ("baseline -1", "{d}/eval_meta_data.csv:3: task schema_test: random baseline '-1'"),
    ("core.yaml not UTF-8", "{d}/core.yaml:3: not UTF-8 (byte "),
])
def test_a_damaged_bundle_is_one_line_naming_the_file(tmp_path, damage, problem):
    """The fixture bundle with one thing wrong: read_bundle's one line names the file, the line where there is one,
    the task and the value. Catches a file looked for under another name, a baseline of 100 (or above) accepted, a
    bound check on one condition alone, a line number off by one and a task without a baseline accepted."""
    d = tmp_path / "bundle"
    shutil.copytree(BUNDLE, d)
    csv_path, yaml_path = d / "eval_meta_data.csv", d / "core.yaml"
    lines = csv_path.read_text().splitlines(keepends=True)
    if damage.startswith("no "):
        name = {"no core.yaml": "core.yaml", "no eval_meta_data.csv": "eval_meta_data.csv",
                "no data file": "eval_data/invented/lm_test.jsonl"}.get(damage)
        if name:
            os.remove(d / name)
        else:
            csv_path.write_text("".join(lines[:3]))
    elif damage.startswith("baseline"):
        lines[2] = lines[2].replace(",50,", f",{damage.split(' ', 1)[1].strip(chr(39))},")
        csv_path.write_text("".join(lines))
    else:
        yaml_path.write_bytes(b"# ok\n#\n# \xff\n" + yaml_path.read_bytes())
    with pytest.raises(UserError) as e:
        core_bundle.read_bundle(str(d))
    assert str(e.value).startswith(problem.format(d=d)), str(e.value)


def test_rows_are_read_in_order_with_their_line_numbers(tmp_path):
    """load_rows on a task file with blank lines: the rows in file order, blank lines skipped but counted in the
    file:line of a line that is not JSON, not UTF-8 (with its byte offset) or not a well-formed row; a file with no
    row is one line naming the task. Catches stopping at the first blank line, line numbers off by one (or counting
    from the wrong end), and a row checked against another task type."""
    path = tmp_path / "eval_data" / "t.jsonl"
    path.parent.mkdir()
    task = {"label": "t", "dataset_uri": "t.jsonl", "task_type": LM}
    a, b = {"context": "a", "continuation": "b"}, {"context": "c", "continuation": "d"}
    path.write_text(f"{json.dumps(a)}\n\n   \n{json.dumps(b)}\n")
    assert core_bundle.load_rows(str(tmp_path), task) == [a, b]
    for data, problem in ((f"\n{json.dumps(a)}\n{{oops\n", ":3: not valid JSON ("),
                          (f"{json.dumps(a)}\n\n{json.dumps({'context': 'c'})}\n",
                           ":3: a language_modeling row needs context, continuation (no continuation)"),
                          ("\n\n  \n", ": no rows (an empty file); task t cannot be scored")):
        path.write_text(data)
        with pytest.raises(UserError) as e:
            core_bundle.load_rows(str(tmp_path), task)
        assert str(e.value).startswith(f"{path}{problem}"), str(e.value)
    path.write_bytes(b"\n" + json.dumps(a).encode() + b"\n\xff\n\n")
    with pytest.raises(UserError) as e:
        core_bundle.load_rows(str(tmp_path), task)
    assert str(e.value) == f"{path}:3: not UTF-8 (byte {2 + len(json.dumps(a))}: invalid start byte)"


def test_a_hand_copy_needs_the_pinned_record_and_verify_reads_the_marker(base, tmp_path, monkeypatch):
    """
    Before this machine has downloaded the bundle, a hand copy (not --own_eval_bundle) is refused in one line saying
    there is no record to compare it with and what to do. In a process that has not accepted it (the record of
    accepted bundles empty), verify_bundle checks a downloaded bundle against its own marker: it passes, then fails
    once a task file changes. Catches a hand copy accepted unchecked when no record exists, and verify_bundle
    checking nothing for a bundle this process did not accept.
    """
    copy = tmp_path / "copy"
    shutil.copytree(BUNDLE, copy)
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle(str(copy))
    msg = str(e.value)
    assert msg.startswith(f"--eval_bundle={copy}: cannot check it against the pinned CORE bundle")
    assert f"({base}/eval_bundle/bundle.json: none)" in msg and "--own_eval_bundle=True" in msg and "\n" not in msg
    monkeypatch.setenv(core_bundle.URL_ENV, _zip_bundle(tmp_path / "good.zip").as_uri())
    path = core_bundle.ensure_bundle()
    monkeypatch.setattr(core_bundle, "_ACCEPTED", {})
    core_bundle.verify_bundle(path)
    with open(os.path.join(path, "eval_data", "invented", "mc_test.jsonl"), "a") as f:
        f.write('{"query": "q", "choices": ["a", "b"]}\n')
    with pytest.raises(UserError, match="mc_test.jsonl.*the CORE eval bundle changed after it was checked"):
        core_bundle.verify_bundle(path)


def test_a_damaged_bundle_is_fetched_again_over_a_killed_refetchs_leftovers(base, tmp_path, monkeypatch, capsys):
    """
    A downloaded bundle whose task file changed, beside the eval_bundle.tmp and eval_bundle.unzip a re-fetch killed
    midway left (the path where no recovery runs first: the bundle itself is complete): the next load fetches it
    again, the file is whole again and both leftovers are gone. Catches the leftovers cleared under other names than
    the ones written (a stale .tmp kept forever beside the bundle).
    """
    monkeypatch.setenv(core_bundle.URL_ENV, _zip_bundle(tmp_path / "good.zip").as_uri())
    path = core_bundle.ensure_bundle()
    task_file = os.path.join(path, "eval_data", "invented", "lm_test.jsonl")
    good = open(task_file).read()
    with open(task_file, "a") as f:
        f.write('{"context": "x", "continuation": "y"}\n')
    for name in ("eval_bundle.tmp", "eval_bundle.unzip"):
        os.makedirs(base / name / "eval_data")
        (base / name / "eval_data" / "stale.jsonl").write_text("{}\n")
    assert core_bundle.ensure_bundle() == path
    assert "fetching eval_bundle again" in capsys.readouterr().out
    assert open(task_file).read() == good and _left(base) == ["eval_bundle"]


def test_a_core_yaml_at_the_cap_is_read(base, tmp_path, monkeypatch):
    """With the index cap set to core.yaml's own size the bundle is accepted, one byte under it refused. Catches an
    off-by-one cap (>= for >) that refuses an index of exactly the allowed size."""
    size = os.path.getsize(os.path.join(BUNDLE, "core.yaml"))
    monkeypatch.setenv(core_bundle.URL_ENV, _zip_bundle(tmp_path / "good.zip").as_uri())
    monkeypatch.setattr(core_bundle, "MAX_INDEX_BYTES", size - 1)
    with pytest.raises(UserError, match=f"core.yaml declares {size} bytes, more than the {size - 1}"):
        core_bundle.ensure_bundle()
    monkeypatch.setattr(core_bundle, "MAX_INDEX_BYTES", size)
    assert os.path.isfile(os.path.join(core_bundle.ensure_bundle(), "core.yaml"))


@pytest.mark.parametrize("case", ["no core.yaml", "bad task type"])
def test_a_zip_whose_index_is_wrong_is_one_line_naming_the_url(base, tmp_path, monkeypatch, case):
    """A zip without eval_bundle/core.yaml, or whose core.yaml has an unknown task type: one line naming the URL (and
    the member), nothing left. Catches a message that loses what is wrong or where it came from."""
    if case == "no core.yaml":
        z, want = _zip_bundle(tmp_path / "z.zip", drop=("core.yaml",)), "has no eval_bundle/core.yaml: not a CORE eval bundle"
    else:
        text = open(os.path.join(BUNDLE, "core.yaml")).read().replace("icl_task_type: schema", "icl_task_type: other")
        z = _zip_bundle(tmp_path / "z.zip", drop=("core.yaml",), extra={"eval_bundle/core.yaml": text})
        want = ": eval_bundle/core.yaml: task schema_test: icl_task_type 'other', expected one of"
    monkeypatch.setenv(core_bundle.URL_ENV, z.as_uri())
    with pytest.raises(UserError) as e:
        core_bundle.ensure_bundle()
    assert z.as_uri() in str(e.value) and want in str(e.value) and _left(base) == []


def test_a_hand_copy_without_its_marker_is_verified_against_the_pinned_record(base, tmp_path, monkeypatch):
    """A hand copy of the downloaded bundle without its bundle.json is accepted as the pinned one (its files match
    the record), and verify_bundle still finds a later change, against the record it was accepted with. Catches
    verify_bundle falling back to the copy's own (absent) marker and checking nothing."""
    monkeypatch.setenv(core_bundle.URL_ENV, _zip_bundle(tmp_path / "good.zip").as_uri())
    copy = tmp_path / "copy"
    shutil.copytree(core_bundle.ensure_bundle(), copy)
    os.remove(copy / "bundle.json")
    assert core_bundle.ensure_bundle(str(copy)) == str(copy)
    core_bundle.verify_bundle(str(copy))
    with open(copy / "eval_data" / "invented" / "schema_test.jsonl", "a") as f:
        f.write('{"context_options": ["a", "b"], "continuation": "c", "gold": 0}\n')
    with pytest.raises(UserError, match="schema_test.jsonl.*changed after it was checked"):
        core_bundle.verify_bundle(str(copy))
