"""
Tests of nanotrain/tasks/ (arith, spell, identity, registry): the built-in tasks (determinism, sizes, disjoint splits) and grading.
"""

import re

import pytest

from nanotrain.conversation import validate_conversation
from nanotrain.tasks.registry import BUILTIN_TASKS, TASKS, grade


def load_task(name, split, seed=0):
    return TASKS[name].load(split, seed=seed)[0]


def conv(*turns):
    roles = ["user", "assistant"] * len(turns)
    return {"messages": [{"role": r, "content": t} for r, t in zip(roles, turns)]}


@pytest.mark.unit
@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_builtin_tasks_deterministic_sized_and_self_consistent(base_dir, name):
    """
    Same seed -> identical rows, another seed -> other rows; sizes as documented; every reference reply is a valid
    conversation that its own grader accepts. Catches a generator seeded from global state, or a reference answer
    the grader cannot parse.
    """
    a, b, c = load_task(name, "train", seed=0), load_task(name, "train", seed=0), load_task(name, "train", seed=1)
    assert a == b and a != c
    assert len(a) == TASKS[name].rows["train"] and len(load_task(name, "val")) == TASKS[name].rows["val"]
    for row in a[:300] + load_task(name, "val"):
        assert validate_conversation(row) is None and row["task"] == name
        assert grade(row, reply_text(row["messages"][-1]["content"]))


def reply_text(content):
    """An assistant message as the engine's decoded output reads: text parts as they are, tool calls and outputs
    between their special tokens."""
    if isinstance(content, str):
        return content
    wrap = {"text": "{}", "python": "<|python_start|>{}<|python_end|>", "python_output": "<|output_start|>{}<|output_end|>"}
    return "".join(wrap[p["type"]].format(p["text"]) for p in content)


def problem_keys(rows):
    """The underlying problem of each row: arith (a op b), spell (the word), identity (the bare question)."""
    keys = set()
    for r in rows:
        if r["task"] == "arith":
            keys.add(reply_text(r["messages"][-1]["content"]).split(" =")[0])
        elif r["task"] == "spell":
            keys.add(re.search(r"^(?:Spelling )?([a-z]+)", reply_text(r["messages"][-1]["content"])).group(1))
        else:
            for m in r["messages"][::2]:
                q = m["content"]
                for g in ("Hi! ", "Hello. ", "Hey, ", "Good morning! ", "Quick question: "):
                    q = q.removeprefix(g)
                keys.add(q.lower().rstrip("?."))
    return keys


@pytest.mark.unit
@pytest.mark.parametrize("name", BUILTIN_TASKS)
def test_builtin_splits_are_disjoint(base_dir, name):
    """No problem of val appears in train, for two seeds. Catches a split drawn from the same pool as train."""
    for seed in (0, 7):
        train, val = problem_keys(load_task(name, "train", seed)), problem_keys(load_task(name, "val", seed))
        assert val and train and not (train & val)


@pytest.mark.unit
def test_grade_right_and_wrong(base_dir):
    """
    Lenient on the form, strict on the final answer. Catches graders that take the first or last number anywhere (a
    rambling base model would score by chance) or accept the word itself as a spelling.
    """
    arith = {"task": "arith", "answer": "85", "messages": []}
    assert grade(arith, "37 + 48 = 37 + 40 + 8 = 77 + 8 = 85.\nAnswer: 85")
    assert grade(arith, "the answer is 85.")
    assert grade(arith, "85")
    assert not grade(arith, "37 + 48 = 85.\nAnswer: 86")  # a right intermediate line does not count
    assert not grade(arith, "Answer: 85 or 86")  # two candidates
    assert not grade(arith, "85, 85, 85, 85")  # a base model's number spam is no answer
    assert not grade(arith, "37 + 48 = 85.")  # no "Answer" and the last line holds several numbers
    assert not grade(arith, "")
    tool = "37 + 48 = <|python_start|>37 + 48<|python_end|><|output_start|>85<|output_end|>.\nAnswer: {}"
    assert grade(arith, tool.format(85)) and not grade(arith, tool.format(86))  # the answer line, not the tool's
    big = {"task": "arith", "answer": "1000", "messages": []}
    assert grade(big, "Answer: 1,000")
    count = {"task": "spell", "answer": "2", "messages": []}
    assert grade(count, "Spelling error: e-r-r-o-r\nThe letter o is at positions 4.\nAnswer: 2")
    assert not grade(count, "Answer: 3")
    spelled = {"task": "spell", "answer": "s-t-r-i-n-g", "messages": []}
    assert grade(spelled, "string is spelled s-t-r-i-n-g.\nAnswer: s-t-r-i-n-g")
    assert grade(spelled, "S, T, R, I, N, G")
    assert not grade(spelled, "Answer: string")  # not spelled out
    assert not grade(spelled, "Answer: s-t-r-i-n")
    ident = {"task": "identity", "keywords": ["python", "documentation"], "messages": []}
    assert grade(ident, "I was trained on Python's Documentation.")
    assert not grade(ident, "I was trained on Python code.")
    generic = conv("What is the capital of France?", "The capital is Paris.\nAnswer: Paris")
    generic["task"] = "jsonl"
    assert grade(generic, "It is Paris, of course.\nanswer: paris.")
    assert not grade(generic, "Answer: Lyon")


@pytest.mark.unit
def test_wilson_interval_literal_values():
    """Published values of the 95% Wilson interval (Newcombe 1998, table I: 0/10 -> [0, 0.2775], 5/10 ->
    [0.2366, 0.7634], 81/263 -> [0.2553, 0.3662]). Catches the normal approximation (zero width at 0/10)."""
    from nanotrain.tasks.common import wilson_interval
    for (k, n), want in {(0, 10): (0.0, 0.2775), (5, 10): (0.2366, 0.7634), (81, 263): (0.2553, 0.3662)}.items():
        assert wilson_interval(k, n) == pytest.approx(want, abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
