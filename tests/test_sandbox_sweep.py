"""
The throwaway-uid machinery of nanotrain/sandbox/sweep.py, each part on its own with real processes, files, cgroups and
SysV objects (as root on Linux): the uid picked, the processes counted as alive, the sweep that kills every process of
the uid (no cgroup to help it, a process of the uid stopping the sweep's helper), the leftovers removed (and only
those), and the program's cgroup. run_program's tests (test_execution.py) see these only through a whole program run,
where each part is backed up by another (the cgroup kill, the helper's kill(-1), the pidfd kills).
"""

import ctypes
import os
import secrets
import shutil
import signal
import subprocess
import time

import pytest

from nanotrain.sandbox.execution import _python
from nanotrain.sandbox.sweep import Cgroup, live_pids, remove_leftovers, sweep_uid, unused_uid

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not (os.name == "posix" and os.geteuid() == 0
                                                        and os.path.isdir("/proc/sysvipc")),
                                                   reason="needs Linux and root (processes under other uids)")]


def start_as(uid, code):
    """A /usr/bin/python3-or-so process running `code` as uid (no groups), its stdout a pipe."""
    return subprocess.Popen([_python(uid), "-I", "-S", "-c", code], user=uid, group=uid, extra_groups=[], cwd="/",
                            env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)


def kill_all_of(uid):
    """SIGKILL every process of uid that /proc lists (the test's own clean-up, whatever the sweep under test did)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass


def test_unused_uid_is_a_fresh_high_uid():
    """Catches a uid picked from where accounts live (below 2**30: the program would get a real user's rights and
    files) or past 2**31 (not a valid uid_t for every tool), or one picked once and reused."""
    uids = {unused_uid() for _ in range(50)}
    assert len(uids) > 45
    assert all(2**30 <= uid < 2**31 for uid in uids)


def test_live_pids_sees_through_a_hostile_name_and_skips_zombies():
    """A process of the uid names itself "x) Z (y" (its /proc/<pid>/stat then reads "pid (x) Z (y) S ...") and leaves
    an unreaped child (a zombie): live_pids lists the process and not the zombie. Catches parsing stat at the first ")"
    (the program hides from the sweep by its name) and counting zombies as alive (the sweep would wait for them)."""
    uid = unused_uid()
    proc = start_as(uid, """
import ctypes, os, sys, time
libc = ctypes.CDLL(None)
libc.prctl(15, b"x) Z (y", 0, 0, 0)
child = libc.fork()
if child == 0:
    libc._exit(0)
time.sleep(0.2)
print(os.getpid(), child, flush=True)
time.sleep(30)
""")
    try:
        parent, zombie = map(int, proc.stdout.readline().split())
        assert live_pids(uid) == [parent]
        assert zombie not in live_pids(uid)
    finally:
        kill_all_of(uid)
        proc.wait()


STOPPER = """
import ctypes, os, time
libc = ctypes.CDLL(None)
for _ in range(3):
    if libc.fork() == 0:
        libc.setsid()
        time.sleep(30)
        libc._exit(0)
print("ready", flush=True)
while True:
    libc.kill(-1, 19)
