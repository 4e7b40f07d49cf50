"""
Pretraining text: where the documents come from (resolve_data_files) and reading them in order (iter_documents).

Data sources (the --data setting of the scripts):
- "builtin" (the default; offline): English prose that ships with every Python install, namely the pydoc topics
  (pydoc_data.topics, one document per topic) and the docstrings of the standard library, read from the .py sources
  with `ast` (no module is imported). One document per module (module docstring + its functions' docstrings) and one
  per top-level class (class + method docstrings), each headed by its qualified name and cut into consecutive parts
  of about 2,000+ characters when long. Shuffled with random.Random(42) (exact duplicates dropped), 5% held out for
  validation, written once as parquet shards under <base_dir>/data/builtin/.
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

import ast
import glob
import hashlib
import json
import os
import random
import re
import shutil
import socket
import sys
import sysconfig
import tempfile
import time
import urllib.parse
import urllib.request
import warnings

from nanotrain.common import UserError, die, get_base_dir, print0

SPLITS = ("train", "val")
EXTENSIONS = (".parquet", ".jsonl", ".txt")
DATA_HINT = "use --data=builtin (the offline default) or --data=/path/to/dir of parquet/jsonl/txt files"

BUILTIN_SEED = 42  # shuffle seed of the builtin corpus
BUILTIN_DOC_CHARS = 2000  # a long module/class is cut into documents of about this many characters (or more)
BUILTIN_TRAIN_SHARDS = 4  # number of train parquet shards
BUILTIN_VAL_FRACTION = 0.05  # fraction of documents held out as the validation shard
ROWS_PER_GROUP = 256  # documents per parquet row group
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
MARKER = "_SUCCESS"
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # left in a str by JSON's "\\ud800" escapes (valid JSON, not Unicode)

FINEWEB_REPO = "karpathy/fineweb-edu-100b-shuffle"
FINEWEB_LAST_SHARD = 1822  # shard_01822.parquet, the validation shard
FINEWEB_DEFAULT_SHARDS = 8


def _reason(e):
    """The first line of an exception's message, printable characters only."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return "".join(c for c in text if c.isprintable()).strip()


# -----------------------------------------------------------------------------
# the builtin corpus

def _stdlib_sources():
    """Sorted (module name, path) of the standard library's .py files, without test dirs, idlelib, site-packages."""
    root = sysconfig.get_paths()["stdlib"]
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith("."))
        for fn in filenames:
            if fn.endswith(".py"):
                path = os.path.join(dirpath, fn)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out.append((module, path))
    return sorted(out)


def _member_docstrings(node, prefix):
    """'## qualname' sections for the docstrings of the classes/functions directly in `node`, recursing into classes."""
    out = []
    for child in node.body:
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = prefix + child.name
            doc = ast.get_docstring(child)
            if doc:
                out.append(f"## {name}\n\n{doc}")
            if isinstance(child, ast.ClassDef):
                out += _member_docstrings(child, name + ".")
    return out


def _pack(title, sections, docs):
    """Appends to `docs` the sections under a '# title' header, cut into documents of >= BUILTIN_DOC_CHARS chars."""
    cur, n = [], 0
    for s in sections:
        cur.append(s)
        n += len(s)
        if n >= BUILTIN_DOC_CHARS:
            docs.append(f"# {title}\n\n" + "\n\n".join(cur))
            cur, n = [], 0
    if cur:
        docs.append(f"# {title}\n\n" + "\n\n".join(cur))


def builtin_documents():
    """
    The builtin corpus as a list of str, in its final (shuffled) order: pydoc topics, then stdlib docstrings in
    sorted module order, exact duplicates dropped, shuffled with random.Random(42). Parses sources with `ast`
    (nothing is imported); files that fail to parse are skipped. Deterministic for a given Python installation.
    """
    from pydoc_data.topics import topics  # a plain dict of help texts, safe to import
    docs = [topics[k] for k in sorted(topics)]
    for module, path in _stdlib_sources():
        try:
            with open(path, "rb") as f:
                source = f.read()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. SyntaxWarning for invalid escapes in old sources
                tree = ast.parse(source, filename=path)
        except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
            continue
        head = [ast.get_docstring(tree)] if ast.get_docstring(tree) else []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node):
                head.append(f"## {node.name}\n\n{ast.get_docstring(node)}")
            elif isinstance(node, ast.ClassDef):
                _pack(f"{module}.{node.name}", _member_docstrings(ast.Module(body=[node], type_ignores=[]), ""), docs)
        _pack(module, head, docs)
    docs = list(dict.fromkeys(docs))  # drop exact duplicates (e.g. two pydoc topics share a text)
    random.Random(BUILTIN_SEED).shuffle(docs)
    return docs


