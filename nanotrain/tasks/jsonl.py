"""
Conversations from the user's own files: "jsonl" (a local JSONL file of {"messages": [...]} rows) and "hf" (a Hugging
Face data set with a "messages" column: local .parquet/.json/.jsonl files, a directory of them, or a hub name when
online). Every row is checked with nanotrain.conversation.validate_conversation; a bad row names file and line (or
data set and row). Without a validation split of their own, every HOLDOUT_EVERY-th row (0, 20, 40, ...) is val.
Graded on the last line (grade_last_line).
"""

import json
import os

from nanotrain.common import get_base_dir
from nanotrain.conversation import validate_conversation
from nanotrain.downloads import unreachable_reason
from nanotrain.errors import UserError
from nanotrain.tasks.common import Task

HOLDOUT_EVERY = 20  # JSONL / HF sources without their own validation split: every 20th row (0, 20, 40, ...) is val
DATA_HINT = "use the built-in tasks (arith, spell, identity) or a local JSONL file (jsonl:/path/file.jsonl)"


def _skip_hint(skip_bad_rows, what):
    """The end of a bad row's message: the --skip_bad_rows=True hint where the caller has that flag (False), else ""
    (None: the script offers no such flag, e.g. mid_train and chat_eval)."""
    return f" (--skip_bad_rows=True skips such {what})" if skip_bad_rows is not None else ""


def load_jsonl(path, skip_bad_rows=None):
    """
    Reads conversations from a JSONL file: one JSON object {"messages": [...]} per line (blank lines are ignored).
    Returns (conversations, skipped): a list of {"messages", "task": "jsonl"} in file order and the bad lines left
    out, a list of (line number, what is wrong). A bad line (not UTF-8 JSON, or validate_conversation fails) raises
    UserError("{path}:{lineno}: what is wrong"), unless skip_bad_rows, in which case it is left out and listed.
    skip_bad_rows: True skips, False refuses and the message suggests --skip_bad_rows=True (the caller's script has
    that flag), None (a script without that flag) refuses without the suggestion.
    Raises UserError if the file does not exist.
    """
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such JSONL file")
    out, skipped = [], []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
                problem = validate_conversation(obj)
            except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, nesting too deep
                problem = f"not a valid UTF-8 JSON line ({str(e).splitlines()[0][:80]})"
            if problem is not None:
                if not skip_bad_rows:
                    raise UserError(f"{path}:{lineno}: {problem}{_skip_hint(skip_bad_rows, 'lines')}")
                skipped.append((lineno, problem))
                continue
            out.append({"messages": obj["messages"], "task": "jsonl"})
    return out, skipped


def _split_rows(rows, split):
    """Every HOLDOUT_EVERY-th row (0, 20, ...) is val, the rest train."""
    return [r for i, r in enumerate(rows) if (i % HOLDOUT_EVERY == 0) == (split == "val")]


def load_hf(name_or_path, split, skip_bad_rows=None):
    """
    Conversations of a Hugging Face data set with a "messages" column, through `datasets`: a local .parquet / .json /
    .jsonl file or a directory of them, or a hub name such as HuggingFaceTB/smol-smoltalk (downloaded into
    <base_dir>/hf_datasets). `split` is "train" or "val": val is the data set's "validation", "val" or "test" split
    if it has one, else every HOLDOUT_EVERY-th row of "train" (and train the other rows).
    Returns (conversations, skipped) like load_jsonl (skipped: (row index, what is wrong)), each {"messages", "task": "hf"}. A bad row raises
    UserError("{name}[{hf split}] row {i}: what is wrong") unless skip_bad_rows (True, False, None: as load_jsonl's,
    the --skip_bad_rows=True suggestion only with False). Raises UserError when the hub is not
    reachable (fails within ~5 s; HF_HUB_OFFLINE=1 uses the cache only) or the data set cannot be loaded.
    """
    import datasets  # here, not at the top: it loads many modules (pandas, pyarrow, ...), needed by hf: only
    if split not in ("train", "val"):
        raise UserError(f"split={split!r}: expected 'train' or 'val'")
    args = dict(path=name_or_path)  # a directory, or a hub name
    if os.path.isfile(name_or_path):
        builder = "parquet" if name_or_path.endswith(".parquet") else "json"
        args = dict(path=builder, data_files={"train": name_or_path})
    elif not os.path.isdir(name_or_path):
        if name_or_path.startswith((".", "/")) or name_or_path.count("/") != 1:
            raise UserError(f"hf data set {name_or_path!r}: no such local file or directory, and not a hub name "
                            f"like owner/name; {DATA_HINT}")
        reason = unreachable_reason()
        if reason is not None:
            raise UserError(f"could not load the Hugging Face data set {name_or_path} ({reason}); {DATA_HINT}")
    try:
        ds = datasets.load_dataset(**args, cache_dir=os.path.join(get_base_dir(), "hf_datasets"))
    except Exception as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"could not load the Hugging Face data set {name_or_path} ({type(e).__name__}: {reason}); "
                        f"{DATA_HINT}") from None
    val_name = next((s for s in ("validation", "val", "test") if s in ds), None)
    hf_split = "train" if split == "train" or val_name is None else val_name
    if hf_split not in ds:
        raise UserError(f"hf data set {name_or_path}: no {hf_split!r} split (splits: {', '.join(ds)})")
    table = ds[hf_split]
    if "messages" not in table.column_names:
        raise UserError(f"hf data set {name_or_path}[{hf_split}]: no 'messages' column "
                        f"(columns: {', '.join(table.column_names)})")
    out, skipped = [], []
    for i, messages in enumerate(table["messages"]):
        obj = {"messages": messages}
        problem = validate_conversation(obj)
        if problem is not None:
            if not skip_bad_rows:
                raise UserError(f"{name_or_path}[{hf_split}] row {i}: {problem}{_skip_hint(skip_bad_rows, 'rows')}")
            skipped.append((i, problem))
            continue
        out.append({"messages": [{"role": m["role"], "content": m["content"]} for m in messages], "task": "hf"})
    if val_name is None:
        out = _split_rows(out, split)
    return out, skipped


class JSONL(Task):
    """A local JSONL file of conversations (load_jsonl); load(split, source=path) gives its train or val rows."""
    name = "jsonl"

    def load(self, split, source=None, seed=0, skip_bad_rows=None):
        self.check_split(split)
        rows, skipped = load_jsonl(source, skip_bad_rows)
        return _split_rows(rows, split), skipped


class HF(Task):
    """A Hugging Face data set with a "messages" column (load_hf); load(split, source=name or path)."""
    name = "hf"

    def load(self, split, source=None, seed=0, skip_bad_rows=None):
        return load_hf(source, split, skip_bad_rows)
