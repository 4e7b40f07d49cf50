"""
Run one Python program written by a model and say whether it exited cleanly. The design idea is nanochat's
(nanochat/execution.py: a fresh process, resource limits, a scrubbed environment, a temporary directory); the
isolation is our own. Nothing the model wrote is ever eval'd or exec'd in this process. A verdict that must not be
forgeable (HumanEval) is not taken from here but from nanotrain/sandbox/humaneval_check.py, whose trusted process calls the
program's function across a pipe.

Always: a fresh `python -I -S` process (no PYTHON* variables, no user or site packages: the standard library only),
stdin closed, the environment reduced to PATH, LANG and HOME (its working directory), a fresh temporary working
directory removed afterwards; limits set before the program runs: address space (memory_bytes) per process, CPU
seconds, file size (stdout and stderr go to files, read back cut to OUTPUT_CHARS), 64 open files, no core files;
PR_SET_NO_NEW_PRIVS (no set-uid program or file capability raises its rights); os.kill, os.fork, subprocess and friends
set to None (an accident guard only: ctypes undoes it). The wall-clock limit kills everything and run_program returns
within timeout_s + SWEEP_S + a second, whatever the program does.

How it is isolated, by how this process runs (isolation()):
- root ("uid"): the program runs under a throwaway uid of its own (random, from 2**30 up, no groups), so it cannot
  signal, ptrace or read the memory, environment or pipes of this or any other process, nor write where "others" may
  not; RLIMIT_NPROC (NPROC) bounds its processes and threads. Where a cgroup (v2, or v1 memory and pids) can be made,
  the program is in one of its own: memory_bytes bounds all its processes together and pids.max its processes; else
  memory is bounded per process (NPROC x memory_bytes at most in all). Afterwards this process kills every process of
  that uid (a kill(-1) from a helper under that uid, bounded by a timeout, plus pidfd kills from here, repeated until
  /proc shows none), then removes the uid's files and directories in /tmp, /var/tmp, /dev/shm and /dev/mqueue and its
  SysV shared memory, semaphores and message queues. Not isolated: the network, other processes' command lines in
  /proc, every world-readable file (keep
  secrets and answer keys out of world-readable places: HumanEval's grader makes the base directory 0700 when others
  can reach it), the kernel itself (no seccomp).
- not root, bubblewrap installed and working ("bwrap"): the program runs in `bwrap --unshare-all` (its own user, pid,
  network (none), IPC, UTS and cgroup namespaces), with /usr, the /lib and /bin links and Python's prefix mounted
  read-only, a private /tmp and /dev/shm, its working directory the only writable place, no capabilities, a new
  session (no terminal injection), killed with its namespace when bwrap is; it cannot see, signal or ptrace any
  process outside, read the environment or any file outside those mounts; RLIMIT_NPROC (NPROC) bounds its
  processes (counted in its own user namespace from Linux 5.14; before, all of this user's processes count, so a
  program may not be able to fork at all). /tmp and /dev/shm are tmpfs (RAM) of at most memory_bytes each where the
  installed bwrap takes --size (0.5.0 and later; older: unbounded). Where this user may make a cgroup (a delegated
  cgroup v2 subtree, or v1 memory and pids), the program and all its processes share memory_bytes and pids.max as in
  root mode. Not isolated: elsewhere memory is bounded per process only (NPROC x memory_bytes at most in all, and
  the tmpfs pages, which are not counted in any process's address space), the kernel (no seccomp).
- not root, no working bubblewrap ("none"): no isolation at all: the program runs as this user and can kill this
  process, ptrace it, read its secrets and files, and write into its output. run_program refuses (UserError, one line
  saying why) unless unsafe_code is allowed (require_isolation(unsafe_code=True), or unsafe_code=True).

Platforms: Linux (bwrap and the uid sweep need /proc). On macOS, as a non-root user with unsafe_code only, refused
resource limits are skipped. On Windows run_program raises RuntimeError.
"""

import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache

from nanotrain.errors import UserError
from nanotrain.sandbox.sweep import Cgroup, remove_leftovers, sweep_uid, unused_uid

OUTPUT_CHARS = 4096  # stdout and stderr are each cut to about this many characters: their head and their tail
NPROC = 16  # processes (threads included) the program's uid may have, when it runs under a uid of its own
SWEEP_S = 3.0  # the most seconds the kill of a throwaway uid's processes may take after the program ends
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
UNSAFE_CODE = False  # set by require_isolation(unsafe_code=True): run without isolation when there is none

