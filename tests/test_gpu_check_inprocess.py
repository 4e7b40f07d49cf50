"""
Parts of the GPU check (scripts/gpu_check.py) run in this process: it ends a step's whole process tree (Check.run: a
worker that moved to a process session of its own, as torchrun's workers do, is ended whether the step exits or
times out); its environment report on CUDA (env_info, and nanotrain.report.card.system_info) against tests/cuda_standin.py.
"""

import importlib.util
import os
import signal
import sys
import time

import pytest
from cuda_standin import GiB, cuda_standin_fixture  # noqa: F401 - the fixture

pytestmark = pytest.mark.unit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a step whose worker leaves the step's session (os.setsid, like torchrun's start_new_session) and runs on; the step
# itself exits at once ("exit") or hangs past its timeout ("hang")
STEP = '''
import os, subprocess, sys, time
pidfile, mode = sys.argv[1], sys.argv[2]
subprocess.Popen([sys.executable, "-c", "import os, sys, time; os.setsid(); "
                  "open(sys.argv[1] + '.tmp', 'w').write(str(os.getpid())); os.replace(sys.argv[1] + '.tmp', sys.argv[1]); "
                  "time.sleep(300)", pidfile])
while not os.path.exists(pidfile):
    time.sleep(0.05)
if mode == "hang":
    time.sleep(300)
'''


def load_gpu_check(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py"])
    spec = importlib.util.spec_from_file_location("gpu_check_tree", os.path.join(REPO, "scripts", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def alive(pid):
    """True while `pid` runs (a zombie, killed and not yet reaped by init, counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="gpu_check finds a step's processes through /proc (Linux)")
@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_a_steps_detached_worker_is_ended(tmp_path, monkeypatch, mode):
    """A step leaves a grandchild in a session of its own, then exits (rc 0) or hangs past its 3 s timeout: after
    Check.run the grandchild is gone and recorded in killed_pids, the step's record says how it ended. Catches
    killpg of the step's own process group only (the grandchild, like a torchrun worker holding tens of GB of the
    card, runs on through the next steps), and a clean-up only on timeouts."""
    gpu_check = load_gpu_check(monkeypatch)
    chk = gpu_check.Check(str(tmp_path), str(tmp_path / "base"))
    pidfile = tmp_path / "grandchild.pid"
    t0 = time.time()
    try:
        rec = chk.run("detached", [sys.executable, "-c", STEP, str(pidfile), mode], 3)
        pid = int(pidfile.read_text())
        assert not alive(pid)
        assert pid in rec["killed_pids"]
        assert rec["timed_out"] == (mode == "hang") and rec["ok"] == (mode == "exit")
        assert time.time() - t0 < 30
    finally:
        if pidfile.exists() and alive(int(pidfile.read_text())):
            os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_marked_pids_finds_only_the_steps_processes(monkeypatch):
    """marked_pids finds the processes whose environment carries the step's marker, not this process nor others.
    Catches a marker matched as a substring of another marker or a search that returns every process."""
    import subprocess
    gpu_check = load_gpu_check(monkeypatch)
    env = dict(os.environ, GPU_CHECK_STEP="abc123")
    mine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             env=dict(os.environ, GPU_CHECK_STEP="abc1234"))
    try:
        deadline = time.time() + 10
        while gpu_check.marked_pids("abc123") != [mine.pid] and time.time() < deadline:
            time.sleep(0.05)
        assert gpu_check.marked_pids("abc123") == [mine.pid]
    finally:
        for p in (mine, other):
            p.kill()
            p.wait()


# ----------------------------------------------------------------------------- the environment report

def test_environment_report_on_cuda(cuda_standin, monkeypatch):
    """gpu_check's env step and the report's system line on a CUDA machine: the card's name, memory, capability and
    its datasheet bf16 peak (989.4 TFLOP/s for an H100 SXM). Catches a CUDA branch that reads the CPU's fields or a peak
    that is measured instead of looked up for a known card."""
    env = load_gpu_check(monkeypatch).env_info()
    assert env["cuda_available"] and env["device_count"] == 1 and env["device_name"] == "NVIDIA H100 80GB HBM3"
    assert env["total_memory_bytes"] == 8 * GiB and env["capability"] == [9, 0]
    assert env["bf16_peak_flops"] == 989.4e12
    assert env["bf16_peak_source"].startswith("NVIDIA H100 80GB HBM3: dense bf16 datasheet peak")
    from nanotrain.report.card import system_info
    assert system_info()["device"] == "1 x NVIDIA H100 80GB HBM3"
