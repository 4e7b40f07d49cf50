"""
The CORE eval bundle (one zip, the same one nanochat downloads): core.yaml (the task list: label, dataset_uri,
num_fewshot, icl_task_type, continuation_delimiter), eval_meta_data.csv (each task's random baseline in percent; the
bundle's own file, an older DCLM version, which nanochat's numbers use) and eval_data/*.jsonl (the rows). How it is
had, checked and read; the metric itself is nanotrain.evaluation.core_eval.

Where it comes from:
- downloaded once per machine from EVAL_BUNDLE_URL (or $NANOTRAIN_EVAL_BUNDLE_URL: a mirror, or file:///path to a
  copy of eval_bundle.zip fetched elsewhere) into <base_dir>/eval_bundle with nanotrain.downloads.ensure_built: the
  zip checked (core.yaml's tasks present, the sizes they declare capped, their CRCs), only the files core.yaml names
  extracted (any other member is never read: a zip bomb beside them costs nothing), every task file read and checked,
  then its marker bundle.json records every file's sha256 and row count. That record is checked on every load; a file that
  differs is fetched again once.
- a directory copied by hand (--eval_bundle=DIR): compared file by file with the record of the pinned bundle this
  machine downloaded, and refused in one line when it differs or when there is no such record, unless the user says
  it is their own bundle (--own_eval_bundle=True): then it is only checked for being readable and well formed, and
  its files recorded as they are at that check, so that a change during the run is found.
A bundle is well formed when core.yaml parses, every task has a finite random baseline in [0, 100) and a data file of
UTF-8 JSON-object lines, at least one, each with its task type's fields (multiple_choice: query, choices, gold;
schema: context_options, continuation, gold; language_modeling: context, continuation) and gold inside its options.
The eval bundle's sha256 cannot be pinned in this code: no machine its tests run on can fetch it.
"""

import csv
import json
import math
import os
import shutil
import time
import zipfile
import zlib

from nanotrain.common import get_base_dir, print0
from nanotrain.downloads import check_manifest, download, ensure_built, file_manifest, read_manifest, write_marker
from nanotrain.durable import best_copy, is_complete
from nanotrain.errors import UserError

EVAL_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
URL_ENV = "NANOTRAIN_EVAL_BUNDLE_URL"  # overrides EVAL_BUNDLE_URL (a mirror; file:// works)
BUNDLE_SIZE = "~162 MB"
BUNDLE_DIR = "eval_bundle"  # under the base directory, and the zip's top-level folder
MARKER = "bundle.json"  # written last into an extracted bundle: a directory holding it is complete
TASK_TYPES = ("multiple_choice", "schema", "language_modeling")
FIELDS = {"multiple_choice": ("query", "choices"), "schema": ("context_options", "continuation"),
          "language_modeling": ("context", "continuation")}
OWN_FLAG = "--own_eval_bundle=True"
MAX_UNPACKED_BYTES = 2 << 30  # the files core.yaml names, uncompressed, as declared (the pinned zip: ~162 MB)
MAX_INDEX_BYTES = 1 << 20  # core.yaml itself
_ACCEPTED = {}  # bundle directory -> the file manifest it was accepted with (checked again by verify_bundle)


def parse_task_list(text, where):
    """
    The tasks of a core.yaml text: a list of dicts {"label", "dataset_uri", "num_fewshot" (int: the first of the
    file's list), "task_type", "delimiter" (continuation_delimiter, default " ")}. Raises UserError naming `where`
    when the text is not YAML, has no icl_tasks list, or a task lacks a field, has an unknown icl_task_type or a
    num_fewshot that is not a count.
    """
    import yaml
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise UserError(f"{where}: not valid YAML ({str(e).splitlines()[0]})") from None
    items = doc.get("icl_tasks") if isinstance(doc, dict) else None
    if not isinstance(items, list) or not items:
        raise UserError(f"{where}: expected a non-empty 'icl_tasks' list")
    tasks = []
    for t in items:
        if not isinstance(t, dict) or not all(k in t for k in ("label", "dataset_uri", "num_fewshot", "icl_task_type")):
            raise UserError(f"{where}: task {t!r:.80}: needs label, dataset_uri, num_fewshot and icl_task_type")
        if t["icl_task_type"] not in TASK_TYPES:
            raise UserError(f"{where}: task {t['label']}: icl_task_type {t['icl_task_type']!r}, expected one of "
                            f"{', '.join(TASK_TYPES)}")
        shots = t["num_fewshot"][0] if isinstance(t["num_fewshot"], list) and t["num_fewshot"] else t["num_fewshot"]
        if type(shots) is not int or shots < 0:
            raise UserError(f"{where}: task {t['label']}: num_fewshot {t['num_fewshot']!r:.40}, expected a count "
                            f"(an integer >= 0, or a list whose first item is one)")
        tasks.append({"label": str(t["label"]), "dataset_uri": str(t["dataset_uri"]), "num_fewshot": shots,
                      "task_type": t["icl_task_type"], "delimiter": str(t.get("continuation_delimiter", " "))})
    return tasks



