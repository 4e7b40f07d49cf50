"""
Chat conversations from outside the built-in tasks, and mixtures of sources, for mid-training, SFT and chat eval:
conversations {"messages": [...], "task": name, ...} in the format of nanotrain.tokenizer.render_conversation.

- validate_conversation: what a training conversation must be (every loaded row is checked).
- load_jsonl: a local JSONL file of {"messages": [...]} rows; load_hf: a Hugging Face data set with a "messages"
  column (local files, or a hub name when online).
- parse_task_spec / load_task_mixture: a weighted mixture of these and the built-in tasks (nanotrain.tasks), e.g.
  "arith:1,spell:1,identity:2,jsonl:/data/chat.jsonl".
"""

import json
import math
import os
import random
import re
import urllib.parse
import urllib.request

from nanotrain.benchmarks import load_training_source
from nanotrain.common import UserError, get_base_dir, print0
from nanotrain.dataset import _check_reachable  # the same fail-fast TCP check as the fineweb-edu download
from nanotrain.gsm8k import HUB_NAME as GSM8K_HUB
from nanotrain.gsm8k import load_gsm8k
from nanotrain.tasks import BUILTIN_TASKS, load_task
from nanotrain.tokenizer import chat_messages

HOLDOUT_EVERY = 20  # JSONL / HF sources without their own validation split: every 20th row (0, 20, 40, ...) is val
DATA_HINT = "use the built-in tasks (arith, spell, identity) or a local JSONL file (jsonl:/path/file.jsonl)"


def validate_conversation(obj):
    """
    None if `obj` is a valid training conversation, else a short description of what is wrong: not an object with a
    "messages" list, malformed or misordered messages (see nanotrain.tokenizer.chat_messages: an optional system
    message first, then user and assistant alternating from the user), empty content (a blank string, an empty list
    of parts or a blank text/python part), or a last message that is not the assistant's (nothing to train on).
    """
    if not isinstance(obj, dict) or "messages" not in obj:
        return 'expected a JSON object with a "messages" list'
    try:
        chat_messages(obj)
    except ValueError as e:
        return str(e)
    for i, m in enumerate(obj["messages"]):
        c = m["content"]
        if isinstance(c, str) and not c.strip():
            return f"message {i} ({m['role']}) has empty content"
        if isinstance(c, list):
            if not c:
                return f"message {i} (assistant) has an empty list of parts"
            for j, p in enumerate(c):
                if p["type"] != "python_output" and not p["text"].strip():
                    return f"message {i} (assistant) part {j} ({p['type']}) is empty"
    if obj["messages"][-1]["role"] != "assistant":
        return "the last message must be the assistant's (a training conversation ends with a reply)"
    return None


def _skip_hint(skip_bad_rows, what):
    """The end of a bad row's message: the --skip_bad_rows=True hint where the caller has that flag (False), else ""
    (None: the script offers no such flag, e.g. mid_train and chat_eval)."""
    return f" (--skip_bad_rows=True skips such {what})" if skip_bad_rows is not None else ""


def load_jsonl(path, skip_bad_rows=None):
    """
    Reads conversations from a JSONL file: one JSON object {"messages": [...]} per line (blank lines are ignored).
    Returns (conversations, n_skipped): a list of {"messages", "task": "jsonl"} in file order and the number of bad
    lines skipped. A bad line (not UTF-8 JSON, or validate_conversation fails) raises
    UserError("{path}:{lineno}: what is wrong"), unless skip_bad_rows, in which case it is counted and skipped.
    skip_bad_rows: True skips, False refuses and the message suggests --skip_bad_rows=True (the caller's script has
    that flag), None (a script without that flag) refuses without the suggestion.
    Raises UserError if the file does not exist.
    """
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such JSONL file")
    out, skipped = [], 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
                problem = validate_conversation(obj)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                problem = f"not a valid UTF-8 JSON line ({str(e).splitlines()[0][:80]})"
            if problem is not None:
                if not skip_bad_rows:
                    raise UserError(f"{path}:{lineno}: {problem}{_skip_hint(skip_bad_rows, 'lines')}")
                skipped += 1
                continue
            out.append({"messages": obj["messages"], "task": "jsonl"})
    return out, skipped


