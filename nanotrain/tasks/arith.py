"""
arith: add / subtract / multiply small numbers, ending "Answer: N", generated offline and deterministically. Half of
the answers (ARITH_TOOL_SHARE, drawn per row) call the calculator tool (<|python_start|>37 + 48<|python_end|>, its
output forced by the engine), the others work it out by hand (37 + 48 = 37 + 40 + 8 = 77 + 8 = 85), so a model learns
both and RL can learn from reward which one pays. Train and val never share a problem (op, a, b) for any seed.
"""

from nanotrain.conversation import assistant, output_part, python_part, text_part, user
from nanotrain.tasks.common import Task, final_int, generated, held_out

ARITH_TOOL_SHARE = 0.5  # the share of arith answers that call the calculator; the others work the sum out by hand

ARITH_QUESTIONS = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.", "{a} {op} {b} = ?",
                   "What do you get for {a} {word} {b}?", "Please work out {a} {op} {b}."]
ARITH_WORDS = {"+": "plus", "-": "minus", "*": "times"}


def _arith_keys():
    """All problems (op, a, b): a + b and a - b (a >= b) for 0 <= a, b <= 99, a * b for 2 <= a <= 30, 2 <= b <= 12."""
    keys = [("+", a, b) for a in range(100) for b in range(100)]
    keys += [("-", a, b) for a in range(100) for b in range(a + 1)]
    keys += [("*", a, b) for a in range(2, 31) for b in range(2, 13)]
    return keys


def _arith_tool_answer(op, a, b):
    """The answer that calls the tool: the expression handed to the calculator, its result, and a final "Answer: N"
    line, as a list of assistant parts (the engine runs the tool at test time; the tool's output is never trained)."""
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    parts = [text_part(f"{a} {op} {b} = "), python_part(f"{a} {op} {b}"), output_part(str(c)), text_part(f".\nAnswer: {c}")]
    return parts, c


def _arith_worked_answer(op, a, b):
    """The answer worked by hand: tens then ones of the second number (add/sub), of the first number (mul)."""
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    if op in "+-" and b >= 10 and b % 10:
        bt, bo = b - b % 10, b % 10
        mid = a + bt if op == "+" else a - bt
        work = f"{a} {op} {b} = {a} {op} {bt} {op} {bo} = {mid} {op} {bo} = {c}."
    elif op == "*" and a >= 10 and a % 10:
        at, ao = a - a % 10, a % 10
        work = f"{a} * {b} = {at} * {b} + {ao} * {b} = {at * b} + {ao * b} = {c}."
    else:
        work = f"{a} {op} {b} = {c}."
    return work + f"\nAnswer: {c}", c


def _make(split, n, rng):
    pools = {op: [] for op in "+-*"}
    for op, a, b in _arith_keys():
        if held_out(f"{op}{a},{b}", 10) == (split == "val"):
            pools[op].append((op, a, b))
    out = []
    for _ in range(n):
        op, a, b = rng.choice(pools[rng.choice("+-*")])
        question = rng.choice(ARITH_QUESTIONS).format(a=a, b=b, op=op, word=ARITH_WORDS[op])
        style = _arith_tool_answer if rng.random() < ARITH_TOOL_SHARE else _arith_worked_answer
        answer, c = style(op, a, b)
        out.append({"messages": [user(question), assistant(answer)], "task": "arith", "answer": str(c)})
    return out


class Arith(Task):
    """The arith task (see the module docstring): rows {"messages", "task": "arith", "answer": "N"}; graded right when
    the final segment of the reply (after the last "answer", else the last line) holds exactly one integer, N
    ("Answer: 85", "the answer is 85." pass; "Answer: 85 or 86" and a last line "1, 1, 1, 1" fail)."""
    name = "arith"
    rows = {"train": 3000, "val": 200}

    def load(self, split, source=None, seed=0):
        return generated(self, split, seed, _make)

    def grade(self, conversation, reply):
        return final_int(reply) == int(conversation["answer"])
