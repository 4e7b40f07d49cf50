"""
nanotrain/sandbox/humaneval_check.py on code that does not cheat: its verdict equals nanochat's (the whole program run with
its test, pass = exit status 0 and a token printed at its end) on results of every literal type, iterators, nan and
inf, exceptions, exits, prompt helpers and tests that name the entry point; a program that crashes fails at once; a
stalled candidate or a reply too long fails within the time limit. Inline problems: no download.
"""

import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nanotrain.sandbox.execution import isolation, run_program
from nanotrain.tasks.humaneval import grade_humaneval, grade_humaneval_detail, humaneval_program

pytestmark = pytest.mark.unit
if isolation() == "none":
    pytest.skip("no isolation for model-written code here (not root, no working bubblewrap)", allow_module_level=True)

PROMPT = 'import math\n\n\ndef helper(x):\n    return 2 * x\n\n\ndef f(*args):\n    """A function."""\n'
VALUE = ("{'a': (1, 2.5, -0.0, None, True, b'x', 1+2j, frozenset({1}), set(), float('inf'), range(3), 'line\\n'),"
         " 7: [[], {}, -3]}")
CASES = [  # (reply's body of f, test's asserts on candidate)
    ("return (i for i in args)", "assert tuple(candidate(1, 2)) == (1, 2)"),
    ("return (i for i in args)", "assert candidate(1, 2) == [1, 2]"),
    ("return map(str, args)", "assert sorted(candidate(2, 1)) == ['1', '2']"),
    ("return float('nan')", "assert math.isnan(candidate())"),
    ("return float('nan')", "assert candidate() == candidate()"),
    (f"return {VALUE}", f"assert candidate() == {VALUE}"),
    (f"return {VALUE}", "assert candidate() == {'a': (1,)}"),
    ("return args[0] * 1.5", "assert abs(candidate(2) - 3.0) < 1e-9 and candidate(-1) < 0"),
    ("raise ValueError('no')", "assert candidate() is None"),
    ("return None", "assert candidate() is None"),
    ("import sys\n    sys.exit(0)", "assert candidate() is None"),
    ("return args[0] + 1", "assert helper(candidate(1)) == 4"),
    ("return args[0] + 1", "assert candidate(1) == f(1) == 2"),
    ("return sum(args)", "assert candidate(*range(10)) == 45 and candidate() == 0"),
]


def conversation(test):
    return {"messages": [{"role": "user", "content": PROMPT}], "entry_point": "f",
            "test": f"\n\nMETADATA = {{}}\n\n\ndef check(candidate):\n    {test}\n"}


def token_grader(conv, completion):
    """nanochat's verdict: the whole program with its test in the sandbox, exit 0 and the token at its end."""
    token = secrets.token_hex(16)
    result = run_program(humaneval_program(conv, completion) + f"print({token!r})\n")
    return result.passed and token in result.stdout


@pytest.mark.parametrize("trusted", [True, False], ids=["pinned-checker", "sandboxed-checker"])
def test_verdict_on_honest_code_is_nanochats(trusted):
    """Each case's verdict equals the token grader's, and both pass and fail occur. Catches a trusted side that
    loses a type on the way (nan, -0.0, sets, bytes, complex, range, dict keys), turns a generator into a list (the
    == [...] case would pass), lets an exception or sys.exit(0) in the candidate pass, or runs the test without the
    prompt's helpers or the entry point's own name. Both checkers: the pinned set's plain one and the sandboxed one."""
    pairs = [(dict(conversation(test), trusted_test=trusted), f"{PROMPT}    {body}\n") for body, test in CASES]
    with ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda p: token_grader(*p), pairs))
    got = grade_humaneval(pairs)
    assert got == expected, [(c, e) for c, g, e in zip(CASES, got, expected) if g != e]
    assert True in got and False in got


@pytest.mark.parametrize("body, timeout_s, limit_s, outcome, error, trusted", [
    ("import time\n    time.sleep(60)", 1, 1 + 3, "timed out", ("TimeoutError", "EOFError"), False),
    ("return 'x' * (8 * 2**20)", 1, 1 + 3, "failed", "ValueError: the answer is too long", False),
    ("return 'x' * (8 * 2**20)", 1, 1 + 3, "failed", "ValueError: the answer is too long", True),
    ("pass\nraise SystemExit(3)", 5, 4, "failed", ("EOFError", "BrokenPipeError"), False),
    ("return 1\nx = bytearray(2**30)", 5, 4, "killed for memory", "MemoryError", True)])
def test_stalls_and_crashes_fail_in_time(body, timeout_s, limit_s, outcome, error, trusted):
    """A candidate that sleeps, one whose answer is longer than MAX_REPLY_BYTES, a program that ends before it
    serves, and one that takes 1 GiB against its 256 MiB: False, within the time limit plus the sweep (the crashes
    well before their limit of 5 s), with the outcome and the exception's line the sample records show. Catches a
    trusted side that waits for an answer without a deadline, reads one without a bound, or waits out the limit after
    the program is gone; an outcome that calls a timeout or a memory kill a plain failure, and an error line taken
    from the wrong process or cut to nothing."""
    conv = dict(conversation("assert candidate() is not None"), trusted_test=trusted)
    start = time.monotonic()
    got = grade_humaneval_detail([(conv, f"{PROMPT}    {body}\n")], timeout_s=timeout_s)
    assert time.monotonic() - start < limit_s
    assert got[0]["passed"] is False and got[0]["outcome"] == outcome
    assert got[0]["error"].startswith(error)  # a prefix or a tuple of them where two processes race


def test_the_test_field_runs_sandboxed_not_with_the_graders_rights(tmp_path):
    """
    A HumanEval row whose `test` (data, not model output: the hub's current revision or a local --data copy) writes a
    file into the grader's own temporary directory and lists /root before defining check(): the file is never
    written and the reply fails, while the same row with an honest test still passes. Catches the test run in a
    process with the grader's rights (the old trusted checker: the file written, as root, and the reply passed).
    """
    marker = tmp_path / "written_by_the_test"
    hostile = (f"open({str(marker)!r}, 'w').write('x')\nimport os\nos.listdir('/root')\n\n\n"
               f"def check(candidate):\n    assert candidate(1) == 2\n")
    honest = "\n\ndef check(candidate):\n    assert candidate(1) == 2\n"
    reply = "def f(*args):\n    return args[0] + 1\n"
    convs = [dict(conversation("pass"), test=hostile), dict(conversation("pass"), test=honest)]
    assert grade_humaneval([(c, reply) for c in convs]) == [False, True]
    assert not marker.exists()