def read_bundle(bundle_dir):
    """
    The tasks (parse_task_list) and random baselines (dict label -> percent, float) of the extracted bundle in
    `bundle_dir`. Raises UserError naming the file (and line) when core.yaml or eval_meta_data.csv is missing, not
    UTF-8 or malformed, a task's data file is missing, or a task has no baseline or one that is not a finite number in
    [0, 100).
    """
    yaml_path = os.path.join(bundle_dir, "core.yaml")
    csv_path = os.path.join(bundle_dir, "eval_meta_data.csv")
    for p in (yaml_path, csv_path):
        if not os.path.isfile(p):
            raise UserError(f"{bundle_dir} is not a CORE eval bundle: {os.path.basename(p)} is missing (expected "
                            f"core.yaml, eval_meta_data.csv and eval_data/)")
    tasks = parse_task_list(_text(yaml_path), yaml_path)
    baselines = {}
    reader = csv.DictReader(_text(csv_path).splitlines())
    for row in reader:
        try:
            b = float(row["Random baseline"])
            label = row["Eval Task"]
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{csv_path}:{reader.line_num}: expected the columns 'Eval Task' and 'Random baseline' "
                            f"with a number, got {dict(row)!r:.100}") from None
        if not (math.isfinite(b) and 0 <= b < 100):
            raise UserError(f"{csv_path}:{reader.line_num}: task {label}: random baseline {row['Random baseline']!r}, "
                            f"expected a number in [0, 100) (percent)")
        baselines[label] = b
    for t in tasks:
        if not os.path.isfile(os.path.join(bundle_dir, "eval_data", t["dataset_uri"])):
            raise UserError(f"{bundle_dir}: task {t['label']}: eval_data/{t['dataset_uri']} is missing")
        if t["label"] not in baselines:
            raise UserError(f"{csv_path}: no random baseline for task {t['label']}")
    return tasks, baselines


