"""
The one place that names the tasks: TASKS (name -> its Task, one class per file of this package), the benchmarks that
make ChatCORE, the --tasks list of chat_eval and the task-mixture spec of mid_train, chat_sft and chat_rl.
"""

import math
import random
import re

from nanotrain.common import print0
from nanotrain.errors import UserError
from nanotrain.tasks.arc import ARC
from nanotrain.tasks.arith import Arith
from nanotrain.tasks.common import grade_last_line
from nanotrain.tasks.gsm8k import GSM8K
from nanotrain.tasks.humaneval import HumanEval
from nanotrain.tasks.identity import Identity
from nanotrain.tasks.jsonl import HF, JSONL
from nanotrain.tasks.mmlu import MMLU
from nanotrain.tasks.smoltalk import SmolTalk
from nanotrain.tasks.spell import Spell

TASKS = {t.name: t for t in (
    Arith(), Spell(), Identity(),
    ARC("arc_easy", ["ARC-Easy"]), ARC("arc_challenge", ["ARC-Challenge"]), ARC("arc", ["ARC-Easy", "ARC-Challenge"]),
    MMLU("mmlu", {"test": "test"}), MMLU("mmlu_aux", {"train": "auxiliary_train", "val": "validation"}),
    GSM8K(), HumanEval(), SmolTalk(), JSONL(), HF())}
BUILTIN_TASKS = ("arith", "spell", "identity")  # generated offline, graded on their reference
BENCHMARKS = ("arc_easy", "arc_challenge", "mmlu", "gsm8k", "humaneval")  # ChatCORE's five (nanochat's)
HUB_SOURCES = ("gsm8k", "arc", "mmlu_aux", "smoltalk")  # mixture parts NAME (the hub) or NAME:PATH (a local copy)


def grade(conversation, reply):
    """True when the reply (str) answers the conversation's last question, graded by the conversation's task (its
    "task" field); a conversation of no known task is graded on the last line (grade_last_line)."""
    task = TASKS.get(conversation.get("task"))
    return bool(task.grade(conversation, reply)) if task is not None else grade_last_line(conversation, reply)


def parse_task_names(spec, flag="--tasks"):
    """
    The task names of chat_eval's comma-separated list (built-ins and benchmarks; "chatcore" stands for the five
    benchmarks), in order, without repeats; "" gives []. Raises UserError naming `flag` and the bad name.
    """
    names = []
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        for name in (BENCHMARKS if part == "chatcore" else (part,)):
            if name not in BUILTIN_TASKS + BENCHMARKS:
                raise UserError(f"{flag}: unknown task {name!r}; expected {', '.join(BUILTIN_TASKS + BENCHMARKS)} "
                                f"or chatcore")
            if name not in names:
                names.append(name)
    return names


def parse_task_spec(spec):
    """
    Parses a task mixture spec into [(kind, arg, weight)]: comma-separated parts "arith", "spell", "identity", the
    named hub sources "gsm8k", "arc", "mmlu_aux", "smoltalk" (NAME:PATH reads a local copy of the hub's files
    instead), "jsonl:PATH" or "hf:NAME_OR_PATH", each optionally followed by
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
        if kind in ("jsonl", "hf") or (kind in HUB_SOURCES and rest and not re.fullmatch(number, rest)):
            head, sep, tail = rest.rpartition(":")  # KIND:PATH[:WEIGHT]
            arg, raw = (head, tail) if sep and re.fullmatch(number, tail) else (rest, "1")
            if not arg and kind in ("jsonl", "hf"):
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
    taken once (weights do not apply). Built-ins come from their Task's load(split, seed=seed); JSONL files and hf
    sources without a validation split give every 20th row to val. Rows repeated by a weight are the same dict
    objects (do not mutate them). Skipped bad rows (skip_bad_rows=True) are reported with print0; skip_bad_rows is
    load_jsonl's (None: the script has no --skip_bad_rows, and a bad row's message does not suggest it).
    Returns list[dict]. Raises UserError for a bad spec, a bad row (file:line) or an unloadable source.
    """
    if split not in ("train", "val"):
        raise UserError(f"split={split!r}: expected 'train' or 'val'")
    out = []
    for index, (kind, arg, weight) in enumerate(parse_task_spec(spec)):
        if kind in ("jsonl", "hf"):
            rows, skipped = TASKS[kind].load(split, arg, skip_bad_rows=skip_bad_rows)
            if skipped:
                print0(f"warning: skipped {len(skipped)} bad rows of {kind}:{arg}")
        else:
            rows = TASKS[kind].load(split, arg, seed)[0]  # hub sources' bad rows: one warning line there
        if split == "val":
            out += rows
            continue
        whole, frac = int(weight), weight - int(weight)
        out += rows * whole
        if frac > 0:
            out += random.Random(f"{seed}:{index}").sample(rows, round(frac * len(rows)))
    random.Random(seed).shuffle(out)
    return out
