"""
The builtin corpus (the --data=builtin default; offline): English prose that ships with every Python install, namely
the pydoc topics (pydoc_data.topics, one document per topic) and the docstrings of the standard library, read from the
.py sources with `ast` (no module is imported). One document per module (module docstring + its functions'
docstrings) and one per top-level class (class + method docstrings), each headed by its qualified name and cut into
consecutive parts of about 2,000+ characters when long. Shuffled with random.Random(42) (exact duplicates dropped),
5% held out for validation, written once as parquet shards under <base_dir>/data/builtin/ with a _SUCCESS marker.
"""

import ast
import hashlib
import json
import os
import random
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings

from nanotrain.common import atomic_write_json, get_base_dir
from nanotrain.errors import UserError

BUILTIN_SEED = 42  # shuffle seed of the builtin corpus
BUILTIN_DOC_CHARS = 2000  # a long module/class is cut into documents of about this many characters (or more)
BUILTIN_TRAIN_SHARDS = 4  # number of train parquet shards
BUILTIN_VAL_FRACTION = 0.05  # fraction of documents held out as the validation shard
ROWS_PER_GROUP = 256  # documents per parquet row group
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__"}
MARKER = "_SUCCESS"


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


def build_builtin_corpus():
    """
    Builds the builtin corpus once and returns its directory, <base_dir>/data/builtin, holding train_00000.parquet ..
    train_00003.parquet, val_00000.parquet and the marker _SUCCESS (JSON: document/char counts and content sha256).
    Reused when the marker is there. Built in a temp dir and renamed into place, so concurrent processes (torchrun
    ranks) are safe: the first rename wins and the others discard their copy. Raises UserError if the directory
    exists without a marker.
    """
    final = os.path.join(get_base_dir(), "data", "builtin")
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
        atomic_write_json(os.path.join(tmp, MARKER), marker)
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
