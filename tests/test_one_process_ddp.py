"""
One process is not wrapped in DistributedDataParallel (nanotrain.training.wrap_ddp): base_train under a one-process torchrun (the GPU check's
depth-20 step) trains the bare model, eager (default tier) and compiled (slow tier: torch.compile on CPU). A
sitecustomize in the workers records every DistributedDataParallel construction.
"""

import os
import sys

import pytest
import torch
from helpers import REPO, TINY_TRAIN, tiny_model

from nanotrain.training import wrap_ddp

SITECUSTOMIZE = '''
import os
if "RANK" in os.environ:  # a torchrun worker: record that this ran, and every DDP wrapper built
    import torch.nn.parallel
    _record = os.environ["DDP_RECORD"]
    with open(_record, "a") as f:
        f.write(f"worker {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\\n")
    _init = torch.nn.parallel.DistributedDataParallel.__init__
    def _recording_init(self, *args, **kwargs):
        with open(_record, "a") as f:
            f.write("DistributedDataParallel\\n")
        _init(self, *args, **kwargs)
    torch.nn.parallel.DistributedDataParallel.__init__ = _recording_init
'''


def torchrun_base_train(tmp_path, base_dir, nproc, *args, timeout):
    """base_train through torchrun --standalone with nproc workers (gloo); returns (CompletedProcess, record lines)."""
    import subprocess
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    record = tmp_path / "ddp_record.txt"
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               DDP_RECORD=str(record),
               PYTHONPATH=os.pathsep.join(p for p in (str(site), REPO, os.environ.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1",
           f"--nproc_per_node={nproc}", os.path.join(REPO, "scripts", "base_train.py"), *TINY_TRAIN, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    return r, record.read_text().splitlines() if record.exists() else []


@pytest.mark.smoke
def test_one_process_under_torchrun_trains_the_bare_model(tmp_path, base_dir):
    """torchrun --nproc_per_node=1 base_train: the worker ran (RANK set, world size 1) and built no
    DistributedDataParallel. Catches `if is_ddp: model = DDP(model)` (true under torchrun whatever the world size):
    gradient buckets the batch-size probes never measured, and a compiled graph split at bucket boundaries."""
    r, record = torchrun_base_train(tmp_path, base_dir, 1, "--num_iterations=2", "--run_name=one", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert record == ["worker 0 of 1"]


@pytest.mark.smoke
@pytest.mark.slow
def test_one_process_under_torchrun_compiled(tmp_path, base_dir):
    """The same with --compile=True on CPU (minutes of inductor): the compiled model trains unwrapped, the loss is
    finite. Catches a DDP wrapper around the compiled model of one process (DDPOptimizer's graph split), and a
    compile path that fails under torchrun."""
    r, record = torchrun_base_train(tmp_path, base_dir, 1, "--num_iterations=3", "--compile=True",
                                    "--run_name=one_compiled", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "worker 0 of 1" in record and "DistributedDataParallel" not in record  # inductor's workers record too
    assert "nan" not in r.stdout.lower()


@pytest.mark.unit
def test_training_wraps_in_ddp_only_for_more_than_one_process(one_rank_mesh):
    """training.wrap_ddp: the model itself for world size 1, a DistributedDataParallel for 2 (gloo). Catches one
    process wrapped in DDP (its gradient buckets unmeasured by the probes, a compiled graph split at bucket
    boundaries) and several processes left unwrapped (gradients never averaged)."""
    model = tiny_model()
    assert wrap_ddp(model, torch.device("cpu"), 1) is model
    wrapped = wrap_ddp(model, torch.device("cpu"), 2)
    assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and wrapped.module is model
    assert wrapped.device_ids is None