# Runs in the child as `python -I -S -c GUARD memory_bytes cpu_s file_bytes nproc go_fd`, in the program's directory:
# waits for the parent's go (it is put into its cgroup first), sets the limits and no_new_privs, takes the dangerous
# functions away, then runs main.py as __main__.
GUARD = """
import _posixsubprocess, ctypes, os, resource, sys
memory_bytes, cpu_s, file_bytes, nproc, go = map(int, sys.argv[1:])
if go >= 0:
    os.read(go, 1)
    os.close(go)
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
if sys.platform == "linux" and ctypes.CDLL(None, use_errno=True).prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
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


@dataclass
class ExecutionResult:
    passed: bool  # exit status 0 within the limits
    timed_out: bool  # killed by the wall-clock limit
    returncode: int | None  # the exit status (negative: killed by that signal); None when timed out
    stdout: str  # truncated to about OUTPUT_CHARS characters
    stderr: str  # truncated to about OUTPUT_CHARS characters


def isolation():
    """How model-written code is isolated here: "uid" (this process is root: a throwaway uid), "bwrap" (bubblewrap
    runs a namespace sandbox for this user) or "none" (neither). See the module docstring for what each covers."""
    if os.name == "posix" and os.geteuid() == 0:
        return "uid"
    return "bwrap" if _bwrap_problem() is None else "none"


def require_isolation(unsafe_code=False):
    """Check, before any model-written code is generated or run, that it can be isolated; with unsafe_code=True,
    allow run_program to run it with no isolation from here on (the lm-eval convention). Returns isolation().
    Raises UserError (one line: why, and the three ways out) when there is none and unsafe_code is False."""
    global UNSAFE_CODE
    kind = isolation()
    if kind == "none" and not unsafe_code:
        raise UserError(f"refusing to run model-written code (HumanEval) without isolation: this process is not root "
                        f"(which runs it under a throwaway uid) and bubblewrap cannot be used ({_bwrap_problem()}); "
                        f"install bubblewrap (apt-get install bubblewrap), run as root, or pass --unsafe_code=True "
                        f"to run it as this user, able to read its secrets and kill or ptrace this process")
    UNSAFE_CODE = UNSAFE_CODE or bool(unsafe_code)
    return kind


def run_program(code: str, timeout_s: float = 5.0, memory_bytes: int = 256 * 2**20, cpu_s: int | None = None,
                file_bytes: int = 2**20, pass_fds=(), unsafe_code: bool | None = None) -> ExecutionResult:
    """Run the Python source `code` as __main__ in a fresh, limited, isolated process (see the module docstring) and
    return whether it exited with status 0 within the limits, with its truncated stdout and stderr.

    timeout_s: wall-clock seconds from the start of the process (interpreter start-up included), after which every
    process of the program is killed; memory_bytes: the address-space limit per process in bytes (and the cgroup's
    memory limit for the whole program where there is one); cpu_s: CPU seconds per process, default
    ceil(timeout_s) + 1; file_bytes: the largest file the program may write, in bytes (stdout and stderr each count as
    one); pass_fds: file descriptors of this process the program inherits under the same numbers (pipes to talk to
    it), closed here once the program has started, or when it cannot be (so that the other end sees EOF when the
    program ends); unsafe_code: run with no isolation when there is none (None: the require_isolation setting). A program that
    fails, hangs, crashes or breaks a limit just gives passed=False; nothing is raised for it. Returns within
    timeout_s + SWEEP_S + about a second. Raises ValueError for a limit that is not positive (or not finite),
    UserError when there is no isolation and unsafe_code is not allowed, RuntimeError on Windows or when running as
    root with no Python an unprivileged user can run, OSError when the process cannot be started. Thread-safe: no
    signal handler, cwd or environment of this process is touched."""
    owned = list(pass_fds)  # emptied once closed
    try:
        return _run(code, timeout_s, memory_bytes, cpu_s, file_bytes, owned, unsafe_code)
    finally:
        for fd in owned:
            os.close(fd)


def _run(code, timeout_s, memory_bytes, cpu_s, file_bytes, pass_fds, unsafe_code):
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    for name, value in (("memory_bytes", memory_bytes), ("cpu_s", cpu_s), ("file_bytes", file_bytes)):
        if not (value is None and name == "cpu_s") and not (isinstance(value, int) and value > 0):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if os.name != "posix":
        raise RuntimeError("run_program needs a POSIX system (Linux or macOS)")
    kind = isolation()
    if kind == "none" and not (UNSAFE_CODE if unsafe_code is None else unsafe_code):
        require_isolation()  # raises: a per-call unsafe_code=True is not made the setting of later calls
    cpu_s = math.ceil(timeout_s) + 1 if cpu_s is None else cpu_s
    uid = unused_uid() if kind == "uid" else None
    python = _python(uid)
    with tempfile.TemporaryDirectory(prefix="nanotrain-exec-", ignore_cleanup_errors=True) as workdir, \
            tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        os.chmod(os.path.join(workdir, "main.py"), 0o644)
        if uid is not None:
            os.chown(workdir, uid, uid)  # the directory stays 0o700: only the program (and root) can enter it
        name = f"nanotrain-exec-{uid}" if uid is not None else f"nanotrain-exec-bwrap-{os.getpid()}-{os.urandom(4).hex()}"
        cgroup = Cgroup.make(name, memory_bytes, NPROC) if kind != "none" else None
        go_r, go_w = os.pipe()
        argv = [python, "-I", "-S", "-c", GUARD, str(memory_bytes), str(cpu_s), str(file_bytes),
                str(NPROC if kind != "none" else 0), str(go_r)]
        if kind == "bwrap":
            argv = _bwrap_argv(workdir, python, tmpfs_bytes=memory_bytes) + argv
        drop = {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir}
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, pass_fds=(go_r, *pass_fds), **drop)
        except BaseException:
            os.close(go_w)
            if cgroup is not None:
                cgroup.remove()
            raise
        finally:
            for fd in (go_r, *pass_fds):
                os.close(fd)
            pass_fds.clear()
        timed_out = False
        try:
            if cgroup is not None:
                cgroup.add(proc.pid)
            os.write(go_w, b"g")
            os.close(go_w)
            returncode = proc.wait(timeout=max(0.0, timeout_s - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            timed_out, returncode = True, None
        finally:
            _end(proc, uid, python, cgroup)
        return ExecutionResult(passed=returncode == 0, timed_out=timed_out, returncode=returncode,
                               stdout=_read_truncated(out), stderr=_read_truncated(err))


def _end(proc, uid, python, cgroup):
    """SIGKILL the program's process group (for bwrap: bwrap, whose pid namespace dies with it) and reap the program;
    with a throwaway uid, also every process of that uid (those that left the group too), then its leftovers."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if uid is None:
        if cgroup is not None:
            cgroup.remove()
        return
    try:
        if not sweep_uid(uid, python, cgroup, SWEEP_S):
            print(f"nanotrain.sandbox.execution: processes of the throwaway uid {uid} survived {SWEEP_S:.0f} s of SIGKILLs "
                  f"(stuck in the kernel); they can do nothing a fresh program could not", file=sys.stderr)
    finally:
        if cgroup is not None:
            cgroup.remove()
        remove_leftovers(uid)


