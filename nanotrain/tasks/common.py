"""
What every task shares: the Task contract, the hub reader, nanochat's row order, the multiple-choice rendering, the
last-line grader and the Wilson interval. A task is one class in one file of this package (nanochat's tasks/*.py
shape); nanotrain.tasks.registry names them all and parses the --tasks list and the mixture spec.
"""

import glob
import math
import os
import random
import re
import zlib

import numpy as np

from nanotrain.common import get_base_dir, print0
from nanotrain.conversation import text_of
from nanotrain.downloads import unreachable_reason
from nanotrain.errors import UserError
from nanotrain.tasks.benchmarks import pinned_rows

SHUFFLE_SEED = 42  # nanochat's: datasets.Dataset.shuffle(seed=42) of every benchmark's test split


class Task:
    """
    One task (a benchmark, a training source or a built-in), nanochat's Task contract in this project's terms:
      name       str, the name in --tasks and the mixture spec (also each conversation's "task" field)
      kind       "categorical" (scored by the letter logits: ARC, MMLU) or "generative" (a decoded reply, graded)
      chance     the accuracy of guessing (ChatCORE centres on it)
      splits     the splits load() accepts: "train", "val" (validation), "test" (the benchmark's test set)
      load(split, source=None, seed=0) -> (conversations, skipped): conversations (list of dicts, see
                 nanotrain.conversation) in the task's order, skipped a list of (row index, reason) of rows that could
                 not be rendered; source is where rows come from ("hub", "pinned", a folder, a file; None: the task's
                 default). Raises UserError (one line) when the data cannot be had.
      grade(conversation, reply) -> bool: whether the reply (str) answers the conversation's last question.
      grade_batch(conversations, replies) -> list[bool]: the same for many (HumanEval runs them in parallel).
    """
    name = None
    kind = "generative"
    chance = 0.0
    splits = ("train", "val")

    def load(self, split, source=None, seed=0):
        raise NotImplementedError(f"task {self.name} loads no rows")

    def grade(self, conversation, reply):
        return grade_last_line(conversation, reply)

    def grade_batch(self, conversations, replies):
        return [bool(self.grade(c, r)) for c, r in zip(conversations, replies)]

    def check_split(self, split):
        """Raises UserError unless `split` is one of self.splits."""
        if split not in self.splits:
            raise UserError(f"task {self.name}: split={split!r}; expected one of {', '.join(self.splits)}")


class MultipleChoice(Task):
    """A multiple-choice benchmark (ARC, MMLU): categorical, chance 0.25 (nanochat's), its conversations made by
    mc_conversation; a reply is right when it is the gold letter (surrounding whitespace aside)."""
    kind = "categorical"
    chance = 0.25

    def grade(self, conversation, reply):
        return reply.strip() == conversation["answer"]


# ----------------------------------------------------------------------------- grading shared by tasks

def grade_last_line(conversation, reply):
    """
    True when the last non-empty line of `reply`, without an "Answer:" prefix, case, extra spaces and a trailing
    '.'/'!', equals the reference (the conversation's last assistant message) treated the same way; never for an
    empty reference. Raises ValueError for a conversation without an assistant message.
    """
    reference = next((text_of(m["content"]) for m in reversed(conversation["messages"]) if m["role"] == "assistant"),
                     None)
    if reference is None:
        raise ValueError("grade: the conversation has no assistant message to compare with")

    def last_line(t):
        lines = [x for x in t.strip().splitlines() if x.strip()]
        line = re.sub(r"^\s*answer\s*[:=]?\s*", "", lines[-1].strip() if lines else "", flags=re.IGNORECASE)
        return " ".join(line.lower().split()).rstrip(".!")
    return last_line(reply) == last_line(reference) != ""


def wilson_interval(correct, total, z=1.96):
    """
    The 95% Wilson score interval (Wilson 1927; z = 1.96) of an accuracy of `correct` successes in `total` trials,
    as (low, high) fractions in [0, 1]; (0.0, 1.0) for total 0. Unlike the normal approximation it stays inside
    [0, 1] and is not zero-width at 0 or total successes.
    """
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    d = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / d
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


