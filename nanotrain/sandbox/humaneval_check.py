"""
A HumanEval verdict the model's program cannot forge. nanochat runs one program, the prompt's imports + the reply's
code + the problem's test + check(entry_point), and reads its exit status; here that program is split in two:
- the untrusted half, the prompt's imports + the reply's code, runs in nanotrain.sandbox.execution's sandbox (same limits as
  nanochat: 5 s, 256 MB), followed by a small server that calls the function the test asks for and writes back
  repr(("ok", result)) or the name of the exception it raised, one line per call;
- the trusted half runs the problem's test and check(entry_point) in a process of its own that never executes model
  code: the prompt (benchmark text: the helpers some tests use, such as poly or encode_cyclic, come from it), then the
  test, then check() with a candidate that forwards each call across a pipe. Arguments and results cross as text and
  are read back by a literal-only parser (ast.literal_eval's grammar plus nan, inf, set(), frozenset(...) and
  range(...)), so no object the program made, with a rigged __eq__ or otherwise, ever reaches the test's asserts; a
  result that is an iterator (a generator, map, filter) crosses as its items and is an iterator again on the trusted
  side, so that tuple(candidate(x)) passes and candidate(x) == [...] fails as in nanochat. The verdict is that
  process's exit status: 0 only when check() returned. That process has the grader's rights only for the verified
  pinned set (nanotrain.tasks.benchmarks checks its sha256); a test from anywhere else (the hub's current revision, a local
  copy) is data, not code this project vouches for, and its checker runs in the sandbox as well.
The program never sees the test or a token it could print: exiting early, printing from an atexit hook, an
excepthook or a thread, or tracing around check() can only lose. A result that is not a literal (a custom object, a
value whose repr fails) is a failed call, as is a reply too long, late or missing. Where this differs from nanochat on
code that is not trying to cheat: arguments are copies (a candidate that mutates its argument is not seen doing so by
the test; no HumanEval test looks), a result of a type with no literal (a Fraction, a Decimal, a class of the reply's)
fails even where nanochat's == would accept it, and the prompt's helpers the test calls are the prompt's, not the
reply's. The answer key is kept from the program: as root the base directory (the pinned and hub copies of the
benchmarks) is made 0700 when others could enter it (the program runs under another uid); under bubblewrap it is not
mounted; with no isolation nothing is kept from it. A local copy (--data=/path) is the user's to keep unreadable.
"""

import contextlib
import os
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from nanotrain.common import get_base_dir, print0
from nanotrain.sandbox.execution import isolation, reachable_by_others, run_program

MAX_REPLY_BYTES = 4 * 2**20  # the longest result line the trusted side reads; longer is a failed call
ERROR_CHARS = 200  # the most characters of a failed problem's error line that are kept

# The trusted side: `python -I -S -c CHECKER to_program_fd from_program_fd`, the job (prompt, test, entry_point,
# timeout_s) as JSON on stdin. Exit status 0 and "PASSED" only when check(candidate) returned.
CHECKER = r"""
import ast, json, math, os, select, sys, time
to_program, from_program = int(sys.argv[1]), int(sys.argv[2])
job = json.load(sys.stdin)
deadline = time.monotonic() + job["timeout_s"]
MAX_REPLY = job["max_reply_bytes"]

def literal(node):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = [literal(e) for e in node.elts]
        return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](items)
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {literal(k): literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.Name) and node.id in ("nan", "inf"):
        return float(node.id)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = literal(node.operand)
        if type(v) in (int, float, complex):
            return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        a, b = literal(node.left), literal(node.right)
        if type(a) in (int, float) and type(b) is complex:
            return a + b if isinstance(node.op, ast.Add) else a - b
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("set", "frozenset")
            and not node.keywords and len(node.args) <= 1):
        return {"set": set, "frozenset": frozenset}[node.func.id](literal(node.args[0]) if node.args else ())
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"
            and not node.keywords and 1 <= len(node.args) <= 3):
        args = [literal(a) for a in node.args]
        if all(type(a) is int for a in args):
            return range(*args)
    raise ValueError(f"not a literal: {type(node).__name__}")

def decode(text):
    return literal(ast.parse(text, mode="eval").body)

def send(data):
    while data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [to_program], [], left)[1]:
            raise TimeoutError("the program did not take the call in time")
        data = data[os.write(to_program, data):]

pending = b""
def receive():
    global pending
    while b"\n" not in pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the program did not answer in time")
        if not select.select([from_program], [], [], left)[0]:
            continue
        chunk = os.read(from_program, 1 << 16)
        if not chunk:
            raise EOFError("the program ended before answering")
        pending += chunk
        if len(pending) > MAX_REPLY:
            raise ValueError("the answer is too long")
    line, pending = pending.split(b"\n", 1)
    return line.decode("utf-8")

class Candidate:
    def __init__(self, name):
        self.name = name
    def __call__(self, *args, **kwargs):
        call = repr((self.name, args, kwargs))
        decode(call)  # only literals may cross
        send(call.encode("utf-8") + b"\n")
        answer = decode(receive())
        if not (isinstance(answer, tuple) and len(answer) == 2 and answer[0] in ("ok", "iter", "raise")):
            raise ValueError("not an answer")
        if answer[0] == "raise":
            raise RuntimeError(f"the candidate raised {answer[1]}")
        if answer[0] == "iter":
            if not isinstance(answer[1], list):
                raise ValueError("not an answer")
            return iter(answer[1])
        return answer[1]

ns = {"__name__": "__main__"}
exec(compile(job["prompt"], "prompt", "exec"), ns)
ns[job["entry_point"]] = Candidate(job["entry_point"])
exec(compile(job["test"], "test", "exec"), ns)
ns["check"](ns[job["entry_point"]])
print("PASSED", flush=True)
"""

