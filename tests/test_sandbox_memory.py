"""
Memory a program run by nanotrain.sandbox.execution may take in all under bubblewrap: its private /tmp and /dev/shm are
bounded tmpfs, and its processes share one memory limit where a cgroup can be made.
"""

import os
import shutil

import pytest
from test_execution import LINUX, ROOT, as_non_root, bwrap_works_for_others, forking_children

from nanotrain.sandbox import execution
from nanotrain.sandbox.sweep import Cgroup

pytestmark = pytest.mark.unit

CHILDREN = forking_children(6, 60)

FILL_TMP = """
import os
written = 0
try:
    for i in range(64):
        with open(f"/tmp/fill{i}", "wb") as f:
            f.write(b"x" * (4 * 2**20))
        written += 4 * 2**20
except OSError:
    pass
print("written_mb", written // 2**20)
"""


@pytest.mark.parametrize("has_size", [True, False])
def test_bwrap_tmpfs_gets_the_memory_limit_where_bwrap_takes_size(monkeypatch, has_size):
    """
    The bwrap argv gives /tmp and /dev/shm `--size memory_bytes` right before each --tmpfs when the installed bwrap
    knows --size, and no --size otherwise (an old bwrap would refuse the option and run nothing). Catches an unbounded
    private /tmp (a RAM tmpfs took 1.5 GB in 0.7 s against 256 MiB) and --size placed after its --tmpfs (ignored).
    """
    monkeypatch.setattr(execution, "_bwrap_has_size", lambda: has_size)
    argv = execution._bwrap_argv("/work", "/usr/bin/python3", tmpfs_bytes=256 * 2**20)
    for mount in ("/tmp", "/dev/shm"):
        at = argv.index(mount, argv.index("--dev"))
        assert argv[at - 1] == "--tmpfs"
        assert (argv[at - 3:at - 1] == ["--size", str(256 * 2**20)]) == has_size
    assert ("--size" in argv) == has_size


@pytest.mark.skipif(not (LINUX and ROOT), reason="needs Linux and root (to make a cgroup here)")
def test_forked_children_share_one_limit_in_bwrap_mode(monkeypatch):
    """
    In bwrap mode, six forked children each touch 60 MB against memory_bytes of 128 MB: with a cgroup (made here as
    root; a non-root user gets one where the machine delegates it) they hold at most 128 MB (+ 32 MB slack) together.
    bwrap itself is left out (its argv emptied: the cgroup, not the namespaces, is what is under test). Catches bwrap
    mode bounding memory per process only (6 x 60 MB = 360 MB held).
    """
    probe = Cgroup.make("nanotrain-probe", 2**30, 4)
    if probe is None:
        pytest.skip("no cgroup can be made here")
    probe.remove()
    monkeypatch.setattr(execution, "isolation", lambda: "bwrap")
    monkeypatch.setattr(execution, "_bwrap_argv", lambda *a, **k: [])
    def ours():  # the bwrap-mode cgroups there are (another run's, or a killed one's, may be there already)
        return {(os.path.dirname(d), n) for d in probe.dirs for n in os.listdir(os.path.dirname(d))
                if n.startswith("nanotrain-exec-bwrap-")}
    before = ours()
    result = execution.run_program(CHILDREN, timeout_s=4, memory_bytes=128 * 2**20)
    assert "held_mb" in result.stdout, result
    assert int(result.stdout.split()[-1]) <= 128 + 32
    assert ours() <= before  # the program's cgroup is removed afterwards


@pytest.mark.skipif(not bwrap_works_for_others() or not shutil.which("bwrap"), reason="needs root, bwrap and "
                    "/usr/bin/python3 (a non-root user under bubblewrap)")
def test_filling_tmp_under_bwrap_stops_at_the_limit():
    """A program writing 4 MB files into /tmp under bwrap, memory_bytes 64 MB: it writes at most 64 MB (the tmpfs
    fills) where bwrap takes --size. Catches the unbounded tmpfs (all 256 MB written)."""
    if not execution._bwrap_has_size():
        pytest.skip("this bwrap has no --size (bubblewrap < 0.5.0): /tmp stays unbounded, as the docstring says")
    r, _, _ = as_non_root(FILL_TMP, path="/usr/bin:/bin", timeout_s=10, memory_bytes=64 * 2**20)
    assert r.get("isolation") == "bwrap", r
    assert int(r["stdout"].split()[-1]) <= 64, r