# ----------------------------------------------------------------------------- multiple choice

def render_mc(question, letters, choices):
    """
    The multiple-choice user message, nanochat's format: "Multiple Choice question: {question}\n", one line
    "- {choice}={letter}\n" per choice (the letter after the choice, no space after '=', so the letter is the same
    token as the one-letter reply), then "\nRespond only with the letter of the correct answer.".
    """
    lines = "".join(f"- {choice}={letter}\n" for letter, choice in zip(letters, choices))
    return f"Multiple Choice question: {question}\n{lines}\nRespond only with the letter of the correct answer."


def mc_conversation(question, choices, answer_index, letters, task, **extra):
    """A multiple-choice row as a conversation {"messages", "task", "letters", "answer": the gold letter, **extra}.
    Raises ValueError for an empty question, a choice count that does not match the letters, or a bad index."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("empty question")
    if len(choices) < 2 or len(choices) != len(letters) or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{len(choices)} choices for {len(letters)} letters")
    if not 0 <= answer_index < len(choices):
        raise ValueError(f"answer index {answer_index} outside the {len(choices)} choices")
    letter = letters[answer_index]
    return {"messages": [{"role": "user", "content": render_mc(question, letters, choices)},
                         {"role": "assistant", "content": letter}],
            "task": task, "letters": list(letters), "answer": letter, **extra}


# ----------------------------------------------------------------------------- rows from the hub, in nanochat's order

def nanochat_order(n, seed=SHUFFLE_SEED):
    """The permutation (list of row indices) that datasets.Dataset.shuffle(seed=seed) applies to a data set of n rows:
    numpy.random.default_rng(seed).permutation(n)."""
    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


def render_rows(to_conversation, rows, what, order=None):
    """
    The rows (hub dicts), in `order` (a list of row indices; default nanochat_order(len(rows))), each rendered by
    `to_conversation(row)`. A row that cannot be rendered (KeyError, TypeError, ValueError, AttributeError) is left
    out (after the permutation, so the others keep their order), counted and named: one warning line (print0) with
    the count and the first five (the row's index in the data set: reason). Returns (conversations, skipped) with
    skipped a list of (row index in the data set, reason).
    """
    out, skipped = [], []
    for i in (nanochat_order(len(rows)) if order is None else order):
        try:
            out.append(to_conversation(rows[i]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            skipped.append((i, f"{type(e).__name__}: {e}"))
    if skipped:
        first = "; ".join(f"row {i}: {why}" for i, why in skipped[:5])
        print0(f"warning: {what}: {len(skipped)} of {len(rows)} rows cannot be rendered and are left out ({first})")
    return out, skipped


def resolve_source(source):
    """"auto" -> "hub" when the hub answers (within seconds), else "pinned"; other values are returned unchanged."""
    if source != "auto":
        return source
    return "hub" if unreachable_reason() is None else "pinned"


def load_hub_rows(repo, config, split, source="hub", need=None):
    """
    The rows (list of dicts, the data set's columns) of `repo` (e.g. "cais/mmlu"), `config` ("all"), `split`
    ("test") in the data set's order, with `datasets`: from the hub (source "hub"; cached in <base_dir>/hf_datasets)
    or from a local copy (source a folder holding <config>/<split>-*.parquet, .jsonl/.json or .arrow files).
    Raises UserError (one line ending with `need`, what is needed; by default the data set online or a local copy)
    when the hub cannot be reached (within seconds), the files are missing, or the data cannot be loaded.
    """
    import datasets  # here, not at the top: it loads many modules, needed only for these sources

    need = need or (f"it needs the Hugging Face data set {repo} ({config}, {split}) online, cached with "
                    f"HF_HUB_OFFLINE=1, or a local copy of its files (a folder holding {config}/{split}-*.parquet)")
    if source == "hub":
        reason = unreachable_reason()
        if reason is not None:
            raise UserError(f"cannot load {repo} from the Hugging Face hub ({reason}): {need}")
        args = dict(path=repo, name=None if config in ("default", "data") else config)
    elif os.path.isdir(source):
        files = {ext: sorted(glob.glob(os.path.join(source, config, f"{split}-*.{ext}")))
                 for ext in ("parquet", "jsonl", "json", "arrow")}
        ext = next((e for e, f in files.items() if f), None)
        if ext is None:
            raise UserError(f"{source}: no {config}/{split}-*.parquet (or .jsonl, .arrow) files; {need}")
        for path in files[ext]:  # datasets' own errors name neither the file nor the line
            check_local_file(path, ext)
        args = dict(path={"jsonl": "json"}.get(ext, ext), data_files={split: files[ext]})
    else:
        raise UserError(f"{source}: no such directory (expected 'hub' or a local copy); {need}")
    try:
        ds = datasets.load_dataset(**args, split=split, cache_dir=os.path.join(get_base_dir(), "hf_datasets"))
    except Exception as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"could not load {repo} {config} {split} ({type(e).__name__}: {reason}); {need}") from None
    return ds.to_list()


def check_local_file(path, ext):
    """
    Raises UserError naming the file of a local copy that `datasets` would fail on without saying where: for .jsonl,
    path:line of the first non-blank line that is not UTF-8 JSON holding an object; for .parquet, the file when its
    footer cannot be read (cut or not parquet). Other formats are left to `datasets`.
    """
    if ext == "jsonl":
        import json
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw.decode("utf-8"))
                except (ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, nesting too deep
                    raise UserError(f"{path}:{n}: not a UTF-8 JSON line ({str(e).splitlines()[0][:100]}); the local "
                                    f"copy is damaged") from None
                if not isinstance(row, dict):
                    raise UserError(f"{path}:{n}: expected a JSON object (a row), got a {type(row).__name__}")
    elif ext == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        try:
            pq.read_metadata(path)
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: not a readable parquet file ({str(e).splitlines()[0][:100]}); the local copy "
                            f"is damaged") from None


# ----------------------------------------------------------------------------- the built-in tasks' shared parts

INT = r"-?\d+(?:,\d{3})*"  # an integer, commas allowed as thousands separators
SPELLED = r"\b[A-Za-z](?:\s*[-,]\s*[A-Za-z]\b)+"  # single letters separated by '-' or ',': "s-t-r", "s, t, r"


def held_out(key, every):
    """True for the validation share (1/every) of problem keys (str): a fixed hash (crc32), independent of any seed,
    so train and val never share a problem."""
    return zlib.crc32(key.encode("utf-8")) % every == 0


def final_segment(text):
    """The text after the last "answer" (case-insensitive) if there is one, else the last non-empty line."""
    m = list(re.finditer(r"answer", text, flags=re.IGNORECASE))
    if m:
        return text[m[-1].end():]
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else ""


def final_int(text):
    """The integer of the final segment if it holds exactly one, else None (so "1, 1, 1, ..." is no answer)."""
    nums = re.findall(INT, final_segment(text))
    return int(nums[0].replace(",", "")) if len(nums) == 1 else None


def final_spelling(text):
    """The spelled-out word of the final segment (lowercase letters) if it holds exactly one, else None."""
    runs = re.findall(SPELLED, final_segment(text))
    return re.sub(r"[^a-z]", "", runs[0].lower()) if len(runs) == 1 else None


def generated(task, split, seed, make):
    """The rows of a built-in task: make(split, n, rng) with n = task.rows[split] and
    rng = random.Random(f"{task.name}:{split}:{seed}"); (rows, []) as load() returns."""
    task.check_split(split)
    return make(split, task.rows[split], random.Random(f"{task.name}:{split}:{seed}")), []


def load_test_set(task, source):
    """
    The test set of benchmark `task` (a Task with hub_test = (repo, config, split) and to_conversation(row)) in
    nanochat's order, from `source`: "auto" (the hub when it answers, else pinned), "hub", "pinned"
    (nanotrain.tasks.benchmarks) or a folder with a local copy of the hub's files. Returns (conversations, skipped) as
    render_rows. Raises UserError (one line) when the rows cannot be had.
    """
    source = resolve_source(source)
    rows = pinned_rows(task.name) if source == "pinned" else load_hub_rows(*task.hub_test, source)
    return render_rows(task.to_conversation, rows, f"{task.name} test ({source})")
