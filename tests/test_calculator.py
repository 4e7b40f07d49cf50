"""
The calculator tool (nanotrain/calculator.py): exact results for its language, None for everything else, no side
effect, and the same from a worker thread (nanochat's SIGALRM timeout is silently off there).
"""

import os
import threading
import time

import pytest

from nanotrain.calculator import calculate

pytestmark = pytest.mark.unit

LEGAL = [  # (expression, result worked out by hand)
    ("2+3", "5"), ("12 * 7", "84"), ("100 - 250", "-150"), ("-(4 - 10)", "6"), ("+5", "5"), ("7 // 2", "3"),
    ("-7 // 2", "-4"), ("7 % 3", "1"), ("-7 % 3", "2"), ("6 / 3", "2"), ("7 / 2", "3.5"), ("10 / 4 * 3", "7.5"),
    ("(1 + 2) * (3 + 4)", "21"), ("1,234 + 766", "2000"), ("2 * 1,000,000", "2000000"), ("1 / 3", "0.3333333333"),
    ("0.1 + 0.2", "0.3"), ("1.5 * 4", "6"), ("123456789 * 987654321", "121932631112635269"),
    ("'strawberry'.count('r')", "3"), ('"banana".count("a")', "3"), ("'hello'.count('z')", "0"),
    ("  3 + 4  ", "7"), ("999999999999999 * 1000000000000000", str(10**30 - 10**15)),
]

HOSTILE = [
    "__import__('os').system('touch {marker}')", "open('{marker}', 'w')", "import os", "exec('1')", "eval('1+1')",
    "().__class__.__bases__[0].__subclasses__()", "(1).__class__", "'a'.__class__.__mro__", "'{marker}'.format(1)",
    "globals()", "lambda: 1", "[x for x in range(10)]", "9**9**9", "2 ** 10", "10**1000", "'a' * 10**9",
    "'a' * 100", "'abc'[0]", "'a'.join('bc')", "'a'.count('a', 0)", "'a'.count(x)", "x.count('a')",
    "1 / 0", "1 // 0", "1 % 0", "1.0 / 0.0", "(1 + 2", "1 + 2)", "((1)", "1 +", "", "   ", "١٢ + 1", "１２ + 1",
    "2 ＋ 3", "1e308 * 10", "1" * 40 + " * 10", "99999999999999999999999999999 * 99999999999999999999999999999",
    "1 if 1 else 2", "1 < 2", "True + 1", "not 1", "1 & 3", "1 << 100", "~1", "1j * 2", "b'a'.count(b'a')",
    "f'{{1}}'", "a = 1", "1; 2", "print(1)", "'x' 'y'", "'a'.count('a'" + " + 1" * 60 + ")", "(" * 300 + "1" + ")" * 300,
    "-" * 300 + "1", "'" + "a" * 1100 + "'.count('a')", "1,2", "'a'", "None", "...", None, 12,
]


def test_legal_expressions_give_the_exact_result():
    """Catches eval-like float formatting (6 / 3 -> "2.0"), lost precision on large ints, Python's floor semantics
    replaced by C's truncation (-7 // 2), and thousands separators not removed."""
    for expr, want in LEGAL:
        assert calculate(expr) == want, expr


def test_hostile_inputs_return_none_without_side_effects(tmp_path, monkeypatch):
    """
    Over 60 inputs outside the language or its bounds (imports, attribute and dunder chains, calls, powers, huge
    strings and numbers, division by zero, unbalanced parentheses, non-ASCII digits, deep nesting, non-str input)
    return None, quickly, and create no file. Catches an eval() behind a character filter (the __import__ line would
    create the marker, '9**9**9' would hang) and an evaluator that lets one node type through unchecked.
    """
    monkeypatch.chdir(tmp_path)
    marker = tmp_path / "marker"
    assert len(HOSTILE) >= 30
    t0 = time.time()
    for expr in HOSTILE:
        if isinstance(expr, str):
            expr = expr.replace("{marker}", str(marker))
        assert calculate(expr) is None, expr
    assert time.time() - t0 < 2.0
    assert not marker.exists() and os.listdir(tmp_path) == []


def test_works_from_a_worker_thread():
    """The same answers from a thread (a SIGALRM-based timeout cannot even be installed there)."""
    results = {}
    exprs = [e for e, _ in LEGAL] + ["9**9**9", "1 / 0"]
    thread = threading.Thread(target=lambda: results.update({e: calculate(e) for e in exprs}))
    thread.start()
    thread.join(10)
    assert results == {**{e: w for e, w in LEGAL}, "9**9**9": None, "1 / 0": None}
