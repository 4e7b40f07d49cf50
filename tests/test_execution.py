"""
The program sandbox (nanotrain/execution.py): verdicts for passing and failing programs, the wall-clock, memory and
file-size limits, the scrubbed environment, the temporary directory, the unprivileged uid (no signal to the parent,
no write outside), fork bomb containment and thread safety. Each test names the wrong implementation it catches.
"""

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nanotrain.execution import run_program

pytestmark = pytest.mark.unit

LINUX = sys.platform == "linux"
ROOT = os.name == "posix" and os.geteuid() == 0


def live_processes(pgid=None, uid=None):
    """Pids of the processes (zombies left out) in process group pgid or of user uid, from /proc."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
            owner = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            continue
        if fields[0] != "Z" and (int(fields[2]) == pgid or owner == uid):
            pids.append(int(pid))
    return pids


def gone(pgid=None, uid=None, grace_s=1.0):
    """Whether no live process of group pgid or user uid remains within grace_s (a SIGKILLed process still shows as
    running until the scheduler gives it a moment to exit, which on a loaded machine takes a while)."""
    deadline = time.monotonic() + grace_s
    while live_processes(pgid, uid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_pass_fail_and_syntax_error():
    """Catches a sandbox that reports passed regardless of the exit status, or that loses the traceback."""
    ok = run_program("assert 1 + 1 == 2")
    assert (ok.passed, ok.timed_out, ok.returncode) == (True, False, 0)
    bad = run_program("assert 1 + 1 == 3, 'arithmetic'")
    assert not bad.passed and bad.returncode == 1 and "AssertionError: arithmetic" in bad.stderr
    syntax = run_program("def f(:\n    pass")
    assert not syntax.passed and "SyntaxError" in syntax.stderr


def test_limits_are_checked():
    """Catches a sandbox that runs with a zero or negative limit (no limit at all for some rlimit calls)."""
    for kwargs in ({"timeout_s": 0}, {"timeout_s": float("nan")}, {"memory_bytes": 0}, {"cpu_s": 0},
                   {"file_bytes": -1}, {"memory_bytes": 1.5}):
        with pytest.raises(ValueError):
            run_program("pass", **kwargs)


def test_infinite_loop_is_killed_on_time():
    """Catches a sandbox without a wall-clock limit (the call would hang) or one that waits for the CPU limit."""
    start = time.monotonic()
    result = run_program("while True:\n    pass", timeout_s=1)
    assert time.monotonic() - start < 2
    assert result.timed_out and not result.passed and result.returncode is None


def test_large_allocation_fails_not_the_machine():
    """Catches a sandbox without RLIMIT_AS: the 2 GB allocation would succeed (or take the machine's memory)."""
    result = run_program("x = bytearray(2 * 2**30)\nx[-1] = 1", memory_bytes=256 * 2**20)
    assert not result.passed and not result.timed_out and "MemoryError" in result.stderr


def test_file_size_limit():
    """Catches a sandbox without RLIMIT_FSIZE: a 10 MB file would be written with file_bytes at 1 MB."""
    result = run_program("with open('big', 'wb') as f:\n    f.write(b'x' * 10 * 2**20)", file_bytes=2**20)
    assert not result.passed


def test_output_is_truncated_keeping_the_traceback():
    """Catches a sandbox that returns all of a huge output (or reads it all into memory), or that keeps only its
    head, which loses the exception at the end of stderr."""
    code = "import sys\nprint('o' * 500_000)\nsys.stderr.write('e' * 500_000)\nraise KeyError('last words')"
    result = run_program(code)
    assert not result.passed
    assert len(result.stdout) < 10_000 and len(result.stderr) < 10_000
    assert result.stdout.startswith("ooo") and "KeyError: 'last words'" in result.stderr


def test_no_file_outside_and_temp_dir_removed(tmp_path):
    """Catches a sandbox that runs the program in the parent's cwd, with root's rights (the write into a root-owned
    0o755 directory would succeed), or that leaves its temporary directory behind."""
    outside = tmp_path / "outside"
    outside.mkdir(mode=0o755)
    marker = outside / "marker"
    code = f"""
import os
with open('relative.txt', 'w') as f:
    f.write('inside')
print(os.getcwd())
try:
    open({str(marker)!r}, 'w').write('escaped')
    print('absolute write succeeded')
except OSError as e:
    print('absolute write refused:', type(e).__name__)
"""
    cwd_before = os.getcwd()
    result = run_program(code)
    assert result.passed, result.stderr
    workdir = result.stdout.splitlines()[0]
    assert workdir != cwd_before and not os.path.exists(workdir)
    assert not os.path.exists(os.path.join(cwd_before, "relative.txt"))
    if not ROOT:
        pytest.skip("not root: the program runs as this user and may write where this user may")
    assert "absolute write refused: PermissionError" in result.stdout
    assert not marker.exists()


def test_environment_is_scrubbed(monkeypatch):
    """Catches a sandbox that passes the parent's environment on (a secret, PYTHONPATH) to the program."""
    monkeypatch.setenv("NANOTRAIN_SECRET_TOKEN", "hunter2")
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    result = run_program("import os, sys\nprint(dict(os.environ))\nprint(sys.flags.isolated, sys.flags.no_site)")
    assert result.passed, result.stderr
    env_line, flags = result.stdout.splitlines()
    assert "hunter2" not in result.stdout and "NANOTRAIN_SECRET_TOKEN" not in env_line and "PYTHONPATH" not in env_line
    assert eval(env_line).keys() == {"PATH", "LANG", "HOME"} and flags == "1 1"


@pytest.mark.skipif(not LINUX, reason="needs Linux (POSIX signals, ctypes' libc)")
def test_child_cannot_signal_the_parent():
    """Catches a sandbox that runs the program as root or as this user (the SIGTERM would reach this process), and
    shows that the OS protection holds when ctypes bypasses the Python-level guard."""
    received = []
    old = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        via_os = run_program(f"import os, signal\nos.kill({os.getpid()}, signal.SIGTERM)")
        assert not via_os.passed and not received
        if not ROOT:
            pytest.skip("not root: the program runs as this user, so only the Python guard stops os.kill")
        via_ctypes = run_program(f"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
r = libc.kill({os.getpid()}, 15)
print(r, ctypes.get_errno())
sys.exit(0 if r == 0 else 1)
""")
        time.sleep(0.1)
        assert not received
        assert not via_ctypes.passed and via_ctypes.stdout.split() == ["-1", "1"]  # -1, EPERM
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.skipif(not LINUX, reason="needs Linux (/proc, ctypes' libc fork)")
def test_fork_bomb_is_contained():
    """Catches a sandbox without RLIMIT_NPROC under an unprivileged uid, or one that kills only the program's own
    process (its forked children would survive the call), or waits for them on a pipe. os.fork is None'd by the
    guard, so the bomb forks through ctypes."""
    code = """
import ctypes, os
print(os.getpgid(0), os.getuid(), flush=True)
fork = ctypes.CDLL(None).fork
while True:
    fork()
"""
    start = time.monotonic()
    result = run_program(code, timeout_s=1)
    assert time.monotonic() - start < 1 + 2
    assert result.timed_out and not result.passed
    pgid, uid = map(int, result.stdout.split()[:2])
    assert gone(pgid=pgid)
    if ROOT:
        assert uid != 0 and gone(uid=uid)


@pytest.mark.skipif(not (LINUX and ROOT), reason="needs Linux and root (the program runs under a uid of its own)")
def test_process_that_left_the_group_is_killed():
    """Catches a sandbox that kills only the program's process group: a child that called setsid (a new session, out
    of the group) would outlive the call, here after the program itself passed."""
    code = """
import ctypes, os, time
libc = ctypes.CDLL(None)
if libc.fork() == 0:
    libc.setsid()
    time.sleep(30)
    os._exit(0)
time.sleep(0.2)
print(os.getuid())
"""
    result = run_program(code)
    assert result.passed, result.stderr
    assert gone(uid=int(result.stdout))


def test_thread_safety():
    """Catches a sandbox with shared state between calls (one directory, one output buffer, one signal-based
    timer): four calls at once must each get their own verdict and output."""
    codes = [f"print({i})\nassert {i} % 2 == 0" for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(run_program, codes))
    assert [r.passed for r in results] == [True, False, True, False]
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]
