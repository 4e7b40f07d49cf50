"""
Parts of nanotrain/sandbox/execution.py that test_execution.py reaches only through a whole program run or only in a
child process (its non-root cells run under another uid and Python, where no test of this process sees them): the
cut of a long output, the refusal without isolation and unsafe_code, the bubblewrap argv put to work in this process,
the checks of who may run the interpreter, the limits' error messages and the pipes passed to the program.
"""

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from nanotrain.errors import UserError
from nanotrain.sandbox import execution
from nanotrain.sandbox.execution import OUTPUT_CHARS, run_program

pytestmark = pytest.mark.unit

LINUX = sys.platform == "linux"
ROOT = os.name == "posix" and os.geteuid() == 0


def test_long_output_keeps_its_ends_and_says_what_was_cut():
    """An output of exactly OUTPUT_CHARS bytes comes back whole; a longer one as its first and last OUTPUT_CHARS // 2
    bytes around a line giving the number of bytes left out, which with the kept bytes adds up to what was written.
    Catches a cut one byte early, a cut that keeps the wrong ends (or overlapping ones), and a wrong count."""
    half = OUTPUT_CHARS // 2
    code = ("import sys\nsys.stdout.write('a' * OUTPUT_CHARS)\n"
            "sys.stderr.write('h' * (half + 10) + 'm' * 5000 + 't' * (half + 7))").replace(
        "OUTPUT_CHARS", str(OUTPUT_CHARS)).replace("half", str(half))
    r = run_program(code)
    assert r.passed, r.stderr[-300:]
    assert r.stdout == "a" * OUTPUT_CHARS
    bad = run_program("import sys\nsys.stdout.buffer.write(b'\\xff' * 10)\n"
                      "sys.stderr.buffer.write(b'\\xff' + b'.' * 3 * OUTPUT_CHARS + b'\\xff')".replace(
                          "OUTPUT_CHARS", str(OUTPUT_CHARS)))
    assert bad.passed and bad.stdout == "\ufffd" * 10  # bytes that are not UTF-8 do not break the verdict
    assert bad.stderr.startswith("\ufffd.") and bad.stderr.endswith(".\ufffd")
    total = 2 * half + 17 + 5000
    head, rest = r.stderr.split("\n... [", 1)
    count, tail = rest.split(" bytes cut] ...\n", 1)
    assert head == "h" * half and tail == "t" * half
    assert int(count) + len(head) + len(tail) == total


@pytest.mark.skipif(not (LINUX and ROOT), reason="needs Linux and root (the program runs under a uid of its own)")
def test_program_runs_under_a_fresh_uid_with_no_groups(capfd):
    """As root, each program runs under a uid of its own from 2**30 up, with that gid and no supplementary groups,
    and its cgroup is removed afterwards; a clean sweep prints nothing. Catches the uid switch lost (the program would
    run as root: every limit but the rlimits gone, and a kill(-1) kills the machine), root's gid or groups kept (it
    could write where group root may), one uid reused, cgroups left over, or the sweep's warning printed when it
    succeeded."""
    code = ("import os\nassert os.environ['HOME'] == os.getcwd()\n"
            "print(os.getuid(), os.geteuid(), os.getgid(), os.getegid(), os.getgroups())")
    first, second = (run_program(code) for _ in range(2))
    assert first.passed and second.passed, first.stderr + second.stderr
    ids = [eval(r.stdout.replace(" ", ",", 4)) for r in (first, second)]
    for uid, euid, gid, egid, groups in ids:
        assert uid >= 2**30 and uid == euid == gid == egid and groups == []
        left = [os.path.join(root, d) for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/memory", "/sys/fs/cgroup/pids")
                if os.path.isdir(root) for d in os.listdir(root) if d == f"nanotrain-exec-{uid}"]
        assert left == []  # its cgroup, where it had one, is gone
    assert ids[0][0] != ids[1][0]
    assert capfd.readouterr().err == ""


@pytest.fixture
def no_isolation(monkeypatch):
    """This process as one with neither root nor a working bubblewrap, UNSAFE_CODE restored afterwards."""
    monkeypatch.setattr(execution, "isolation", lambda: "none")
    monkeypatch.setattr(execution, "UNSAFE_CODE", False)


