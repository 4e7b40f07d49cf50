"""
base_train through the command line on a tiny config: training, checkpoints, resume, torchrun on gloo, error paths.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import REPO, TINY_TRAIN, run_script

pytestmark = pytest.mark.smoke


def metrics(base_dir, run):
    with open(os.path.join(base_dir, "base", run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(rows):
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_trains_evaluates_saves_and_samples(base_dir):
    """Loss falls, val bpb is finite and falls, a checkpoint reloads into a model that gives the logged bpb path."""
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=30", "--eval_every=15", "--run_name=t",
                   "--matrix_lr=0.05", base_dir=base_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = metrics(base_dir, "t")
    ls = losses(rows)
    assert sorted(ls) == list(range(1, 31))
    assert sum(ls[s] for s in range(26, 31)) / 5 < 0.8 * ls[1]
    bpb = [r["val_bpb"] for r in rows if "val_bpb" in r]
    assert len(bpb) == 3 and all(b == b and b < 100 for b in bpb) and bpb[-1] < bpb[0]
    assert "sample: 'The capital of France is' ->" in r.stdout
    assert "Gradient accumulation steps: 2" in r.stdout.replace("gradient", "Gradient")
    ckpt = os.path.join(base_dir, "base", "t", "checkpoints", "step_000030")
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert meta["step"] == 30 and meta["tokens_seen"] == 30 * 512 and meta["config"]["depth"] == 2
    from nanotrain.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(**meta["model_config"]))
    model.load_state_dict(torch.load(os.path.join(ckpt, "model.pt"), weights_only=True))
    s = run_script("sample.py", "--run_name=t", "--prompt=The", "--max_tokens=8", "--temperature=0", base_dir=base_dir)
    assert s.returncode == 0, s.stderr[-2000:]
    assert s.stdout.splitlines()[-1].startswith("The") or "\nThe" in s.stdout


@pytest.mark.slow  # the default tier checks the same at four moments: test_robustness.py, test_sigterm_at_any_moment
def test_resume_after_sigterm_continues_exactly(base_dir):
    """
    A run stopped by SIGTERM saves a checkpoint and exits 0; --resume=True continues at the next step and the
    losses of the remaining steps equal those of an uninterrupted run with ==. Catches a resume that restarts the
    data loader (other tokens), drops the optimizer state, or repeats/skips a step.
    """
    args = [*TINY_TRAIN, "--num_iterations=12"]
    straight = run_script("base_train.py", *args, "--run_name=straight", base_dir=base_dir)
    assert straight.returncode == 0, straight.stderr[-3000:]
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "base_train.py"), *args, "--run_name=cut"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith("step 00004/"):
            p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0, "".join(out)[-3000:]
    text = "".join(out)
    stopped = int(text.split("Stopped at step ")[1].split()[0])
    assert 4 <= stopped < 12
    resumed = run_script("base_train.py", *args, "--run_name=cut", "--resume=True", base_dir=base_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"step {stopped + 1:05d}/00012" in resumed.stdout
    assert f"step {stopped:05d}/00012 (" not in resumed.stdout  # no step is done twice
    a, b = losses(metrics(base_dir, "straight")), losses(metrics(base_dir, "cut"))
    assert sorted(b) == list(range(1, 13))
    assert all(a[s] == b[s] for s in range(1, 13)), (a, b)


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.slow  # the smoke matrix's base_train 2-rank cells check the same in the default run
def test_torchrun_two_ranks_gloo(base_dir):
    """2 ranks on gloo: identical parameters at the end (checksum all-gathered), one checkpoint written."""
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=4", "--run_name=ddp", base_dir=base_dir, nproc=2)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "parameters identical on all 2 ranks" in r.stdout
    assert "gradient accumulation steps: 1" in r.stdout
    ckpts = os.listdir(os.path.join(base_dir, "base", "ddp", "checkpoints"))
    assert ckpts == ["step_000004"]
    assert sorted(os.listdir(os.path.join(base_dir, "base", "ddp", "checkpoints", "step_000004"))) == [
        "meta.json", "model.pt", "optim.pt", "rank_00000.pt", "rank_00001.pt"]


@pytest.mark.parametrize("args,fragment", [
    (["--deptth=4"], "unknown setting --deptth (did you mean --depth?)"),
    (["--depth=4.5"], "--depth=4.5: expected int"),
    (["--total_batch_size=1000"], "--total_batch_size=1000 is not a multiple of device_batch_size * max_seq_len"),
    (["--data=fineweb-edu"], "--data=builtin"),
    (["--data=/nonexistent/dir"], "/nonexistent/dir"),
])
def test_error_paths_one_line_nonzero(base_dir, args, fragment):
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=2", *args, base_dir=base_dir,
                   env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode != 0
    err = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("Overriding: ")]
    assert len(err) == 1 and err[0].startswith("error: ") and fragment in err[0], r.stderr[-2000:]


def test_missing_tokenizer_names_the_command(tmp_path):
    r = run_script("base_train.py", *TINY_TRAIN, base_dir=tmp_path)
    assert r.returncode != 0
    err = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("Overriding: ")]
    assert "scripts/tok_train.py" in r.stderr and len(err) == 1, r.stderr


def test_help_by_path_under_torchrun():
    """`torchrun scripts/base_train.py --depth=20 --help` works from the repo root (the script runs by path)."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1",
                        "scripts/base_train.py", "--depth=20", "--help"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "--total_batch_size" in r.stdout and "tokens per optimizer step" in r.stdout