"""


def test_sweep_without_cgroup_kills_a_uid_that_stops_its_helper():
    """A process of the uid loops kill(-1, SIGSTOP) (it stops every other process of the uid, the sweep's kill(-1)
    helper too) and has three sleeping children in sessions of their own; there is no cgroup. sweep_uid returns True
    at once and no process of the uid is left. Catches a sweep that relies on its helper alone (the helper is stopped
    before it kills anything: the processes outlive the sweep), that kills a pid without checking its owner the right
    way round, or that cannot run without a cgroup."""
    uid = unused_uid()
    proc = start_as(uid, STOPPER)
    try:
        assert proc.stdout.readline().strip() == "ready"
        start = time.monotonic()
        assert sweep_uid(uid, _python(uid), None, 3.0)
        assert time.monotonic() - start < 2.5
        assert live_pids(uid) == []
    finally:
        kill_all_of(uid)
        proc.wait()


def sysv_keys(kind):
    with open(f"/proc/sysvipc/{kind}") as f:
        return {int(line.split()[0]) for line in list(f)[1:] if line.strip()}


def test_remove_leftovers_takes_the_uids_files_and_ipc_only():
    """Files of the uid two world-writable directories below /tmp (like /tmp/.X11-unix/sub/) are removed; a file of
    another uid beside them, a file of the uid in a directory only root may write to, and root's SysV shared memory
    segment, semaphore set and message queue are kept; a link of the uid to another user's file is removed, the file kept. Catches a clean-up that looks at
    the top directory only (the program hides its files one level down), one that tests the owner the wrong way round
    (it would delete other users' files and IPC objects), or one that follows links (the uid's link would stay)."""
    uid, other = unused_uid(), unused_uid()
    top = f"/tmp/nanotrain-sweep-test-{secrets.token_hex(4)}"
    shared, private = os.path.join(top, "shared"), os.path.join(top, "private")
    key = 0x4E550000 + secrets.randbelow(2**16)
    libc = ctypes.CDLL(None, use_errno=True)
    ids = {"shm": libc.shmget(key, 4096, 0o1600), "sem": libc.semget(key, 1, 0o1600), "msg": libc.msgget(key, 0o1600)}
    try:
        assert min(ids.values()) >= 0, ctypes.get_errno()
        for d in (top, shared):
            os.mkdir(d)
            os.chmod(d, 0o1777)
        os.mkdir(private, 0o755)
        files = {}
        for name, where, owner in (("mine", shared, uid), ("theirs", shared, other), ("guarded", private, uid)):
            files[name] = os.path.join(where, name)
            with open(files[name], "w") as f:
                f.write(name)
            os.chown(files[name], owner, owner)
        link = os.path.join(shared, "link")  # the uid's link to a file of another user
        os.symlink(files["theirs"], link)
        os.lchown(link, uid, uid)
        remove_leftovers(uid)
        assert not os.path.exists(files["mine"]) and not os.path.lexists(link)
        assert os.path.exists(files["theirs"]) and os.path.exists(files["guarded"])
        assert all(key in sysv_keys(kind) for kind in ("shm", "sem", "msg"))
    finally:
        shutil.rmtree(top, ignore_errors=True)
        libc.shmctl(ids["shm"], 0, None)
        libc.semctl(ids["sem"], 0, 0)
        libc.msgctl(ids["msg"], 0, None)


def v1_cgroups_can_be_made():
    """Whether this process can make (and remove) a memory and a pids cgroup v1 with limits, judged without Cgroup."""
    if os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return False
    name, made = f"nanotrain-probe-{secrets.token_hex(4)}", []
    try:
        for ctl, limit in (("memory", "memory.limit_in_bytes"), ("pids", "pids.max")):
            made.append(os.path.join("/sys/fs/cgroup", ctl, name))
            os.mkdir(made[-1])
            with open(os.path.join(made[-1], limit), "w") as f:
                f.write(str(64 * 2**20 if ctl == "memory" else 5))
        return True
    except OSError:
        return False
    finally:
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                pass


def test_cgroup_limits_kill_and_removal():
    """A cgroup made for a program holds its memory and process limits, kill() ends a process put in it, and
    remove() leaves no directory behind. Catches limits written to the wrong file or not at all (the program's
    processes together would not be bounded), a kill that misses a process of the cgroup, and cgroups left over;
    and, where this test can make memory and pids cgroups itself (cgroup v1 here), a Cgroup.make that gives None."""
    cgroup = Cgroup.make(f"nanotrain-test-{secrets.token_hex(4)}", 64 * 2**20, 5)
    if cgroup is None:
        assert not v1_cgroups_can_be_made(), "cgroup v1 memory and pids cgroups can be made here, Cgroup.make gave None"
        pytest.skip("no cgroup can be made here")
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        values = {}
        for d in cgroup.dirs:
            for name in ("memory.max", "memory.limit_in_bytes", "pids.max"):
                if os.path.exists(os.path.join(d, name)):
                    with open(os.path.join(d, name)) as f:
                        values[name] = int(f.read())
        assert values.get("memory.max", values.get("memory.limit_in_bytes")) == 64 * 2**20
        assert values["pids.max"] == 5
        cgroup.add(sleeper.pid)
        cgroup.kill()
        assert sleeper.wait(timeout=2) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
        cgroup.remove()
    assert not any(os.path.exists(d) for d in cgroup.dirs)


UNIFIED = "/sys/fs/cgroup/unified"  # cgroup v2 beside v1 (hybrid): no controllers, but cgroup.kill


def test_cgroup_kill_through_cgroup_kill_on_v2():
    """On cgroup v2 a program's cgroup is killed through its cgroup.kill file, which reaches every process below it,
    in child cgroups too (and is atomic against fork); here a v2 cgroup made in the v2 hierarchy where the machine has
    one (hybrid or pure v2), with a process in a child cgroup of it. Catches a kill that misses the cgroup.kill file
    (or writes it wrongly) and falls back to the pids in cgroup.procs, which lists the cgroup's own processes only."""
    root = UNIFIED if os.path.exists(os.path.join(UNIFIED, "cgroup.procs")) else "/sys/fs/cgroup"
    if not os.path.exists(os.path.join(root, "cgroup.controllers")):
        pytest.skip("no cgroup v2 hierarchy here")
    d = os.path.join(root, f"nanotrain-test-{secrets.token_hex(4)}")
    try:
        os.mkdir(d)
    except OSError as e:
        pytest.skip(f"cannot make a v2 cgroup here: {e}")
    cgroup = Cgroup([d])
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        if not os.path.exists(os.path.join(d, "cgroup.kill")):
            pytest.skip("this kernel has no cgroup.kill (Linux < 5.14)")
        os.mkdir(os.path.join(d, "sub"))
        Cgroup([os.path.join(d, "sub")]).add(sleeper.pid)
        cgroup.kill()
        assert sleeper.wait(timeout=2) == -signal.SIGKILL
    finally:
        sleeper.kill()
        sleeper.wait()
        Cgroup([os.path.join(d, "sub")]).remove()
        cgroup.remove()
    assert not os.path.exists(d)


def test_cgroup_v2_without_controllers_is_no_cgroup(monkeypatch):
    """Where cgroup v2 is mounted but its memory and pids controllers are not delegated (here: the v2 hierarchy of a
    hybrid machine, taken as the cgroup root), Cgroup.make gives None and leaves no directory behind. Catches a cgroup
    handed out without its limits (the program would believe its processes bounded together) or one left over."""
    if not os.path.exists(os.path.join(UNIFIED, "cgroup.controllers")) or \
            os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        pytest.skip("needs a hybrid cgroup machine (v1 controllers, v2 at /sys/fs/cgroup/unified)")
    with open(os.path.join(UNIFIED, "cgroup.controllers")) as f:
        if "memory" in f.read().split():
            pytest.skip("this v2 hierarchy has the memory controller")
    import nanotrain.sandbox.sweep as sweep
    monkeypatch.setattr(sweep, "CGROUP_ROOT", UNIFIED)
    name = f"nanotrain-test-{secrets.token_hex(4)}"
    assert Cgroup.make(name, 64 * 2**20, 5) is None
    with open("/proc/self/cgroup") as f:
        mine = [line.split(":", 2)[2].strip() for line in f if line.startswith("0::")][0]
    assert not os.path.exists(os.path.join(UNIFIED, mine.lstrip("/"), name))
