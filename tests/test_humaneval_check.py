"""
nanotrain/sandbox/humaneval_check.py on code that does not cheat: its verdict equals nanochat's (the whole program run with
its test, pass = exit status 0 and a token printed at its end) on results of every literal type, iterators, nan and
inf, exceptions, exits, prompt helpers and tests that name the entry point; a program that crashes fails at once; a
stalled candidate or a reply too long fails within the time limit. Inline problems: no download.
"""

import os
import secrets
import shutil
import stat
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nanotrain.sandbox.execution import isolation, run_program
from nanotrain.sandbox.humaneval_check import check_all, check_humaneval, hide_answer_key
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


def test_limits_and_trust_reach_the_checker(tmp_path, monkeypatch):
    """
    What a caller gives arrives where it acts. check_humaneval: an honest reply whose test uses a prompt helper passes
    (the prompt, test and entry point reach the checker); with trusted_test=True a test that writes a file in a
    root-only folder does write it (the pinned set's plain checker, the grader's rights), and finds itself without
    the grader's environment (a variable set in it is absent), in a session of its own and without `site` (no .pth
    hook of site-packages ran). check_all with 96 MiB (not the 256 MiB default): a program or a test that takes
    128 MiB fails, an honest one still passes, and a job that does not say trusted_test is sandboxed (the file not
    written). A test that prints before check() still passes (the verdict is the last line), and an error line whose
    kept stderr tail starts inside a multi-byte character still comes back. Catches an argument dropped or replaced by its
    default on the way (the prompt, the test, the trust flag, the memory limit of either process), a
    check_humaneval whose trust defaults to True, and a plain checker that inherits the grader's environment or
    session or runs site (env=None, no start_new_session, -s for -S), a verdict that needs PASSED to be the only
    output, and a strict decode of the checker's stderr tail.
    """
    folder = tmp_path / "root_only"
    folder.mkdir(mode=0o755)
    marker = folder / "written"
    program = "import math\n\n\ndef f(*args):\n    return args[0] + 1\n"
    test = "print('checking')\n\n\ndef check(candidate):\n    assert helper(candidate(1)) == 4\n"
    writing = f"open({str(marker)!r}, 'w').write('x')\n{test}"
    assert check_humaneval(program, PROMPT, test, "f")["passed"] is True
    monkeypatch.setenv("NANOTRAIN_GRADER_SECRET", "x")
    isolated = (f"import os, sys\nassert 'NANOTRAIN_GRADER_SECRET' not in os.environ and 'site' not in sys.modules\n"
                f"assert os.getsid(0) != {os.getsid(0)}\n{writing}")
    assert check_humaneval(program, PROMPT, isolated, "f", trusted_test=True)["passed"] is True and marker.exists()
    marker.unlink()
    big = "x = bytearray(128 * 2**20)\n"
    jobs = [dict(program=program, prompt=PROMPT, test=writing, entry_point="f"),
            dict(program=big + program, prompt=PROMPT, test=test, entry_point="f", trusted_test=True),
            dict(program=program, prompt=PROMPT, test=big + test, entry_point="f", trusted_test=False),
            dict(program=program, prompt=PROMPT, test=test, entry_point="f", trusted_test=False),
            dict(program=program, prompt=PROMPT, test=test, entry_point="f", trusted_test=True),
            dict(program=program, prompt=PROMPT, test=f"raise AssertionError({'é' * 3000!r})\n{test}", entry_point="f",
                 trusted_test=True)]
    got = check_all(jobs, timeout_s=5.0, memory_bytes=96 * 2**20)
    assert [g["passed"] for g in got] == [False, False, False, True, True, False] and not marker.exists()
    assert got[1]["outcome"] == "killed for memory" and "MemoryError" in got[2]["error"]
    assert got[5]["error"].lstrip("\ufffd").startswith("ééé")  # the kept 4 KB tail starts inside an "é"


@pytest.mark.parametrize("mode, parent_mode, hidden", [(0o755, None, True), (0o750, None, False),
                                                        (0o755, 0o700, False)],
                         ids=["enterable", "no-o+x", "under-a-0700-parent"])
def test_answer_key_hidden_only_where_others_could_enter(monkeypatch, capsys, mode, parent_mode, hidden):
    """hide_answer_key (as root, uid isolation): a base directory others can enter (o+x, every parent searchable) is
    made 0700, in one line naming it; one others cannot enter (no o+x, or under a 0700 parent) is left as it is,
    silently. Catches chmod-ing on either condition alone and a mode test that is always true."""
    if isolation() != "uid":
        pytest.skip("hide_answer_key acts only under uid isolation (root)")
    parent = tempfile.mkdtemp(prefix="nanotrain-answer-key-", dir="/tmp")  # pytest's tmp_path is under a 0700 dir
    try:
        base = os.path.join(parent, "base")
        os.mkdir(base)
        os.chmod(parent, parent_mode or 0o755)
        os.chmod(base, mode)
        monkeypatch.setenv("NANOTRAIN_BASE_DIR", base)
        hide_answer_key()
        assert stat.S_IMODE(os.stat(base).st_mode) == (0o700 if hidden else mode)
    finally:
        shutil.rmtree(parent)
    out = capsys.readouterr().out
    assert (f"made the base directory {base} 0700" in out) if hidden else out == ""
