"""
The program sandbox (nanotrain/sandbox/execution.py): verdicts for passing and failing programs, the wall-clock, memory and
file-size limits, the scrubbed environment, the temporary directory, the unprivileged uid (no signal to the parent,
no write outside), fork bomb containment and thread safety; then the escapes, each as root (a throwaway uid) and as a
non-root user under bubblewrap (the test starts /usr/bin/python3 under an unused uid, execution.py imports only
nanotrain.errors, so torch is not needed): a detached grandchild looping kill(-1, SIGKILL) or kill(-1, SIGSTOP) after the program ended,
ten children holding memory, files and SysV IPC left behind, and an attack on the parent (kill, ptrace, its
environment, its stdout); and the refusal without isolation. Each test names the wrong implementation it catches.
"""

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from nanotrain.sandbox.execution import run_program

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


# ----------------------------------------------------------------------------- escapes, as root and under bwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEM_PYTHON = "/usr/bin/python3"
# Runs as an unused uid under /usr/bin/python3: run_program(stdin's code) with argv[1] as its keyword arguments (JSON);
# prints the result as JSON. HARNESS_PID in the code becomes this process's pid.
HARNESS = f"""
import json, os, sys, time
sys.path.insert(0, {REPO!r})
from nanotrain.sandbox import execution  # it imports nanotrain.errors only: no torch needed under the system Python
from nanotrain.errors import UserError
code = sys.stdin.read().replace("HARNESS_PID", str(os.getpid()))
start = time.monotonic()
try:
    r = execution.run_program(code, **json.loads(sys.argv[1]))
    out = dict(vars(r), isolation=execution.isolation())
except UserError as e:
    out = {{"refused": str(e)}}
out["elapsed"] = time.monotonic() - start
print(json.dumps(out), flush=True)
"""


def bwrap_works_for_others():
    """Whether an unprivileged user can run the system Python and bubblewrap here (the non-root cells need both)."""
    import shutil
    return LINUX and ROOT and os.path.exists(SYSTEM_PYTHON) and shutil.which("bwrap") is not None


def as_non_root(code, path="/usr/bin:/bin", env=None, **kwargs):
    """(run_program's result as a dict, or {"refused": line}; the harness's uid) for `code` run by HARNESS under an
    unused uid, with PATH=path (no bwrap on it: no isolation)."""
    import json
    import subprocess

    from nanotrain.sandbox.sweep import unused_uid
    uid = unused_uid()
    proc = subprocess.run([SYSTEM_PYTHON, "-I", "-S", "-c", HARNESS, json.dumps(kwargs)], input=code, text=True,
                          capture_output=True, cwd="/tmp", env={"PATH": path, **(env or {})}, user=uid, group=uid,
                          extra_groups=[], timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), uid, proc.stdout


MODES = ["root", "bwrap"]


def run_as(mode, code, **kwargs):
    """(result dict, elapsed seconds, the uid whose processes must all be gone afterwards: the program's when root,
    the harness's under bwrap)."""
    if mode == "root":
        if not (LINUX and ROOT):
            pytest.skip("needs Linux and root")
        start = time.monotonic()
        r = vars(run_program(code, **kwargs))
        return r, time.monotonic() - start, int(r["stdout"].split()[0]) if r["stdout"].split() else None
    if not bwrap_works_for_others():
        pytest.skip("needs root (to start an unprivileged user), /usr/bin/python3 and bwrap")
    r, uid, _ = as_non_root(code, **kwargs)
    assert r.get("isolation") == "bwrap", r
    return r, r["elapsed"], uid