@lru_cache(maxsize=1)
def _bwrap_problem():
    """None when `bwrap` can start a fully unshared sandbox here, else why not (one phrase)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None or sys.platform != "linux":
        return "bwrap is not installed" if bwrap is None else "bubblewrap needs Linux"
    argv = _bwrap_argv("/", os.path.realpath(sys.executable)) + ["/bin/true"]
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap failed: {e}"
    return None if r.returncode == 0 else f"bwrap failed: {r.stderr.decode(errors='replace').strip()[:200]}"


@lru_cache(maxsize=1)
def _bwrap_has_size():
    """Whether the installed bwrap takes --size (the size of the next --tmpfs; bubblewrap 0.5.0 and later)."""
    try:
        r = subprocess.run([shutil.which("bwrap") or "bwrap", "--help"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return b"--size" in r.stdout + r.stderr


def _bwrap_argv(workdir, python, tmpfs_bytes=None):
    """bwrap and its options up to the program's argv: every namespace unshared, system directories and Python's
    prefix read-only, a private /tmp and /dev/shm (each a tmpfs of at most tmpfs_bytes where bwrap takes --size),
    workdir the one writable directory (the current directory)."""
    argv = [shutil.which("bwrap") or "bwrap", "--unshare-all", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/alternatives"):
        if os.path.islink(top):
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    prefix = os.path.realpath(sys.base_prefix)
    for path in {prefix, os.path.dirname(os.path.dirname(python))} - {"/", "/usr"}:
        argv += ["--ro-bind", path, path]
    size = ["--size", str(tmpfs_bytes)] if tmpfs_bytes is not None and _bwrap_has_size() else []
    argv += ["--proc", "/proc", "--dev", "/dev", *size, "--tmpfs", "/tmp", *size, "--tmpfs", "/dev/shm"]
    if workdir != "/":
        argv += ["--bind", workdir, workdir]
    return argv + ["--chdir", workdir, "--"]


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
    return os.stat(path).st_mode & 0o005 == 0o005 and reachable_by_others(path)


def reachable_by_others(path):
    """Whether a user with no rights of its own can search every directory above path's real path (path itself is not
    looked at; ACLs are not either)."""
    path = os.path.realpath(path)
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