# Appended to the untrusted half, formatted with the pipe fds: answers the trusted side's calls until it hangs up.
SERVE = """

def _nanotrain_serve(calls, answers):
    import math as _math, os as _os
    env = {{"__builtins__": {{}}, "nan": _math.nan, "inf": _math.inf, "set": set, "frozenset": frozenset,
           "range": range}}
    pending = b""
    while True:
        while b"\\n" not in pending:
            chunk = _os.read(calls, 1 << 16)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\\n", 1)
        name, args, kwargs = eval(line.decode("utf-8"), env)
        try:
            result = globals()[name](*args, **kwargs)
            if hasattr(result, "__next__") and iter(result) is result:  # a generator, map, filter, zip...
                text = repr(("iter", list(result)))
            else:
                text = repr(("ok", result))
        except BaseException as e:
            text = repr(("raise", type(e).__name__))
        data = (text + "\\n").encode("utf-8", "backslashreplace")
        while data:
            data = data[_os.write(answers, data):]

_nanotrain_serve({calls}, {answers})
"""


def _first_error_line(text):
    """The last non-empty line of a traceback or stderr text (the exception's line), cut to ERROR_CHARS; "" for
    none."""
    lines = [x.strip() for x in text.splitlines() if x.strip() and not x.startswith("... [")]
    return lines[-1][:ERROR_CHARS] if lines else ""


def _outcome(result):
    """The sandbox outcome of a program's ExecutionResult that did not pass: "timed out", "killed for memory" (a
    MemoryError or a SIGKILL, which is what the cgroup's memory limit sends) or "failed"."""
    if result.timed_out:
        return "timed out"
    if result.returncode == -9 or "MemoryError" in result.stderr:
        return "killed for memory"
    return "failed"


