"""Automatic device batch size through the command line on CPU (a simulated device budget): base_train, mid_train and
chat_sft with --auto_batch_size=True, and the settings of plan mode (scripts/auto_batch_plan.py)."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import REPO, TINY_TRAIN, run_script

pytestmark = pytest.mark.smoke
AUTO = [a for a in TINY_TRAIN if not a.startswith("--device_batch_size")] + [
    "--auto_batch_size=True", "--device_memory_gb=0.05", "--total_batch_size=4096", "--num_iterations=2"]


def found(stdout):
    m = re.findall(r"Auto-discovery found device_batch_size=(\d+) \| grad_accum_steps=(\d+) \| probes=(\d+) \| "
                   r"([\d.]+)s \| cache (hit|miss)", stdout)
    assert len(m) == 1, stdout[-3000:]
    b, accum, probes, secs, cache = m[0]
    return int(b), int(accum), int(probes), float(secs), cache


@pytest.mark.slow  # in the default run: discovery through base_train's flags, its record and training at the found
# size (test_base_train.py's step-down test); the found size's boundary and the cache hit in process
# (test_auto_batch_size.py: the brute-force sweep, the cache-hit log lines)
def test_discovery_trains_at_found_size_then_cache_hit(base_dir):
    """
    The first run discovers N (logged, recorded in the run directory) and trains at N with grad_accum = total/(N*T);
    the identical second run hits the cache in under a quarter of the first discovery's time.
    """
    r1 = run_script("base_train.py", *AUTO, "--run_name=a", base_dir=base_dir)
    assert r1.returncode == 0, r1.stderr[-3000:]
    b, accum, probes, secs, cache = found(r1.stdout)
    assert cache == "miss" and probes >= 1 and b * accum * 64 == 4096
    assert f"Tokens / micro-batch / rank: {b} x 64" in r1.stdout
    rec = json.load(open(os.path.join(base_dir, "base", "a", "auto_batch_size.json")))
    assert rec["device_batch_size"] == b and len(rec["probes"]) == probes
    fits = [p["batch_size"] for p in rec["probes"] if p["result"] == "fits"]
    over = [p["batch_size"] for p in rec["probes"] if p["result"] != "fits"]
    assert max(fits) == b and all(o > b for o in over)
    nxt = [c for c in rec["candidates"] if c > b]
    assert not nxt or min(nxt) in over  # the next larger candidate was measured and does not fit
    r2 = run_script("base_train.py", *AUTO, "--run_name=b", base_dir=base_dir)
    assert r2.returncode == 0, r2.stderr[-3000:]
    b2, _, _, secs2, cache2 = found(r2.stdout)
    assert (b2, cache2) == (b, "hit") and secs2 < secs / 4


@pytest.mark.slow  # for the default run's 8 minutes: the only end-to-end check of this flag precedence
def test_manual_device_batch_size_wins(base_dir):
    r = run_script("base_train.py", *AUTO, "--device_batch_size=2", "--run_name=m", base_dir=base_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--device_batch_size=2 given: skipping the automatic discovery" in r.stdout
    assert "Auto-discovery found" not in r.stdout and "Tokens / micro-batch / rank: 2 x 64" in r.stdout


@pytest.mark.dist
@pytest.mark.slow  # the ranks' agreement is in the default run in process: test_auto_batch_size_dist.py
@pytest.mark.timeout(300)
def test_torchrun_ranks_agree(base_dir):
    r = run_script("base_train.py", *AUTO, "--run_name=d", base_dir=base_dir, nproc=2)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    b, accum, _, _, _ = found(r.stdout)
    assert b * accum * 64 * 2 == 4096
    assert "parameters identical on all 2 ranks" in r.stdout


@pytest.mark.slow
def test_mid_train_and_chat_sft_accept_the_flags(base_dir):
    """mid_train discovers device_batch_size and chat_sft discovers max_tokens_per_device (rows of max_seq_len).
    Slow tier: ~16 s of three script runs; the discovery itself is base_train's, which the default run covers."""
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=2", "--run_name=src", base_dir=base_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    m = run_script("mid_train.py", "--base_run_name=src", "--run_name=src",
                   "--auto_batch_size=True", "--device_memory_gb=0.05", "--num_iterations=2", "--eval_every=-1",
                   base_dir=base_dir)
    assert m.returncode == 0, m.stderr[-3000:]
    b, accum, _, _, _ = found(m.stdout)
    assert b * accum * 64 == 512
    s = run_script("chat_sft.py", "--source_run_name=src", "--run_name=src", "--auto_batch_size=True",
                   "--device_memory_gb=0.05", "--num_iterations=2", "--eval_every=-1", "--examples_per_step=8",
                   base_dir=base_dir)
    assert s.returncode == 0, s.stderr[-3000:]
    rows, _, _, _, _ = found(s.stdout)
    assert f"max_tokens_per_device = {rows} x 64 = {rows * 64:,}" in s.stdout
    assert os.path.exists(os.path.join(base_dir, "sft", "src", "auto_batch_size.json"))


PLAN_SETTINGS = ["depth", "depths", "max_seq_len", "vocab_size", "total_batch_size", "device_memory_gb", "margin",
                 "world_size", "activation_checkpointing",  # the flags of plan mode's former argparse command line
                 "compile",  # the compiled step (base_train's CUDA default) or the eager one
                 "window_pattern", "short_window",  # the attention windows, planned on the backend training takes
                 "fp8", "fp8_recipe"]  # the float8 step (nanotrain/fp8.py)


def test_plan_script_help_lists_every_setting():
    """`python scripts/auto_batch_plan.py --help` exits 0 and lists exactly plan mode's settings, each with a comment.
    Catches: a setting read outside the configurator (an argparse flag, or a global assigned after configure()),
    which --help would not list and --name=value could not set, a renamed flag, and a --help that exits non-zero."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "auto_batch_plan.py"), "--help"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    listed = re.findall(r"^  --(\w+) += .*\S {2,}\S", out.stdout, re.M)
    assert listed == PLAN_SETTINGS, out.stdout