def content_hash(docs):
    """sha256 hex digest of a sequence of documents (length-prefixed UTF-8), order-sensitive."""
    h = hashlib.sha256()
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _write_parquet(path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": pa.array(docs, type=pa.string())}), path, row_group_size=ROWS_PER_GROUP,
                   compression="zstd")


def get_builtin_dir():
    """<base_dir>/data/builtin."""
    return os.path.join(get_base_dir(), "data", "builtin")


def build_builtin_corpus():
    """
    Builds the builtin corpus once and returns its directory, <base_dir>/data/builtin, holding train_00000.parquet ..
    train_00003.parquet, val_00000.parquet and the marker _SUCCESS (JSON: document/char counts and content sha256).
    Reused when the marker is there. Built in a temp dir and renamed into place, so concurrent processes (torchrun
    ranks) are safe: the first rename wins and the others discard their copy. Raises UserError if the directory
    exists without a marker.
    """
    final = get_builtin_dir()
    if os.path.exists(os.path.join(final, MARKER)):
        return final
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    t0 = time.time()
    docs = builtin_documents()
    n_val = max(1, round(len(docs) * BUILTIN_VAL_FRACTION))
    train, val = docs[:-n_val], docs[-n_val:]
    tmp = tempfile.mkdtemp(prefix="builtin.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        shards = []
        for i in range(BUILTIN_TRAIN_SHARDS):
            lo, hi = len(train) * i // BUILTIN_TRAIN_SHARDS, len(train) * (i + 1) // BUILTIN_TRAIN_SHARDS
            shards.append(f"train_{i:05d}.parquet")
            _write_parquet(os.path.join(tmp, shards[-1]), train[lo:hi])
        shards.append("val_00000.parquet")
        _write_parquet(os.path.join(tmp, shards[-1]), val)
        marker = {"docs": len(docs), "train_docs": len(train), "val_docs": len(val),
                  "chars": sum(len(d) for d in docs), "sha256": content_hash(docs), "shards": shards,
                  "build_seconds": round(time.time() - t0, 3), "python": sys.version.split()[0]}
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(marker, f, indent=2)
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(os.path.join(final, MARKER)):
            return final  # another process finished first
        if os.path.exists(final):
            raise UserError(f"{final} exists but is not a complete builtin corpus (no {MARKER}); delete it and retry")
        raise
    return final


def builtin_stats():
    """The builtin corpus' _SUCCESS marker as a dict (docs, train_docs, val_docs, chars, sha256, shards, ...)."""
    with open(os.path.join(build_builtin_corpus(), MARKER)) as f:
        return json.load(f)


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


def _check_reachable(endpoint, timeout=5.0):
    """Opens (and closes) a TCP connection to the endpoint's host; raises OSError within ~`timeout` s if offline."""
    url = urllib.parse.urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    socket.create_connection((url.hostname, port), timeout=timeout).close()


def _download_fineweb_shard(filename, local_dir):
    """
    hf_hub_download of one shard into local_dir. Fails fast with a UserError when offline: at once when
    HF_HUB_OFFLINE is set, after a 5 s TCP check of the endpoint otherwise (instead of huggingface_hub's own retries).
    """
    def fail(why):
        return UserError(f"could not download fineweb-edu shard {filename} from the Hugging Face hub ({why}); "
                         f"{DATA_HINT}")
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        raise fail("offline: HF_HUB_OFFLINE is set")
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    scheme = urllib.parse.urlparse(endpoint).scheme
    if not urllib.request.getproxies().get(scheme):  # behind a proxy we cannot test the route ourselves
        try:
            _check_reachable(endpoint)
        except OSError as e:
            raise fail(f"offline? cannot reach {endpoint}: {e}") from None
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
                except ValueError:  # UnicodeDecodeError and JSONDecodeError
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
        if path.endswith(".parquet"):
            index += yield from _iter_parquet(path, index, start)
        elif path.endswith(".jsonl"):
            index += yield from _iter_jsonl(path, index, start)
        elif path.endswith(".txt"):
            index += yield from _iter_txt(path, index, start)
        else:
            raise UserError(f"{path}: unsupported file type; expected .parquet, .jsonl or .txt")


def main():
    """`python -m nanotrain.dataset`: builds (or finds) the builtin corpus and prints its statistics."""
    t0 = time.time()
    try:
        d = build_builtin_corpus()
        stats = builtin_stats()
    except UserError as e:
        die(str(e))
    print(f"builtin corpus: {d}")
    print(f"documents: {stats['docs']:,} (train {stats['train_docs']:,}, val {stats['val_docs']:,})")
    print(f"characters: {stats['chars']:,}")
    print(f"shards: {', '.join(stats['shards'])}")
    print(f"sha256: {stats['sha256']}")
    print(f"build: {stats['build_seconds']:.2f} s (this call {time.time() - t0:.2f} s)")


if __name__ == "__main__":
    main()