KILLER = """
import ctypes, os, time
libc = ctypes.CDLL(None)
print(os.getuid(), flush=True)
main = os.getpid()
if libc.fork() == 0:
    libc.setsid()
    if libc.fork() == 0:
        while libc.kill(main, 0) == 0:
            time.sleep(0.01)
        while True:
            libc.kill(-1, SIGNAL)
    os._exit(0)
time.sleep(0.2)
"""


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP])
def test_detached_grandchild_looping_kill_minus_one(mode, sig):
    """A grandchild in a session of its own waits for the program to end, then loops kill(-1, SIGKILL or SIGSTOP):
    run_program returns within timeout + 5 s, nothing of the uid survives and the next program runs. Catches a sweep
    run as that uid with no time bound (SIGSTOP stops it and run_program never returns; SIGKILL kills it and the
    grandchild survives) or a kill of the process group only."""
    result, elapsed, uid = run_as(mode, KILLER.replace("SIGNAL", str(int(sig))), timeout_s=2)
    assert result["passed"], result
    assert elapsed < 2 + 5
    assert gone(uid=uid, grace_s=2)
    assert run_as(mode, "print(os.getuid())".replace("print", "import os\nprint"))[0]["passed"]


@pytest.mark.parametrize("mode", MODES)
def test_fork_count_is_bounded(mode):
    """A program forking 200 sleeping children gets at most NPROC processes, as root and under bwrap, and none is
    left afterwards. Catches a sandbox without RLIMIT_NPROC (all 200 forks would succeed), e.g. under bwrap where
    the program runs as this user."""
    from nanotrain.sandbox.execution import NPROC
    code = """
import ctypes, os, time
print(os.getuid(), flush=True)
libc = ctypes.CDLL(None)
forked = 0
for _ in range(200):
    pid = libc.fork()
    if pid == 0:
        time.sleep(10)
        os._exit(0)
    forked += pid > 0
print(forked)
"""
    result, _, uid = run_as(mode, code, timeout_s=2)
    assert result["passed"], result
    assert 0 < int(result["stdout"].split()[-1]) < NPROC
    assert gone(uid=uid, grace_s=2)


@pytest.mark.skipif(not (LINUX and ROOT), reason="needs Linux and root (the program's cgroup)")
def test_ten_children_holding_memory_are_bounded_per_program():
    """Ten forked children each touch 100 MB against memory_bytes of 256 MB: where the program has a cgroup, the
    memory they hold together stays under 256 MB (plus 32 MB of slack). Catches memory bounded per process only
    (RLIMIT_AS): 10 x 100 MB = 1000 MB would be held."""
    from nanotrain.sandbox.sweep import Cgroup
    probe = Cgroup.make("nanotrain-probe", 2**30, 4)
    if probe is None:
        pytest.skip("no cgroup can be made here: memory is bounded per process only (NPROC x memory_bytes)")
    probe.remove()
    code = forking_children(10, 100)
    result = run_program(code, timeout_s=3, memory_bytes=256 * 2**20)
    assert "held_mb" in result.stdout, result
    assert int(result.stdout.split()[-1]) <= 256 + 32


LEFTOVERS = """
import ctypes, os
print(os.getuid(), flush=True)
libc = ctypes.CDLL(None, use_errno=True)
for path in ("/tmp/nanotrain-leftover-TAG", "/dev/shm/nanotrain-leftover-TAG"):
    with open(path, "w") as f:
        f.write("left")
os.mkdir("/tmp/nanotrain-leftover-dir-TAG")
open("/tmp/nanotrain-leftover-dir-TAG/inner", "w").write("left")
assert libc.shmget(KEY, 4096, 0o1600) >= 0, ctypes.get_errno()
assert libc.semget(KEY, 1, 0o1600) >= 0, ctypes.get_errno()
assert libc.msgget(KEY, 0o1600) >= 0, ctypes.get_errno()
"""


def sysv_keys():
    keys = set()
    for kind in ("shm", "sem", "msg"):
        with open(f"/proc/sysvipc/{kind}") as f:
            keys |= {int(line.split()[0]) for line in list(f)[1:] if line.strip()}
    return keys


