"""
Pretraining text: where the documents come from (resolve_data_files) and reading them in order (iter_documents).

Data sources (the --data setting of the scripts):
- "builtin" (the default; offline): Python's own documentation, built once as parquet shards under
  <base_dir>/data/builtin/ (nanotrain.builtin_corpus).
- a local directory (its files, not recursive), a glob, or a single file, of:
  .parquet (a `text` column; one document per row), .jsonl (one JSON object per non-blank line with a "text" string),
  .txt (the whole file is one document). Files whose basename starts with "val" are the validation split and the
  rest train; with no such file, the last file in sorted order is validation and the others train.
- "fineweb-edu": shards of karpathy/fineweb-edu-100b-shuffle on the Hugging Face hub (FineWeb-Edu sample-100BT,
  shuffled, 1,823 parquet shards of ~250M characters; the last shard, shard_01822, is the validation split), the
  first `num_shards` (or $NANOTRAIN_FINEWEB_SHARDS, default 8) for train. Shards already under
  <base_dir>/data/fineweb-edu/ are used without network access; missing ones are downloaded.
Each split must hold at least one document with a non-whitespace character (resolve_data_files checks).

`python -m nanotrain.dataset` builds the builtin corpus and prints its statistics.
"""

import glob
import json
import os
import re
import time

from nanotrain.builtin_corpus import build_builtin_corpus, builtin_stats
from nanotrain.common import get_base_dir, print0, run_script
from nanotrain.downloads import hub_endpoint, offline_mode, unreachable_reason
from nanotrain.errors import UserError

SPLITS = ("train", "val")
EXTENSIONS = (".parquet", ".jsonl", ".txt")
DATA_HINT = "use --data=builtin (the offline default) or --data=/path/to/dir of parquet/jsonl/txt files"

LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # left in a str by JSON's "\\ud800" escapes (valid JSON, not Unicode)

FINEWEB_REPO = "karpathy/fineweb-edu-100b-shuffle"
FINEWEB_LAST_SHARD = 1822  # shard_01822.parquet, the validation shard
FINEWEB_DEFAULT_SHARDS = 8


