"""
Batch-size discovery under DDP on CPU: 2 gloo processes probe in lockstep (fake-tensor measurement of a tiny GPT)
and agree on every decision. Same budget -> the same size on both ranks and one cache file (written by rank 0, read
and shared on the second call); a smaller budget on rank 1 -> its limit wins on both ranks, under its own cache entry
(the key holds every rank's budget); an exception on one rank -> every rank raises and nobody hangs (the test has a
deadline).
"""

import json
import os
import socket
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanotrain.auto_batch_size import discover_device_batch_size, gpt_builder
from nanotrain.common import exit_process
from nanotrain.gpt import GPTConfig
from nanotrain.memory import GiB, measure_fake_peak

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
WORLD = 2
DEADLINE_S = 240
CONFIG = GPTConfig(max_seq_len=32, vocab_size=256, n_layer=1, n_head=2, n_kv_head=2, model_dim=32)
ARGS = dict(max_seq_len=32, vocab_size=256, total_batch_size=32 * WORLD * 16, world_size=WORLD, device="cpu",
            amp_dtype=None, compile=False, key_fields={})


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def failing_builder(rank):
    """gpt_builder whose 2nd call raises on rank 1 (a probe failing on one rank only)."""
    build = gpt_builder(CONFIG)
    calls = []

    def build_probe(device):
        calls.append(device)
        if rank == 1 and len(calls) == 2:
            raise ValueError("simulated failure on rank 1")
        return build(device)
    return build_probe


def worker(rank, port, out_dir, base_dir, gb_big, gb_small):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NANOTRAIN_BASE_DIR=base_dir)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    quiet = lambda *a: None  # noqa: E731
    out = {}
    b, r = discover_device_batch_size(gpt_builder(CONFIG), device_memory_gb=gb_big, log=quiet, **ARGS)
    out["same"] = [b, r["cache_hit"], [p["batch_size"] for p in r["probes"]]]
    b, r = discover_device_batch_size(gpt_builder(CONFIG), device_memory_gb=gb_big, log=quiet, **ARGS)
    out["same_again"] = [b, r["cache_hit"]]
    for name in ("small_rank1", "small_rank1_again"):
        b, r = discover_device_batch_size(gpt_builder(CONFIG), device_memory_gb=gb_small if rank == 1 else gb_big,
                                          log=quiet, **ARGS)
        out[name] = [b, r["cache_hit"], [p["result"] for p in r["probes"]]]
    try:
        discover_device_batch_size(failing_builder(rank), device_memory_gb=gb_big, use_cache=False, log=quiet, **ARGS)
        out["failure"] = "no exception"
    except Exception as exc:  # noqa: BLE001 - recorded for the parent
        out["failure"] = f"{type(exc).__name__}: {exc}"
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works after the failure: no rank is stuck in a collective
    out["after"] = t.item()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    exit_process(0)  # destroys the group; a plain return can abort at exit (see nanotrain.common.exit_process)


def test_ranks_agree_smallest_device_wins_and_failures_do_not_hang(tmp_path, monkeypatch):
    """Catches: per-rank decisions (ranks ending with different sizes and mismatched micro-batch counts, then a hang
    in a collective), a MAX instead of MIN of 'fits' (the larger device would win and the smaller one OOM), and an
    exception that leaves the other rank waiting in a collective."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    build = gpt_builder(CONFIG)
    peaks = {b: measure_fake_peak(build, b, max_seq_len=32, vocab_size=256, world_size=WORLD) for b in (2, 4, 8, 16)}
    gb_big = (peaks[8] + peaks[16]) / 2 / 0.85 / GiB  # 8 fits, 16 does not
    gb_small = (peaks[2] + peaks[4]) / 2 / 0.85 / GiB  # 2 fits, 4 does not
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    ctx = mp.start_processes(worker, args=(free_port(), str(tmp_path), str(base_dir), gb_big, gb_small),
                             nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.time() + DEADLINE_S
    try:
        while not ctx.join(timeout=1):
            assert time.time() < deadline, "a rank hangs"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    r0, r1 = (json.load(open(tmp_path / f"rank{r}.json")) for r in range(WORLD))
    assert r0["same"] == r1["same"] and r0["same"][:2] == [8, False]
    assert r0["same_again"] == r1["same_again"] == [8, True]
    assert r0["small_rank1"][:2] == r1["small_rank1"][:2] == [2, False]
    assert "does not fit on another rank" in r0["small_rank1"][2]
    assert r0["small_rank1_again"] == r1["small_rank1_again"] == [2, True, []]
    assert len(os.listdir(base_dir / "auto_batch_cache")) == 2  # one entry per set of rank budgets
    assert r1["failure"] == "ValueError: simulated failure on rank 1"
    assert r0["failure"].startswith("RuntimeError: auto_batch_size: another rank failed")
    assert r0["after"] == r1["after"] == 2.0