def _hub_unreachable(name):
    """A UserError for loading the hub data set `name` when offline, or None when the hub looks reachable."""
    def fail(why):
        return UserError(f"could not load the Hugging Face data set {name} ({why}); {DATA_HINT}")
    if any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
           for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return None  # offline mode: datasets uses its cache and fails quickly when the data set is not there
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if urllib.request.getproxies().get(urllib.parse.urlparse(endpoint).scheme):
        return None  # behind a proxy we cannot test the route ourselves
    try:
        _check_reachable(endpoint)
    except OSError as e:
        return fail(f"offline? cannot reach {endpoint}: {e}; with HF_HUB_OFFLINE=1 a cached copy is used")
    return None


def _split_rows(rows, split):
    """Every HOLDOUT_EVERY-th row (0, 20, ...) is val, the rest train."""
    return [r for i, r in enumerate(rows) if (i % HOLDOUT_EVERY == 0) == (split == "val")]


def load_hf(name_or_path, split, skip_bad_rows=None):
    """
    Conversations of a Hugging Face data set with a "messages" column, through `datasets`: a local .parquet / .json /
    .jsonl file or a directory of them, or a hub name such as HuggingFaceTB/smol-smoltalk (downloaded into
    <base_dir>/hf_datasets). `split` is "train" or "val": val is the data set's "validation", "val" or "test" split
    if it has one, else every HOLDOUT_EVERY-th row of "train" (and train the other rows).
    Returns (conversations, n_skipped) like load_jsonl, each {"messages", "task": "hf"}. A bad row raises
    UserError("{name}[{hf split}] row {i}: what is wrong") unless skip_bad_rows (True, False, None: as load_jsonl's,
    the --skip_bad_rows=True suggestion only with False). Raises UserError when the hub is not
    reachable (fails within ~5 s; HF_HUB_OFFLINE=1 uses the cache only) or the data set cannot be loaded.
    """
    import datasets  # here, not at the top: it loads many modules (pandas, pyarrow, ...), needed by hf: only
    if split not in ("train", "val"):
        raise UserError(f"split={split!r}: expected 'train' or 'val'")
    cache_dir = os.path.join(get_base_dir(), "hf_datasets")
    if os.path.isfile(name_or_path):
        builder = "parquet" if name_or_path.endswith(".parquet") else "json"
        args = dict(path=builder, data_files={"train": name_or_path})
    elif os.path.isdir(name_or_path):
        args = dict(path=name_or_path)
    else:
        if name_or_path.startswith((".", "/")) or name_or_path.count("/") != 1:
            raise UserError(f"hf data set {name_or_path!r}: no such local file or directory, and not a hub name "
                            f"like owner/name; {DATA_HINT}")
        error = _hub_unreachable(name_or_path)
        if error is not None:
            raise error
        args = dict(path=name_or_path)
    try:
        ds = datasets.load_dataset(**args, cache_dir=cache_dir)
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
    out, skipped = [], 0
    for i, messages in enumerate(table["messages"]):
        obj = {"messages": messages}
        problem = validate_conversation(obj)
        if problem is not None:
            if not skip_bad_rows:
                raise UserError(f"{name_or_path}[{hf_split}] row {i}: {problem}{_skip_hint(skip_bad_rows, 'rows')}")
            skipped += 1
            continue
        out.append({"messages": [{"role": m["role"], "content": m["content"]} for m in messages], "task": "hf"})
    if val_name is None:
        out = _split_rows(out, split)
    return out, skipped


# ----------------------------------------------------------------------------- mixtures

HUB_SOURCES = ("gsm8k", "arc", "mmlu_aux", "smoltalk")  # named hub sources: NAME (the hub) or NAME:PATH (a local copy)


