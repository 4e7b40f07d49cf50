"""
Run one Python program written by a model (a HumanEval completion with its tests) and say whether it exited cleanly.
The design idea is nanochat's (nanochat/execution.py: a fresh process, resource limits, a scrubbed environment, a
temporary directory); the code is our own. Nothing the model wrote is ever eval'd or exec'd in this process.

What run_program does, on Linux:
- the program runs in a fresh `python -I -S` process (isolated mode: no PYTHON* variables, no user or site
  packages, so only the standard library can be imported), in a new session (its own process group), with stdin
  closed, the environment reduced to PATH=/usr/bin:/bin, LANG=C.UTF-8 and HOME=its working directory, and a fresh
  temporary directory as working directory, removed afterwards (also after a timeout);
- resource limits are set in the child before the program runs: address space (memory_bytes), CPU seconds, the
  size of any file it writes (stdout and stderr included: they go to files, so the parent never holds more than a
  few KB of them), 64 open files, no core files;
- when this process runs as root, the child runs as an unprivileged uid of its own (a random unused uid from
  2**30 up, one per call, gid the same, no supplementary groups), so it cannot signal this process or any other
  program, cannot write where "others" may not, and RLIMIT_NPROC (32 processes) stops a fork bomb; afterwards every
  process of that uid is killed, including those that left the process group with setsid. A Python under a private
  home (e.g. /root/.pyenv) cannot be run by that uid, so the child then runs the system's /usr/bin/python3 (or
  /usr/local/bin/python3); if neither can be run by an unprivileged user, run_program raises RuntimeError;
- when not root, the child runs as this user: no RLIMIT_NPROC (it counts all of the user's processes, so a small
  limit would also stop the program's threads), and the program *can* signal this user's processes with ctypes;
- after the wall-clock limit the whole process group is killed with SIGKILL; its processes' zombies are left to
  init to reap;
- a guard run before the program sets os.kill, os.fork, os.system, os.exec*, subprocess's fork_exec and friends to
  None, against accidents (shutil.rmtree is not touched: importing shutil costs more start-up time
  than it is worth). It is defence in depth only: ctypes and other dynamic features undo it at once.

What it does NOT protect against: this is not a security boundary. There is no seccomp, no container, no namespace
(no PID, user, mount or network namespace: we skip `unshare`), so the program can use the network, read every
world-readable file, write into world-writable directories (/tmp, /dev/shm; RLIMIT_FSIZE bounds each file's size,
not their number), and use a kernel bug. The program can also end with sys.exit(0) before its tests run. It is meant
for grading benchmark code a model wrote, not for running hostile code.

Platforms: Linux. On macOS the resource limits the system refuses (RLIMIT_AS often) are skipped. On Windows
run_program raises RuntimeError.
"""

import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

OUTPUT_CHARS = 4096  # stdout and stderr are each cut to about this many characters: their head and their tail
NPROC = 32  # processes (threads included) the program's uid may have, when it runs under a uid of its own
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")

# Runs in the child as `python -I -S -c GUARD memory_bytes cpu_s file_bytes nproc`, in the program's directory:
# sets the limits, takes the dangerous functions away, then runs main.py as __main__.
GUARD = """
import _posixsubprocess, os, resource, sys
memory_bytes, cpu_s, file_bytes, nproc = map(int, sys.argv[1:])
def limit(name, value):
    r = getattr(resource, name, None)
    try:
        hard = resource.getrlimit(r)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(r, (value, value))
    except (TypeError, ValueError, OSError):
        if sys.platform == "linux":  # on Linux every limit must hold; elsewhere (macOS) a refused one is skipped
            raise
limit("RLIMIT_AS", memory_bytes)
limit("RLIMIT_CPU", cpu_s)
limit("RLIMIT_FSIZE", file_bytes)
limit("RLIMIT_NOFILE", 64)
limit("RLIMIT_CORE", 0)
if nproc:
    limit("RLIMIT_NPROC", nproc)
with open("main.py", encoding="utf-8") as f:
    source = f.read()
for name in ("kill", "killpg", "system", "popen", "fork", "forkpty", "setsid", "execv", "execve", "execvp",
             "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
             "posix_spawn", "posix_spawnp", "pidfd_open"):
    if hasattr(os, name):
        setattr(os, name, None)
_posixsubprocess.fork_exec = None  # subprocess.Popen cannot start anything
sys.argv = ["main.py"]
exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
"""

# Runs as the program's uid after the program: kill(-1) signals every process of that uid but itself, atomically
# against fork; ESRCH once nothing is left (zombies still count, hence the bound).
KILL_UID = """
import os
for _ in range(100):
    try:
        os.kill(-1, 9)
    except ProcessLookupError:
        break
"""


@dataclass
class ExecutionResult:
    passed: bool  # exit status 0 within the limits
    timed_out: bool  # killed by the wall-clock limit
    returncode: int | None  # the exit status (negative: killed by that signal); None when timed out
    stdout: str  # truncated to about OUTPUT_CHARS characters
    stderr: str  # truncated to about OUTPUT_CHARS characters