def _text(path):
    """The UTF-8 text of `path`; UserError naming the file, line and byte offset of the first invalid byte."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 (byte {e.start}: {e.reason})") from None


def check_row(row, task_type):
    """None when `row` (a JSON value) is a well-formed row of `task_type`, else what is wrong (a phrase)."""
    if not isinstance(row, dict):
        return "expected a JSON object"
    missing = [k for k in FIELDS[task_type] if k not in row]
    if missing:
        return f"a {task_type} row needs {', '.join(FIELDS[task_type])} (no {missing[0]})"
    if task_type == "language_modeling":
        ok = all(isinstance(row[k], str) for k in FIELDS[task_type])
        return None if ok else "context and continuation must be strings"
    options = row[FIELDS[task_type][0]] if task_type == "schema" else row["choices"]
    if not isinstance(options, list) or len(options) < 2 or not all(isinstance(o, str) for o in options):
        return f"{'context_options' if task_type == 'schema' else 'choices'} must be a list of 2 or more strings"
    gold = row.get("gold", 0)
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(options):
        return f"gold {gold!r} is not the index of one of its {len(options)} options"
    return None


def load_rows(bundle_dir, task):
    """The rows (list of dicts) of `task`'s JSONL file in the bundle, in file order (blank lines skipped). Raises
    UserError naming file:line for a line that is not UTF-8, not JSON or not a well-formed row (check_row), and
    naming the file when it holds no row."""
    path = os.path.join(bundle_dir, "eval_data", task["dataset_uri"])
    rows = []
    for n, line in enumerate(_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not valid JSON ({e}); the file is cut or damaged") from None
        problem = check_row(row, task["task_type"])
        if problem is not None:
            raise UserError(f"{path}:{n}: {problem}")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: no rows (an empty file); task {task['label']} cannot be scored")
    return rows


def check_bundle(bundle_dir):
    """read_bundle, then load_rows of every task: raises the first UserError of either (one line)."""
    tasks, _ = read_bundle(bundle_dir)
    for t in tasks:
        load_rows(bundle_dir, t)


def check_zip(zip_path, url):
    """
    Checks a downloaded bundle before anything is extracted: the zip's index reads, its eval_bundle/core.yaml parses,
    eval_meta_data.csv and every data file core.yaml names are members, the sizes those members declare add up to at
    most MAX_UNPACKED_BYTES, and each of them passes its CRC. Returns the member names to extract (only those: any
    other member, however large, is never read). Raises UserError (one line naming `url`) otherwise.
    """
    core = f"{BUNDLE_DIR}/core.yaml"
    try:
        with zipfile.ZipFile(zip_path) as z:
            infos = {i.filename: i for i in z.infolist()}
            if core not in infos:
                raise UserError(f"the eval bundle from {url} has no {core}: not a CORE eval bundle")
            if infos[core].file_size > MAX_INDEX_BYTES:
                raise UserError(f"the eval bundle from {url}: {core} declares {infos[core].file_size} bytes, more "
                                f"than the {MAX_INDEX_BYTES} a task list needs: not a CORE eval bundle")
            tasks = parse_task_list(z.read(core).decode("utf-8"), f"{url}: {core}")
            needed = [core, f"{BUNDLE_DIR}/eval_meta_data.csv"] + sorted(
                {f"{BUNDLE_DIR}/eval_data/{t['dataset_uri']}" for t in tasks})
            missing = [n for n in needed if n not in infos]
            if missing:
                raise UserError(f"the eval bundle from {url} lacks {missing[0]}"
                                + (f" and {len(missing) - 1} more files" if len(missing) > 1 else "")
                                + ": not a complete CORE eval bundle")
            total = sum(infos[n].file_size for n in needed)
            if total > MAX_UNPACKED_BYTES:
                raise UserError(f"the eval bundle from {url}: its {len(needed)} files declare {total} bytes "
                                f"uncompressed, more than the limit of {MAX_UNPACKED_BYTES}: not the CORE eval bundle")
            for n in needed:
                with z.open(n) as f:  # reading to the end checks the CRC (BadZipFile otherwise)
                    while f.read(1 << 20):
                        pass
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, UnicodeDecodeError) as e:
        raise UserError(f"the eval bundle from {url} is not a readable zip ({e}): truncated or damaged; run again to "
                        f"download it again") from None
    return needed


def pinned_manifest():
    """The file manifest of the pinned bundle as this machine downloaded it (<base_dir>/eval_bundle/bundle.json), or
    None when it has not downloaded it."""
    final = os.path.join(get_base_dir(), BUNDLE_DIR)
    return read_manifest(final, MARKER) if is_complete(final, MARKER) else None


def ensure_bundle(eval_bundle="", own=False):
    """
    The directory of the CORE eval bundle, checked (see the module docstring). With `eval_bundle` (a directory copied
    by hand): that directory, compared with the pinned bundle's record (pinned_manifest) unless `own` (the user's own
    bundle: only check_bundle). Otherwise <base_dir>/eval_bundle, downloaded once per machine (ensure_built: under a
    lock, verified on every call, fetched again once when a file differs). Raises UserError, one line, when the
    download fails (naming the URL, the size and what to do), the zip or a file is bad, a copy differs from the pinned
    bundle or cannot be compared with it; nothing is extracted then.
    """
    final = os.path.join(get_base_dir(), BUNDLE_DIR)
    if not eval_bundle and os.path.isdir(final) and best_copy(final, MARKER) is None:
        raise UserError(f"{final} has no {MARKER}: it was placed there by hand, so it cannot be checked against the "
                        f"pinned bundle; move it away to download the bundle, or pass --eval_bundle={final} "
                        f"{OWN_FLAG} to use it as your own bundle")
    if not eval_bundle:
        path = ensure_built(BUNDLE_DIR, MARKER, _build)
        _ACCEPTED[path] = read_manifest(path, MARKER)
        return path
    path = os.path.abspath(os.path.expanduser(eval_bundle))
    if not os.path.isdir(path):
        raise UserError(f"--eval_bundle={eval_bundle}: not a directory")
    if own:
        check_bundle(path)
        _ACCEPTED[path] = file_manifest(path, skip=(MARKER,))
        return path
    pinned = pinned_manifest()
    if pinned is None:
        raise UserError(f"--eval_bundle={eval_bundle}: cannot check it against the pinned CORE bundle, whose file "
                        f"checksums this machine records when it downloads it ({final}/{MARKER}: none); run without "
                        f"--eval_bundle to download it ({URL_ENV}=file:///path/eval_bundle.zip takes a copy of the zip), "
                        f"or pass {OWN_FLAG} if this is your own bundle")
    problem = check_manifest(path, pinned)
    if problem is not None:
        raise UserError(f"--eval_bundle={eval_bundle}: {problem}: not the pinned CORE bundle; use the downloaded one "
                        f"(no --eval_bundle), or pass {OWN_FLAG} if this is your own bundle")
    check_bundle(path)
    _ACCEPTED[path] = pinned
    return path


def verify_bundle(bundle_dir):
    """
    Checks `bundle_dir` again before a CORE evaluation reads it: its files against the manifest ensure_bundle accepted
    them with (or, for a directory ensure_bundle has not seen in this process, the one in its own marker, if any).
    Raises UserError (one line: the file, what differs, what to do) when they differ.
    """
    path = os.path.abspath(bundle_dir)
    files = _ACCEPTED.get(path) or read_manifest(path, MARKER)
    problem = None if files is None else check_manifest(path, files)
    if problem is not None:
        raise UserError(f"{problem}: the CORE eval bundle changed after it was checked; run again (a downloaded "
                        f"bundle is then fetched again)")


def _build(base, final):
    """ensure_built's builder: downloads the zip, checks it, extracts it into final.tmp, checks every file, writes
    the marker with the file manifest and commits it. Nothing is left behind on failure."""
    from nanotrain.durable import commit
    url = os.environ.get(URL_ENV) or EVAL_BUNDLE_URL
    zip_path, tmp, unzip = os.path.join(base, BUNDLE_DIR + ".zip"), final + ".tmp", final + ".unzip"
    print0(f"downloading the CORE eval bundle ({BUNDLE_SIZE}) from {url}")
    t0 = time.time()
    try:
        for p in (tmp, unzip):  # left by a process killed while extracting
            if os.path.isdir(p):
                shutil.rmtree(p)
        download(url, zip_path, f"the CORE eval bundle ({BUNDLE_SIZE})",
                 f"no network? fetch eval_bundle.zip elsewhere and set {URL_ENV}=file:///path/eval_bundle.zip, or "
                 f"pass --eval_bundle=DIR {OWN_FLAG} (an unzipped bundle, used unchecked against the pinned one)")
        members = check_zip(zip_path, url)
        with zipfile.ZipFile(zip_path) as z:
            z.extractall(unzip, members)
        os.rename(os.path.join(unzip, BUNDLE_DIR), tmp)
        try:
            check_bundle(tmp)
        except UserError as e:
            raise UserError(f"the eval bundle from {url} is not usable: {e}") from None
        write_marker(tmp, MARKER, {"url": url, "downloaded": time.strftime("%Y-%m-%d %H:%M:%S")})
        commit(tmp, final, MARKER)
    finally:
        for p in (tmp, unzip):
            if os.path.isdir(p):
                shutil.rmtree(p)
        if os.path.exists(zip_path):
            os.remove(zip_path)
    print0(f"eval bundle ready at {final} ({time.time() - t0:.0f}s)")