def parse_task_spec(spec):
    """
    Parses a task mixture spec into [(kind, arg, weight)]: comma-separated parts "arith", "spell", "identity", the
    named hub sources "gsm8k" (nanotrain.gsm8k), "arc", "mmlu_aux", "smoltalk" (nanotrain.benchmarks; NAME:PATH reads
    a local copy of the hub's files instead), "jsonl:PATH" or "hf:NAME_OR_PATH", each optionally followed by
    ":WEIGHT" (a number > 0, default 1), e.g. "smoltalk:1,mmlu_aux:1,gsm8k:2,identity:2,jsonl:/data/chat.jsonl:1".
    kind is the task or source name, "jsonl" or "hf"; arg is the path/name (None for built-ins and the hub's named
    sources). Paths may not contain ','.
    Raises UserError naming the bad part.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"task mixture {spec!r}: expected comma-separated parts like 'arith:1,spell:1,identity:2'")
    out = []
    number = r"[0-9.eE+-]+"
    for part in (p.strip() for p in spec.split(",")):
        expected = (f"expected NAME[:WEIGHT] with NAME one of {', '.join(BUILTIN_TASKS + HUB_SOURCES)}, or "
                    f"{'|'.join(HUB_SOURCES)}:PATH[:WEIGHT], jsonl:PATH[:WEIGHT] or hf:NAME_OR_PATH[:WEIGHT], and "
                    f"WEIGHT a number > 0")
        kind, _, rest = part.partition(":")
        if kind in HUB_SOURCES and rest and not re.fullmatch(number, rest):  # NAME:PATH[:WEIGHT]
            head, sep, tail = rest.rpartition(":")
            arg, raw = (head, tail) if sep and re.fullmatch(number, tail) else (rest, "1")
        elif kind in ("jsonl", "hf"):
            head, sep, tail = rest.rpartition(":")
            arg, raw = (head, tail) if sep and re.fullmatch(number, tail) else (rest, "1")
            if not arg:
                raise UserError(f"task mixture part {part!r}: missing the {kind} path or name; {expected}")
        else:
            raw, arg = rest or "1", None
            if kind not in BUILTIN_TASKS + HUB_SOURCES:
                raise UserError(f"task mixture part {part!r}: unknown task {kind!r}; {expected}")
        try:
            weight = float(raw)
        except ValueError:
            raise UserError(f"task mixture part {part!r}: weight {raw!r} is not a number; {expected}") from None
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(f"task mixture part {part!r}: weight must be a number > 0; {expected}")
        out.append((kind, arg, weight))
    return out


def load_task_mixture(spec, split, seed=0, skip_bad_rows=None):
    """
    The conversations of a task mixture (see parse_task_spec) for `split` ("train" or "val"), shuffled with
    random.Random(seed). For train, a weight is a multiplicity: 2 puts every row of that source in twice, 0.5 a
    seeded random half of its rows, 1.5 all once plus a seeded half. For val every source's validation rows are
    taken once (weights do not apply). Built-ins come from load_task(name, split, seed); JSONL files and hf sources
    without a validation split give every HOLDOUT_EVERY-th row to val. Rows repeated by a weight are the same dict
    objects (do not mutate them). Skipped bad rows (skip_bad_rows=True) are reported with print0; skip_bad_rows is
    load_jsonl's (None: the script has no --skip_bad_rows, and a bad row's message does not suggest it).
    Returns list[dict]. Raises UserError for a bad spec, a bad row (file:line) or an unloadable source.
    """
    if split not in ("train", "val"):
        raise UserError(f"split={split!r}: expected 'train' or 'val'")
    out = []
    for index, (kind, arg, weight) in enumerate(parse_task_spec(spec)):
        if kind == "jsonl":
            rows, skipped = load_jsonl(arg, skip_bad_rows)
            rows = _split_rows(rows, split)
        elif kind == "hf":
            rows, skipped = load_hf(arg, split, skip_bad_rows)
        elif kind == "gsm8k":
            rows, skipped = load_gsm8k(split, arg or GSM8K_HUB), 0
        elif kind in HUB_SOURCES:
            rows, skipped = load_training_source(kind, split, arg or "hub")[0], 0  # bad rows: one warning line there
        else:
            rows, skipped = load_task(kind, split, seed), 0
        if skipped:
            print0(f"warning: skipped {skipped} bad rows of {kind}:{arg}")
        if split == "val":
            out += rows
            continue
        whole, frac = int(weight), weight - int(weight)
        out += rows * whole
        if frac > 0:
            out += random.Random(f"{seed}:{index}").sample(rows, round(frac * len(rows)))
    random.Random(seed).shuffle(out)
    return out
