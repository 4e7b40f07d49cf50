"""
What nanotrain/sandbox/execution.py does around a program run under a throwaway uid (this process being root): pick an unused
uid, make a cgroup for the program where the machine lets us, and afterwards kill every process of that uid (bounded in
time, whatever they do) and remove the files and SysV IPC objects it left. Linux only (/proc, /proc/sysvipc,
/sys/fs/cgroup); every function here is a no-op or returns False where those are missing.
"""

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import stat
import subprocess
import time

# Runs as the throwaway uid: kill(-1) signals every process of that uid but itself, atomically against fork.
KILL_UID = """
import os
for _ in range(100):
    try:
        os.kill(-1, 9)
    except ProcessLookupError:
        break
"""
SHARED_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/dev/mqueue")  # world-writable places a program may leave files in
CGROUP_ROOT = "/sys/fs/cgroup"


def unused_uid():
    """A random uid from [2**30, 2**31) that no account and no running process has (two calls at once picking the
    same one is a 1 in 2**30 chance)."""
    import pwd
    while True:
        uid = 2**30 + secrets.randbelow(2**30)
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if not live_pids(uid):
                return uid


def live_pids(uid):
    """Pids of the live processes (zombies and dead ones left out) whose owner is uid, from /proc ([] without it)."""
    out = []
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not pid.isdigit():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X", "x"):
            out.append(int(pid))
    return out


def sweep_uid(uid, python, cgroup, limit_s):
    """SIGKILL every process of uid until /proc shows none, for at most limit_s seconds: each round a helper under uid
    runs kill(-1, SIGKILL) (atomic against fork; the helper itself is killed when it does not end within a second,
    e.g. stopped by a SIGSTOP from the program), the cgroup's processes are killed, and each process /proc lists is
    killed through a pidfd after its owner is checked (so a reused pid is never hit); at least one round, so that
    without /proc (macOS) the helper still runs once. Returns whether none is left (True without /proc)."""
    deadline = time.monotonic() + limit_s
    while True:
        if cgroup is not None:
            cgroup.kill()
        for pid in live_pids(uid):
            _kill_pid(pid, uid)
        helper = subprocess.Popen([python, "-I", "-S", "-c", KILL_UID], env={}, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, user=uid, group=uid,
                                  extra_groups=[])
        try:
            helper.wait(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            helper.kill()
            helper.wait()
        if not live_pids(uid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _kill_pid(pid, uid):
    """SIGKILL pid if it is (still) owned by uid: the pidfd is opened first, then the owner checked, so the signal
    goes to the process that was checked."""
    try:
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):
        return
    try:
        if os.stat(f"/proc/{pid}").st_uid == uid:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_leftovers(uid):
    """Remove what uid left behind: its files, links and directories (whole) in SHARED_DIRS and in the world-writable
    directories below them, and its SysV shared memory segments, semaphore sets and message queues. Call only when
    no process of uid is left. Errors are ignored (best effort: a file that cannot be removed stays)."""
    for top in SHARED_DIRS:
        _remove_owned(top, uid, depth=3)
    libc = None
    for kind, ctl in (("shm", "shmctl"), ("sem", "semctl"), ("msg", "msgctl")):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                head, *rows = [line.split() for line in f if line.strip()]
        except (OSError, ValueError):
            continue
        for row in rows:
            try:
                fields = dict(zip(head, row))
                if uid not in (int(fields["uid"]), int(fields["cuid"])):
                    continue
                libc = libc or ctypes.CDLL(None, use_errno=True)
                ident = int(row[1])
                if kind == "sem":
                    libc.semctl(ident, 0, 0)  # IPC_RMID = 0
                else:
                    getattr(libc, ctl)(ident, 0, None)
            except (KeyError, ValueError, IndexError, AttributeError):
                continue


def _remove_owned(directory, uid, depth):
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
            if st.st_uid == uid:
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
            elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o002 and depth > 1:
                _remove_owned(e.path, uid, depth - 1)
        except OSError:
            continue


class Cgroup:
    """A cgroup of its own for one program: memory and pids limits on all its processes together. cgroup v2 (a
    child of this process's cgroup with the memory and pids controllers) or v1 (memory/<name> and pids/<name>)."""

    def __init__(self, dirs):
        self.dirs = dirs  # the cgroup directories made (one for v2; memory and pids for v1)

    @classmethod
    def make(cls, name, memory_bytes, pids):
        """The cgroup `name` with memory.max (limit_in_bytes) = memory_bytes and pids.max = pids, or None when this
        machine does not let us make one (no cgroup file system, read-only, controllers not delegated)."""
        try:
            if os.path.exists(f"{CGROUP_ROOT}/cgroup.controllers"):  # v2
                with open("/proc/self/cgroup") as f:
                    mine = [line.split(":", 2)[2].strip() for line in f if line.startswith("0::")][0]
                parent = os.path.join(CGROUP_ROOT, mine.lstrip("/"))
                path = os.path.join(parent, name)
                os.mkdir(path)
                made = cls([path])
                limits = {"memory.max": memory_bytes, "memory.swap.max": 0, "pids.max": pids}
            else:  # v1
                made = cls([])
                for ctl in ("memory", "pids"):
                    path = os.path.join(CGROUP_ROOT, ctl, name)
                    os.mkdir(path)
                    made.dirs.append(path)
                limits = {"memory.limit_in_bytes": memory_bytes, "memory.memsw.limit_in_bytes": memory_bytes,
                          "pids.max": pids}
        except (OSError, IndexError):
            return None
        try:
            for key, value in limits.items():
                files = [os.path.join(d, key) for d in made.dirs if os.path.exists(os.path.join(d, key))]
                if not files and key not in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
                    raise OSError(f"no {key}")
                for file in files:
                    with open(file, "w") as f:
                        f.write(str(value))
        except OSError:
            made.remove()
            return None
        return made

    def add(self, pid):
        """Move process pid into the cgroup (raises OSError when the kernel refuses)."""
        for d in self.dirs:
            with open(os.path.join(d, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def kill(self):
        """SIGKILL every process in the cgroup (cgroup.kill on v2 where the kernel has it)."""
        for d in self.dirs:
            try:
                if os.path.exists(os.path.join(d, "cgroup.kill")):
                    with open(os.path.join(d, "cgroup.kill"), "w") as f:
                        f.write("1")
                    continue
                with open(os.path.join(d, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
            except (OSError, ValueError):
                continue
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)

    def remove(self):
        """Remove the cgroup directories (retried for a moment while the kernel lets go of its exited processes)."""
        for d in self.dirs:
            for _ in range(50):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