def test_without_isolation_refuses_in_one_line_unless_unsafe_code(no_isolation):
    """With no isolation, require_isolation and run_program refuse in one line naming bubblewrap, root and
    --unsafe_code=True; run_program(unsafe_code=True) runs the program; require_isolation(unsafe_code=True) makes
    later calls run it too. Catches model code run without isolation by default, a refusal that cannot be overridden
    (per call or once for the process), or one that does not say how to get out of it."""
    with pytest.raises(UserError) as e:
        execution.require_isolation()
    message = str(e.value)
    assert "\n" not in message and "bubblewrap" in message and "root" in message and "--unsafe_code=True" in message
    with pytest.raises(UserError):
        run_program("print('ran')")
    with pytest.raises(UserError):
        run_program("print('ran')", unsafe_code=False)
    r = run_program("print('ran')", unsafe_code=True)
    assert r.passed and r.stdout == "ran\n"
    with pytest.raises(UserError):  # a per-call override is not remembered
        run_program("print('ran')")
    assert execution.require_isolation(unsafe_code=True) == "none"
    assert run_program("print('ran')").stdout == "ran\n"


def test_isolation_as_root_is_a_throwaway_uid():
    """Catches root being told it has no isolation (or bubblewrap's instead of a uid of its own)."""
    if not ROOT:
        pytest.skip("needs root")
    assert execution.isolation() == "uid" and execution.require_isolation() == "uid"


@pytest.mark.skipif(not (LINUX and shutil.which("bwrap")), reason="needs Linux and bwrap")
def test_bwrap_problem_names_a_missing_bwrap(monkeypatch):
    """Catches a bubblewrap check that passes when bwrap is not on PATH (run_program would then fail to start every
    program), or that fails when it works."""
    execution._bwrap_problem.cache_clear()
    try:
        assert execution._bwrap_problem() is None
        execution._bwrap_problem.cache_clear()
        monkeypatch.setenv("PATH", "/nonexistent")
        assert execution._bwrap_problem() == "bwrap is not installed"
    finally:
        execution._bwrap_problem.cache_clear()


@pytest.mark.skipif(not (LINUX and shutil.which("bwrap")), reason="needs Linux and bwrap")
def test_bwrap_has_size_matches_the_installed_version():
    """Catches a --size check that answers the same whatever bubblewrap is installed (bubblewrap takes --size from
    0.5.0 on)."""
    out = subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.split()[-1]
    version = tuple(int(x) for x in out.split(".")[:2])
    execution._bwrap_has_size.cache_clear()
    assert execution._bwrap_has_size() == (version >= (0, 5))


BWRAP_VIEW = """
import os
with open("written", "w") as f:
    f.write("x")
seen = {
    "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
    "cwd": os.getcwd() == os.environ["HOME"],
    "tmp": [p for p in os.listdir("/tmp") if not os.getcwd().startswith(os.path.join("/tmp", p))],
    "repo": os.path.exists(REPO),
    "usr": os.path.isdir("/usr/lib"),
}
seen["capeff"] = [line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")][0]
seen["sid"] = os.getsid(0)
seen["devnull"] = os.path.exists("/dev/null")
written = 0
try:
    with open("/tmp/fill", "wb") as f:
        for _ in range(24):
            f.write(b"x" * 2**22)
            f.flush()
            written += 2**22
except OSError:
    pass
os.remove("/tmp/fill")
seen["tmp_mb"] = written // 2**20
for path in ("/tmp/x", "/usr/x"):
    try:
        open(path, "w").close()
        seen[path] = "written"
    except OSError as e:
        seen[path] = type(e).__name__
print(seen)
"""