def _reason(e):
    """The first line of an exception's message, printable characters only."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return "".join(c for c in text if c.isprintable()).strip()


# -----------------------------------------------------------------------------
# local files

def _split_files(files, split, what):
    """Applies the validation rule to sorted `files`; `what` names the source in errors."""
    val = [f for f in files if os.path.basename(f).startswith("val")]
    if val:
        train = [f for f in files if f not in val]
    elif len(files) == 1:
        raise UserError(f"--data={what}: only one file ({files[0]}) but the validation split needs its own file: add "
                        f"a file whose name starts with 'val', or give 2+ files (the last in sorted order is then val)")
    else:
        train, val = files[:-1], files[-1:]
    if split == "train" and not train:
        raise UserError(f"--data={what}: every file is a validation file (name starts with 'val'); "
                        f"add training files")
    return train if split == "train" else val


def _local_files(data, split):
    if os.path.isdir(data):
        files = [os.path.join(data, f) for f in os.listdir(data)]
        files = [f for f in files if os.path.isfile(f) and f.endswith(EXTENSIONS)]
        where = f"directory {data}"
    elif any(c in data for c in "*?["):
        files = [f for f in glob.glob(data) if os.path.isfile(f) and f.endswith(EXTENSIONS)]
        where = f"glob {data}"
    elif os.path.isfile(data):
        if not data.endswith(EXTENSIONS):
            raise UserError(f"--data={data}: unsupported file type; expected .parquet, .jsonl or .txt")
        files = [data]
        where = f"file {data}"
    else:
        raise UserError(f"--data={data}: no such directory or file and no glob pattern; expected 'builtin', "
                        f"'fineweb-edu', or a directory / glob of .parquet, .jsonl or .txt files")
    if not files:
        raise UserError(f"--data={data}: no .parquet, .jsonl or .txt files in {where}")
    return _split_files(sorted(files), split, data)


# -----------------------------------------------------------------------------
# fineweb-edu from the Hugging Face hub

def fineweb_shard_name(index):
    """'shard_00042.parquet' for index 42."""
    return f"shard_{index:05d}.parquet"


def _download_fineweb_shard(filename, local_dir):
    """
    hf_hub_download of one shard into local_dir. Fails fast with a UserError when offline: at once when
    HF_HUB_OFFLINE is set, after a 5 s TCP check of the endpoint otherwise (instead of huggingface_hub's own retries).
    """
    def fail(why):
        return UserError(f"could not download fineweb-edu shard {filename} from the Hugging Face hub ({why}); "
                         f"{DATA_HINT}")
    if offline_mode():
        raise fail("offline: HF_HUB_OFFLINE is set")
    endpoint = hub_endpoint()
    reason = unreachable_reason()
    if reason is not None:
        raise fail(reason)
    print0(f"downloading {FINEWEB_REPO}/{filename} (~100 MB) to {local_dir}")
    try:
        from huggingface_hub import hf_hub_download
        hf_hub_download(repo_id=FINEWEB_REPO, repo_type="dataset", filename=filename, local_dir=local_dir,
                        endpoint=endpoint, etag_timeout=10)
    except Exception as e:
        raise fail(f"offline? {type(e).__name__}: {_reason(e)}") from None


def _fineweb_files(split, num_shards):
    if num_shards is None:
        raw = os.environ.get("NANOTRAIN_FINEWEB_SHARDS", str(FINEWEB_DEFAULT_SHARDS))
        try:
            num_shards = int(raw)
        except ValueError:
            raise UserError(f"NANOTRAIN_FINEWEB_SHARDS={raw!r}: expected an int number of train shards") from None
    if not 1 <= num_shards <= FINEWEB_LAST_SHARD:
        raise UserError(f"num_shards={num_shards}: expected 1..{FINEWEB_LAST_SHARD} fineweb-edu train shards")
    local_dir = os.path.join(get_base_dir(), "data", "fineweb-edu")
    indices = range(num_shards) if split == "train" else [FINEWEB_LAST_SHARD]
    files = []
    for i in indices:
        path = os.path.join(local_dir, fineweb_shard_name(i))
        if not os.path.exists(path):
            _download_fineweb_shard(fineweb_shard_name(i), local_dir)
        files.append(path)
    return files


# -----------------------------------------------------------------------------
# the public API

def resolve_data_files(data, split, num_shards=None):
    """
    The list of files (sorted; read with iter_documents) of `split` ("train" or "val") for the data source `data`:
    "builtin" (built on first use), "fineweb-edu" (first `num_shards` train shards, default
    $NANOTRAIN_FINEWEB_SHARDS or 8, downloaded if missing; val = shard_01822), or a local directory / glob / file
    (a local directory named like a source must be written as a path, e.g. ./builtin).
    Raises UserError (one line naming --data and what was expected) for a bad source, an empty directory, a single
    file with no val file, a fineweb-edu shard that cannot be downloaded (offline), a split whose files hold no
    document with any text (require_text), or an unreadable file met while looking for that text.
    """
    if split not in SPLITS:
        raise UserError(f"split={split!r}: expected 'train' or 'val'")
    if not isinstance(data, str) or not data:
        raise UserError(f"--data={data!r}: expected 'builtin', 'fineweb-edu', or a directory / glob of files")
    if data == "builtin":
        d = build_builtin_corpus()
        files = sorted(os.path.join(d, f) for f in os.listdir(d) if f.endswith(".parquet") and f.startswith(split))
    elif data == "fineweb-edu":
        files = _fineweb_files(split, num_shards)
    else:
        files = _local_files(data, split)
    require_text(files, data, split)
    return files


def require_text(files, data, split):
    """
    Raises UserError naming --data=`data` and `split` unless some document of `files` (as iter_documents reads them)
    holds a non-whitespace character: empty or whitespace-only .txt files, .jsonl files of blank lines or empty
    "text" strings, and zero-row parquet files hold none. Reads documents in order and stops at the first one with
    text, so it costs one document (one parquet row group) on real data.
    """
    for _, text in iter_documents(files):
        if text.strip():
            return
    names = ", ".join(os.path.basename(f) for f in files[:3]) + (", ..." if len(files) > 3 else "")
    raise UserError(f"--data={data}: the {split} split ({len(files)} file(s): {names}) holds no document with any text "
                    f"(every file is empty or whitespace-only); expected at least one non-empty document")


def _iter_parquet(path, first, start):
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
        field = pf.schema_arrow.field("text") if "text" in pf.schema_arrow.names else None
        if field is None or not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
            raise UserError(f"{path}: expected a string column 'text' (columns: {pf.schema_arrow.names})")
        sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.num_row_groups)]
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{path}: not a readable parquet file ({_reason(e)})") from None
    idx = first
    for g, n in enumerate(sizes):
        if idx + n <= start:  # skipped without reading its text
            idx += n
            continue
        try:
            texts = pf.read_row_group(g, columns=["text"]).column("text").to_pylist()
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: corrupt parquet row group {g} ({_reason(e)})") from None
        for t in texts:
            if idx >= start:
                yield idx, "" if t is None else t
            idx += 1
    return idx - first


def _iter_jsonl(path, first, start):
    idx = first
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            if idx >= start:
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError, too deep
                    raise UserError(f"{path}:{lineno}: not a valid UTF-8 JSON line; expected one object per line "
                                    f"with a \"text\" string") from None
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise UserError(f"{path}:{lineno}: expected a JSON object with a \"text\" string field")
                yield idx, LONE_SURROGATE.sub("\ufffd", obj["text"])
            idx += 1
    return idx - first


def _iter_txt(path, first, start):
    if first >= start:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}: not UTF-8 text (bad byte at offset {e.start})") from None
        yield first, text
    return 1


READERS = {".parquet": _iter_parquet, ".jsonl": _iter_jsonl, ".txt": _iter_txt}  # by file extension (EXTENSIONS)


def iter_documents(files, start=0):
    """
    Yields (doc_index, text) for the documents of `files` in order; doc_index is the global 0-based index across the
    files. Documents before `start` are skipped cheaply: parquet files and row groups by their metadata row counts,
    without reading their text. Deterministic. Every text is a valid Unicode string: a lone surrogate that a .jsonl
    line spells as a JSON escape ("\\ud800", valid JSON; a pair of escapes is one character) becomes U+FFFD, the
    replacement character, as an undecodable byte would in a lenient decoder (so every reader, the tokenizer's
    training included, sees the same text). Raises UserError naming the file (and file:line for .jsonl) for a
    missing, unsupported, or corrupt file.
    """
    if start < 0:
        raise ValueError(f"start={start}: expected >= 0")
    index = 0
    for path in files:
        if not os.path.isfile(path):
            raise UserError(f"{path}: no such file")
        reader = next((r for ext, r in READERS.items() if path.endswith(ext)), None)
        if reader is None:
            raise UserError(f"{path}: unsupported file type; expected .parquet, .jsonl or .txt")
        index += yield from reader(path, index, start)


def main():
    """`python -m nanotrain.dataset`: builds (or finds) the builtin corpus and prints its statistics."""
    t0 = time.time()
    d = build_builtin_corpus()
    stats = builtin_stats()
    print(f"builtin corpus: {d}")
    print(f"documents: {stats['docs']:,} (train {stats['train_docs']:,}, val {stats['val_docs']:,})")
    print(f"characters: {stats['chars']:,}")
    print(f"shards: {', '.join(stats['shards'])}")
    print(f"sha256: {stats['sha256']}")
    print(f"build: {stats['build_seconds']:.2f} s (this call {time.time() - t0:.2f} s)")


if __name__ == "__main__":
    run_script(main)