def check_humaneval(program, prompt, test, entry_point, timeout_s=5.0, memory_bytes=256 * 2**20, trusted_test=False):
    """
    Whether `program` (str: the prompt's imports and the reply's code, nanochat's program without its test) passes
    the HumanEval test `test` (str defining check(candidate)) for the function `entry_point`, `prompt` (str) being
    the problem's prompt (run on the checker's side for the helpers the test uses), with the reason. The program runs
    in run_program's sandbox with timeout_s seconds and memory_bytes of address space; the test in a checker process
    that gets only literals from it (see the module docstring). A program that fails, hangs, crashes or answers
    something that is not a literal does not pass. Thread-safe. Returns {"passed": bool, "outcome": "passed" |
    "failed" | "timed out" | "killed for memory", "error": the exception line of the checker, or of the program when
    the checker only saw it end, at most ERROR_CHARS characters, "" when it passed}. The program's output itself is never kept: a program that prints
    10 MB leaves at most one short line here. trusted_test: the test and prompt are the verified pinned set
    (nanotrain.tasks.benchmarks checks their sha256) and run in a plain process with the grader's rights; otherwise (the
    hub's current revision, a local copy: data, not code this project vouches for) the checker runs in run_program's
    sandbox too, under its own limits (timeout_s + 1 s, memory_bytes), still reaching the candidate only across the
    pipe with literals. Raises what run_program raises.
    """
    import json
    calls_r, calls_w = os.pipe()
    answers_r, answers_w = os.pipe()
    job = {"prompt": prompt, "test": test, "entry_point": entry_point, "timeout_s": timeout_s,
           "max_reply_bytes": MAX_REPLY_BYTES}
    start = time.monotonic()
    sandboxed = {}
    try:
        with tempfile.TemporaryFile() as verdict, tempfile.TemporaryFile() as errors:
            if trusted_test:
                try:
                    checker = subprocess.Popen([sys.executable, "-I", "-S", "-c", CHECKER, str(calls_w),
                                                str(answers_r)], stdin=subprocess.PIPE, stdout=verdict,
                                               stderr=errors, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                               pass_fds=(calls_w, answers_r), start_new_session=True)
                finally:
                    os.close(calls_w)
                    os.close(answers_r)
                    calls_w = answers_r = None
                with contextlib.suppress(BrokenPipeError):
                    checker.stdin.write(json.dumps(job).encode("utf-8"))
                    checker.stdin.close()
            else:
                code = (f"import io, sys\nsys.argv[1:] = [{str(calls_w)!r}, {str(answers_r)!r}]\n"
                        f"sys.stdin = io.StringIO({json.dumps(job)!r})\n{CHECKER}")
                fds = (calls_w, answers_r)
                calls_w = answers_r = None
                checker = threading.Thread(target=lambda: sandboxed.update(result=run_program(
                    code, timeout_s=timeout_s + 1.0, memory_bytes=memory_bytes, pass_fds=fds)), daemon=True)
                checker.start()
            fds, calls_r, answers_w = (calls_r, answers_w), None, None  # run_program closes them
            program_result = run_program(program + SERVE.format(calls=fds[0], answers=fds[1]), timeout_s=timeout_s,
                                         memory_bytes=memory_bytes, pass_fds=fds)
            if trusted_test:
                try:
                    returncode = checker.wait(timeout=max(0.0, start + timeout_s + 1.0 - time.monotonic()))
                except subprocess.TimeoutExpired:
                    checker.kill()
                    returncode = checker.wait()
                verdict.seek(0)
                passed = returncode == 0 and verdict.read().splitlines()[-1:] == [b"PASSED"]
                errors.seek(max(0, os.fstat(errors.fileno()).st_size - 4096))
                checker_error = errors.read().decode("utf-8", errors="replace")
            else:
                checker.join()
                if "result" not in sandboxed:
                    raise RuntimeError("the sandboxed HumanEval checker did not run")
                result = sandboxed["result"]
                passed = result.passed and result.stdout.splitlines()[-1:] == ["PASSED"]
                checker_error = result.stderr
    finally:
        for fd in (calls_r, answers_w, calls_w, answers_r):
            if fd is not None:
                os.close(fd)
    if passed:
        return {"passed": True, "outcome": "passed", "error": ""}
    error = _first_error_line(checker_error)
    if not error or error.startswith(("EOFError", "BrokenPipeError")):  # the program ended first: its error says why
        error = _first_error_line(program_result.stderr) or error
    failed = program_result.timed_out or program_result.returncode not in (0, None)
    return {"passed": False, "outcome": _outcome(program_result) if failed else "failed", "error": error}


def hide_answer_key():
    """As root (programs run under a throwaway uid), make the base directory (which holds the benchmarks' answers)
    0700 when a user with no rights of its own could enter it, saying so in one line; else nothing (bubblewrap does
    not mount it; with no isolation nothing can be hidden)."""
    if isolation() != "uid":
        return
    base = get_base_dir()
    mode = os.stat(base).st_mode
    if mode & 0o001 and reachable_by_others(base):
        os.chmod(base, stat.S_IMODE(mode) & 0o700)
        print0(f"made the base directory {base} 0700, so that the programs a model writes cannot read the benchmark "
               f"answers in it")


def check_all(jobs, timeout_s=5.0, memory_bytes=256 * 2**20, workers=4):
    """[dict(program, prompt, test, entry_point[, trusted_test])] -> list of check_humaneval's dicts
    ({"passed", "outcome", "error"}), `workers` at a time, after hide_answer_key()."""
    if not jobs:
        return []
    hide_answer_key()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda j: check_humaneval(**j, timeout_s=timeout_s, memory_bytes=memory_bytes),
                             jobs))