@pytest.mark.skipif(not (LINUX and ROOT and shutil.which("bwrap")), reason="needs Linux, root and bwrap")
def test_bwrap_mode_runs_the_program_in_its_own_namespaces(monkeypatch):
    """The bubblewrap argv put to work in this process (bwrap mode forced; run here as root, so that the program's
    view is what is looked at, not the rights of a user): the program sees only its own processes, an empty private
    /tmp it may write to, /usr read-only, not this repository, and runs in its working directory, which it may write
    to; it has no capabilities, a session of its own, a /dev, and a /tmp that holds at most memory_bytes (where bwrap
    takes --size). Catches an argv that shares the pid namespace, the host's /tmp or the whole file system, leaves
    /usr writable, does not bind the working directory (the program could not start or write), keeps root's
    capabilities, shares the caller's session (a terminal to inject into) or leaves /tmp unbounded (RAM)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setattr(execution, "isolation", lambda: "bwrap")
    r = run_program(BWRAP_VIEW.replace("REPO", repr(repo)), memory_bytes=64 * 2**20)
    assert r.passed, r.stderr[-500:]
    seen = eval(r.stdout)
    assert int(seen["capeff"], 16) == 0 and seen["sid"] != 0 and seen["devnull"]
    assert seen["tmp_mb"] <= 64 if execution._bwrap_has_size() else seen["tmp_mb"] == 96
    assert len(seen["pids"]) <= 3 and seen["cwd"] and seen["tmp"] == [] and not seen["repo"] and seen["usr"]
    assert seen["/tmp/x"] == "written" and seen["/usr/x"] in ("OSError", "PermissionError")


@pytest.mark.skipif(not LINUX, reason="needs Linux permissions")
def test_who_may_reach_and_run_a_path():
    """reachable_by_others needs the search bit for others on every directory above the path; _runnable_by_others
    needs the path itself readable and executable by others too; _python keeps this interpreter for this process's
    own uid and picks one another uid can run. Catches a check of the wrong permission bits (the program could not
    start its interpreter under a throwaway uid) or of the path instead of its directories."""
    with tempfile.TemporaryDirectory() as tmp:
        if not execution.reachable_by_others(tmp):
            pytest.skip("the temporary directory's parent is not reachable by others")
        os.chmod(tmp, 0o711)
        top = os.path.join(tmp, "top")
        inner = os.path.join(top, "inner")
        os.makedirs(inner)
        exe = os.path.join(inner, "python")
        open(exe, "w").close()
        for mode, reachable in ((0o700, False), (0o750, False), (0o711, True), (0o755, True)):
            os.chmod(top, mode)
            assert execution.reachable_by_others(exe) == reachable, oct(mode)
        for mode, runnable in ((0o755, True), (0o751, False), (0o754, False), (0o705, True)):
            os.chmod(exe, mode)
            assert execution._runnable_by_others(exe) == runnable, oct(mode)
        os.chmod(inner, 0o700)  # the file is fine, a directory above it is not
        assert not execution._runnable_by_others(exe)
    assert execution._python(None) == os.path.realpath(sys.executable)
    if ROOT:
        theirs = execution._python(2**30 + 12345)
        assert execution._runnable_by_others(theirs)


def test_limit_errors_name_the_limit():
    """Catches a ValueError that does not say which limit is wrong (or a check that names the wrong one)."""
    for name, value in (("timeout_s", -1), ("memory_bytes", 0), ("cpu_s", 0), ("file_bytes", 2.5)):
        with pytest.raises(ValueError, match=name):
            run_program("pass", **{name: value})
    assert run_program("pass", cpu_s=None).passed  # cpu_s may be left to its default


def test_cpu_limit_and_a_short_timeout_are_kept():
    """A busy loop with cpu_s=1 and a 5 s wall-clock limit is ended by the CPU limit (SIGXCPU, or SIGKILL at the hard limit) within a few seconds,
    not by the wall clock; an infinite loop with timeout_s=0.2 is over in well under a second. Catches a cpu_s that
    is ignored (or replaced by the default from timeout_s), and a wait that never ends before a second has passed."""
    start = time.monotonic()
    r = run_program("while True:\n    pass", timeout_s=5, cpu_s=1)
    assert not r.timed_out and r.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and time.monotonic() - start < 4, r
    start = time.monotonic()
    r = run_program("while True:\n    pass", timeout_s=0.2)
    assert r.timed_out and time.monotonic() - start < 1.0


def test_passed_pipe_reaches_the_program_and_is_closed_here():
    """The write end of a pipe passed in pass_fds reaches the program under its own number and is closed in this
    process once the program has started: the read end sees what the program wrote, then end-of-file when it has
    ended. Catches a pass_fds that is not passed on, or left open here (the reader would wait forever)."""
    r_fd, w_fd = os.pipe()
    try:
        result = run_program(f"import os\nos.write({w_fd}, b'hello from the program')", pass_fds=(w_fd,))
        assert result.passed, result.stderr
        with pytest.raises(OSError):
            os.fstat(w_fd)
        data = b""
        while select.select([r_fd], [], [], 5)[0]:
            chunk = os.read(r_fd, 1024)
            if not chunk:
                break
            data += chunk
        else:
            pytest.fail("no end-of-file: the write end is still open somewhere")
        assert data == b"hello from the program"
    finally:
        os.close(r_fd)
