"""
Per-problem evaluation records ("samples"): one JSON object per problem, written as JSONL next to an evaluation's
totals, with lm-evaluation-harness's sample field names where they mean the same (doc_id, target, resps,
filtered_resps, the metric by name: "acc"), plus task, split, prompt (the rendered prompt text), reply, extracted
(the answer the grader read), correct. The totals of an evaluation are computed from these rows (totals()), so a
sample file and its totals cannot disagree.
"""

import json
import re

from nanotrain.common import atomic_write_text

CALL = re.compile(r"<\|python_start\|>(.*?)<\|python_end\|>(?:<\|output_start\|>(.*?)<\|output_end\|>)?", re.DOTALL)


def calculator_calls(reply):
    """The calculator calls of a decoded reply (str), in order: [{"expr": str, "result": str or None}], result None
    when no <|output_start|> ... <|output_end|> followed (the tool gave nothing)."""
    return [{"expr": m.group(1), "result": m.group(2)} for m in CALL.finditer(reply)]


def sample_row(task, split, doc_id, prompt, target, reply, extracted, correct, **extra):
    """One sample record (dict): lm-eval's doc_id, target, resps ([[reply]]), filtered_resps ([extracted]) and "acc"
    (float: 1.0 or 0.0; a share for several samples per problem), plus task, split, prompt, reply, extracted,
    correct (bool: acc == 1), and the kind's own fields (**extra)."""
    acc = float(correct)
    return {"doc_id": doc_id, "task": task, "split": split, "prompt": prompt, "target": target, "resps": [[reply]],
            "filtered_resps": [extracted], "reply": reply, "extracted": extracted, "acc": acc,
            "correct": acc == 1.0, **extra}


def totals(rows):
    """(correct, total) of sample rows: the sum of their "acc" and their count."""
    return sum(r["acc"] for r in rows), len(rows)


def write_samples(path, rows):
    """Writes `rows` (list of JSON-able dicts) to `path` as JSONL (one object a line, sorted by task then doc_id),
    atomically."""
    rows = sorted(rows, key=lambda r: (str(r.get("task")), r.get("doc_id", 0)))
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_samples(path):
    """The rows (list of dicts) of a sample file written by write_samples. Raises UserError naming path:line for a
    line that is not a JSON object with task, doc_id and correct."""
    from nanotrain.errors import UserError
    rows = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise UserError(f"{path}: cannot read the sample file ({e.strerror})") from None
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path}:{n}: not a JSON line ({str(e)[:100]})") from None
            if not (isinstance(row, dict) and "task" in row and "doc_id" in row and "correct" in row):
                raise UserError(f"{path}:{n}: expected a sample object with task, doc_id and correct")
            rows.append(row)
    return rows