# A driver that runs a stage script in this process with an out-of-memory error injected into the training forward
# of micro-batches over 2 rows (from the script's second such forward on, not in the fake-tensor probes) and that
# records the target tokens each validation reads, one JSON line per evaluation in $STEPDOWN_LOG.
STEPDOWN_DRIVER = r"""
import json, os, runpy, sys
import torch
from torch._subclasses.fake_tensor import is_fake
import nanotrain.gpt as gpt
import nanotrain.loss_eval as loss_eval

real_eval, real_forward, calls = loss_eval.evaluate_bpb, gpt.GPT.forward, [0]

def counting_eval(model, batches, steps, *args, **kwargs):
    tokens = [0]
    def counted():
        for x, y in batches:
            tokens[0] += y.numel()
            yield x, y
    out = real_eval(model, counted(), steps, *args, **kwargs)
    with open(os.environ["STEPDOWN_LOG"], "a") as f:
        f.write(json.dumps({"tokens": tokens[0]}) + "\n")
    return out

def forward(self, idx, *args, **kwargs):
    if self.training and not is_fake(idx) and idx.size(0) > 2:
        calls[0] += 1
        if calls[0] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB (injected by the test)")
    return real_forward(self, idx, *args, **kwargs)

loss_eval.evaluate_bpb, gpt.GPT.forward = counting_eval, forward
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_validation_covers_eval_tokens_after_a_step_down(base_dir, tmp_path):
    """
    base_train with --auto_batch_size=True discovers device_batch_size 8 (8 rows a step: candidates 1, 2, 4, 8); its
    second step runs out of memory (injected) and steps down 8 -> 4 -> 2. Every validation, before and after the
    step-down, covers the same eval_tokens = 2048 target tokens (4 batches of 8 rows x 64, then 16 of 2 x 64).
    Catches the evaluation's batch count left at the discovered size while its rows shrink (512 tokens after the
    step-down: validations not comparable with the earlier ones).
    """
    log = tmp_path / "evals.jsonl"
    driver = tmp_path / "driver.py"
    driver.write_text(STEPDOWN_DRIVER)
    flags = [a for a in TINY_TRAIN if not a.startswith(("--device_batch_size", "--eval_every"))]
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", STEPDOWN_LOG=str(log))
    r = subprocess.run([sys.executable, str(driver), os.path.join(REPO, "scripts", "base_train.py"), *flags,
                        "--auto_batch_size=True", "--device_memory_gb=4", "--batch_size_cache=False",
                        "--num_iterations=4", "--eval_every=2", "--run_name=sd"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "Auto-discovery found device_batch_size=8" in r.stdout
    assert "stepping down to 4" in r.stdout and "stepping down to 2" in r.stdout
    record = json.load(open(os.path.join(base_dir, "base", "sd", "auto_batch_size.json")))
    assert record["step_downs"] == [[1, 8, 2]]
    assert [json.loads(line)["tokens"] for line in log.read_text().splitlines()] == [2048, 2048, 2048]


@pytest.mark.slow  # 2^20 validation tokens: minutes on 2 cores
def test_default_evaluation_size_suits_the_device_and_says_its_eta(base_dir):
    """
    Without --eval_tokens a CPU run evaluates 2^20 tokens (not nanochat's 20 x 2^19, sized for 8 GPUs: ~20 minutes on
    a CPU at depth 4), prints what each evaluation reads before the first one, and the first evaluation prints its
    ETA after its second batch; config.json records the size used. Catches the GPU default applied on a CPU, a size
    line that counts other tokens than the batches read, and an ETA that is never printed.
    """
    args = [a for a in TINY_TRAIN if not a.startswith(("--eval_tokens", "--max_seq_len", "--device_batch_size",
                                                        "--total_batch_size"))]
    r = run_script("base_train.py", *args, "--max_seq_len=512", "--device_batch_size=32", "--total_batch_size=16384",
                   "--num_iterations=1", "--run_name=ev", base_dir=base_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Validation: 1,048,576 tokens per evaluation (64 batches of 32 x 512), at the end" in r.stdout
    assert "val: 62 of 64 batches left, ETA " in r.stdout
    assert r.stdout.index("Validation: ") < r.stdout.index("val: 62 of 64") < r.stdout.index("val bpb")
    assert json.load(open(os.path.join(base_dir, "base", "ev", "config.json")))["eval_tokens"] == 2**20