@pytest.mark.parametrize("mode", MODES)
def test_files_and_ipc_left_behind_are_removed(mode):
    """Files and a directory in /tmp and /dev/shm, and a SysV shared memory segment, semaphore set and message queue
    (key KEY) made by the program are gone after the call. Catches a sandbox that removes only its working directory
    (the program's files and IPC objects would outlive it)."""
    import secrets
    tag, key = secrets.token_hex(4), 0x4E540000 + secrets.randbelow(2**16)
    result, _, _ = run_as(mode, LEFTOVERS.replace("TAG", tag).replace("KEY", str(key)))
    assert result["passed"], result
    for path in (f"/tmp/nanotrain-leftover-{tag}", f"/dev/shm/nanotrain-leftover-{tag}",
                 f"/tmp/nanotrain-leftover-dir-{tag}"):
        assert not os.path.exists(path), path
    assert key not in sysv_keys()


def test_no_new_privs():
    """Catches a sandbox that lets a set-uid program raise the program's rights (no PR_SET_NO_NEW_PRIVS)."""
    result = run_program("print(open('/proc/self/status').read())")
    assert "NoNewPrivs:\t1" in result.stdout, result.stdout[-500:]


ATTACK = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
seen = {"ptrace": libc.ptrace(16, HARNESS_PID, None, None), "kill": libc.kill(HARNESS_PID, 9)}
for what, path, mode in (("environ", "/proc/HARNESS_PID/environ", "rb"), ("stdout", "/proc/HARNESS_PID/fd/1", "w")):
    try:
        with open(path, mode) as f:
            seen[what] = f.read().decode("latin-1") if mode == "rb" else f.write("pass@1 = 1.0 (forged)\\n")
    except OSError as e:
        seen[what] = type(e).__name__
print(seen, dict(os.environ))
"""


@pytest.mark.skipif(not bwrap_works_for_others(), reason="needs root (to start an unprivileged user), "
                                                         "/usr/bin/python3 and bwrap")
def test_non_root_under_bwrap_cannot_touch_the_parent():
    """As a non-root user under bubblewrap, the program cannot ptrace or kill the process that runs it, read its
    HF_TOKEN (environment or /proc/<pid>/environ) or write a forged line into its stdout. Catches running the
    program as this user with no namespace (every one of the four succeeds: the harness would die)."""
    r, _, stdout = as_non_root(ATTACK, env={"HF_TOKEN": "hf_secret_token"})
    assert r.get("isolation") == "bwrap", r
    assert "hf_secret_token" not in r["stdout"] and "forged" not in stdout
    assert "'ptrace': -1" in r["stdout"] and "'kill': -1" in r["stdout"], r["stdout"]


@pytest.mark.skipif(not (LINUX and ROOT and os.path.exists(SYSTEM_PYTHON)),
                    reason="needs root (to start an unprivileged user) and /usr/bin/python3")
def test_non_root_without_bwrap_refuses_unless_unsafe_code():
    """As a non-root user with no bwrap on PATH, run_program refuses in one line naming bubblewrap and
    --unsafe_code=True, and runs the program (as that user) with unsafe_code=True. Catches running model code with
    no isolation by default, or a refusal that cannot be overridden."""
    refused, _, _ = as_non_root("print('ran')", path="/nonexistent")
    assert "\\n" not in refused["refused"] and "bubblewrap" in refused["refused"] and \
        "--unsafe_code=True" in refused["refused"], refused
    ran, _, _ = as_non_root("print('ran')", path="/nonexistent", unsafe_code=True)
    assert ran["isolation"] == "none" and ran["passed"] and ran["stdout"] == "ran\n"


def forking_children(n, mb):
    """A program that forks n children (os.fork itself is guarded: libc's fork), each touching mb MB and sleeping 3 s,
    then prints "held_mb <the children's resident + swapped MB>" read from /proc one second in."""
    return f"""
import ctypes, os, time
libc = ctypes.CDLL(None)
kids = []
for _ in range({n}):
    pid = libc.fork()
    if pid == 0:
        b = bytearray({mb} * 2**20)
        for i in range(0, len(b), 4096):
            b[i] = 1
        time.sleep(3)
        os._exit(0)
    kids.append(pid)
time.sleep(1.0)
total = 0
for pid in kids:
    try:
        with open(f"/proc/{{pid}}/status") as f:
            total += sum(int(line.split()[1]) for line in f if line.startswith(("VmRSS", "VmSwap")))
    except OSError:
        pass
print("held_mb", total // 1024)
"""