def run_program(code: str, timeout_s: float = 5.0, memory_bytes: int = 256 * 2**20, cpu_s: int | None = None,
                file_bytes: int = 2**20) -> ExecutionResult:
    """Run the Python source `code` as __main__ in a fresh, limited process (see the module docstring) and return
    whether it exited with status 0 within the limits, with its truncated stdout and stderr.

    timeout_s: wall-clock seconds from the start of the process (interpreter start-up included), after which the
    process group is killed; memory_bytes: the address-space limit in bytes; cpu_s: CPU seconds per process,
    default ceil(timeout_s) + 1; file_bytes: the largest file the program may write, in bytes (stdout and stderr
    each count as one). A program that fails, hangs, crashes or breaks a limit just gives passed=False; nothing is
    raised for it. Raises ValueError for a limit that is not positive (or not finite), RuntimeError on Windows or
    when running as root with no Python an unprivileged user can run, OSError when the process cannot be started.
    Thread-safe: no signal handler, cwd or environment of this process is touched."""
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    for name, value in (("memory_bytes", memory_bytes), ("cpu_s", cpu_s), ("file_bytes", file_bytes)):
        if not (value is None and name == "cpu_s") and not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if os.name != "posix":
        raise RuntimeError("run_program needs a POSIX system (Linux or macOS)")
    cpu_s = math.ceil(timeout_s) + 1 if cpu_s is None else cpu_s
    uid = _unused_uid() if os.geteuid() == 0 else None
    python = _python(uid)
    drop = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
    argv = [python, "-I", "-S", "-c", GUARD, str(memory_bytes), str(cpu_s), str(file_bytes), str(NPROC if drop else 0)]
    with tempfile.TemporaryDirectory(prefix="nanotrain-exec-", ignore_cleanup_errors=True) as workdir, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        os.chmod(os.path.join(workdir, "main.py"), 0o644)
        if uid is not None:
            os.chown(workdir, uid, uid)  # the directory stays 0o700: only the program (and root) can enter it
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True, **drop)
        timed_out = False
        try:
            returncode = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out, returncode = True, None
        finally:
            _kill_all(proc, uid, python)
        return ExecutionResult(passed=returncode == 0, timed_out=timed_out, returncode=returncode,
                               stdout=_read_truncated(out), stderr=_read_truncated(err))


def _kill_all(proc, uid, python):
    """SIGKILL the program's process group and reap the program; with a uid of its own, also every process of that
    uid (those that left the group too). Zombies of its children are left to init."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    if uid is not None:
        subprocess.run([python, "-I", "-S", "-c", KILL_UID], env={}, stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, user=uid, group=uid, extra_groups=[],
                       check=False)
    for _ in range(10):  # killpg is atomic against fork, so one is enough; a few more cost nothing
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            break


def _unused_uid():
    """A random uid from [2**30, 2**31) that no account and no running process has (two calls at once picking the
    same one is a 1 in 2**30 chance)."""
    import pwd
    while True:
        uid = 2**30 + secrets.randbelow(2**30)
        try:
            pwd.getpwuid(uid)
        except KeyError:
            pids = os.listdir("/proc") if os.path.isdir("/proc") else []
            if not any(_owner(pid) == uid for pid in pids if pid.isdigit()):
                return uid


def _owner(pid):
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None


def _python(uid):
    """The interpreter the child runs: sys.executable, or, for an unprivileged uid that cannot run it (and its
    standard library), the first system Python that uid can run."""
    ours = os.path.realpath(sys.executable)
    if uid is None or (_runnable_by_others(ours) and _runnable_by_others(os.path.dirname(os.__file__))):
        return ours
    for path in SYSTEM_PYTHONS:
        if os.path.exists(path) and _runnable_by_others(path):
            return path
    raise RuntimeError(f"running as root, the program runs as an unprivileged uid, which cannot run {ours} (nor any "
                       f"of {', '.join(SYSTEM_PYTHONS)}): install a system python3 or make {ours} readable by others")


def _runnable_by_others(path):
    """Whether a user with no rights of its own can reach and run path (a file or a directory): its real path's
    directories are searchable and the path itself readable and executable by others (ACLs are not looked at)."""
    path = os.path.realpath(path)
    if os.stat(path).st_mode & 0o005 != 0o005:
        return False
    while path != os.path.dirname(path):
        path = os.path.dirname(path)
        if not os.stat(path).st_mode & 0o001:
            return False
    return True


def _read_truncated(f):
    """The text in the file f, cut to its first and last OUTPUT_CHARS // 2 bytes when longer."""
    size = f.seek(0, os.SEEK_END)
    f.seek(0)
    if size <= OUTPUT_CHARS:
        return f.read().decode("utf-8", errors="replace")
    head = f.read(OUTPUT_CHARS // 2)
    f.seek(size - OUTPUT_CHARS // 2)
    tail = f.read()
    cut = size - len(head) - len(tail)
    return (head.decode("utf-8", errors="replace") + f"\n... [{cut} bytes cut] ...\n"
            + tail.decode("utf-8", errors="replace"))
