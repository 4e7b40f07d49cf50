"""scripts/bench.py with the optimizer step compiled (--compile_optimizer) and selective activation checkpointing:
the configurations the lead times on a quiet machine build and run (no timing is checked here)."""

import json

import pytest
from helpers import run_script

TINY = ["--depth=2", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=512", "--loader_seconds=0.2",
        "--tokenizer_chars=20000"]


@pytest.mark.smoke
@pytest.mark.slow  # inductor builds C++ on CPU (minutes here); the default run keeps test_optim.py's compiled step
def test_bench_vs_compiled_optimizer_and_selective(base_dir):
    """--vs="--compile_optimizer=True --activation_checkpointing=selective": B reports its optimizer step compiled
    (not the fallback: this machine has a C++ compiler) and selective checkpointing, A neither; both run their
    steps. Catches a setting that bench.py drops (B would time A's step)."""
    r = run_script("bench.py", *TINY, "--warmup_steps=1", "--pairs=1", "--pair_steps=1", "--memory_estimate=False",
                   "--vs=--compile_optimizer=True --activation_checkpointing=selective", base_dir=base_dir,
                   timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["a"]["config"]["compile_optimizer"] is False and out["b"]["config"]["compile_optimizer"] is True
    assert (out["a"]["config"]["activation_checkpointing"], out["b"]["config"]["activation_checkpointing"]) == (
        "none", "selective")
    assert out["a"]["step_time_s"]["n"] == out["b"]["step_time_s"]["n"] == 1
