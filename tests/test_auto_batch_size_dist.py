"""
Batch-size discovery under DDP on CPU: 2 gloo processes probe in lockstep (fake-tensor measurement of a tiny GPT)
and agree on every decision. Same budget -> the same size on both ranks as one process finds alone, and one cache
entry (written by rank 0 only, read by rank 0 and shared on the second call); a smaller budget on rank 1 -> its limit
wins on both ranks, under its own cache entry (the key holds every rank's budget); ranks whose keys differ -> rank 0's
cached size is probed again before it is used; an exception on one rank -> every rank raises and nobody hangs (the
test has a deadline), also when the other rank's probe did not fit; a process group of another size -> ValueError.
"""

import json
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port

from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.probe import GiB, measure_fake_peak
from nanotrain.auto_batch_size.search import discover_device_batch_size
from nanotrain.common import exit_process
from nanotrain.gpt import GPTConfig

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
WORLD = 2
DEADLINE_S = 240
CONFIG = GPTConfig(max_seq_len=32, vocab_size=256, n_layer=1, n_head=2, n_kv_head=2, model_dim=32)
ARGS = dict(max_seq_len=32, vocab_size=256, total_batch_size=32 * WORLD * 16, world_size=WORLD, device="cpu",
            amp_dtype=None, compile=False, key_fields={})


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


def worker(rank, port, out_dir, base_dirs, gb_big, gb_small, gb_tiny):
    # each rank has its own cache directory, as on two nodes: only rank 0's is read and written
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NANOTRAIN_BASE_DIR=base_dirs[rank])
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    quiet = lambda *a: None  # noqa: E731
    out = {}

    def failure(**kwargs):
        try:
            discover_device_batch_size(**{**ARGS, "build_probe": gpt_builder(CONFIG), "use_cache": False,
                                          "log": quiet, **kwargs})
            return "no exception"
        except Exception as exc:  # noqa: BLE001 - recorded for the parent
            return f"{type(exc).__name__}: {exc}"

    b, r = discover_device_batch_size(gpt_builder(CONFIG), device_memory_gb=gb_big, log=quiet, **ARGS)
    out["same"] = [b, r["cache_hit"], [p["batch_size"] for p in r["probes"]]]
    out["devices"] = [d["budget_bytes"] for d in r["cache_key"]["devices"]]
    b, r = discover_device_batch_size(gpt_builder(CONFIG), device_memory_gb=gb_big, log=quiet, **ARGS)
    out["same_again"] = [b, r["cache_hit"]]
    for name in ("small_rank1", "small_rank1_again"):
        b, r = discover_device_batch_size(gpt_builder(CONFIG), device_memory_gb=gb_small if rank == 1 else gb_big,
                                          log=quiet, **ARGS)
        out[name] = [b, r["cache_hit"], [p["result"] for p in r["probes"]]]
    out["small_rank1_devices"] = [d["budget_bytes"] for d in r["cache_key"]["devices"]]
    for name in ("keys_differ", "keys_differ_again"):  # rank 1 passes another key field: the keys differ
        b, r = discover_device_batch_size(gpt_builder(CONFIG), device_memory_gb=gb_big, log=quiet,
                                          **{**ARGS, "key_fields": {"rank_field": rank}})
        out[name] = [b, r["cache_hit"], [[p["batch_size"], p["phase"]] for p in r["probes"]]]
    out["failure"] = failure(build_probe=failing_builder(rank), device_memory_gb=gb_big)
    # rank 0's probe does not fit where rank 1's fails: rank 0 must still raise, not take it as 'does not fit'
    out["failure_vs_no_fit"] = failure(build_probe=failing_builder(rank), device_memory_gb=gb_tiny if rank == 0 else gb_big)
    out["world_size"] = failure(device_memory_gb=gb_big, world_size=2 * WORLD)
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works after the failures: no rank is stuck in a collective
    out["after"] = t.item()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    exit_process(0)  # destroys the group; a plain return can abort at exit (see nanotrain.common.exit_process)


def test_ranks_agree_smallest_device_wins_and_failures_do_not_hang(tmp_path, monkeypatch):
    """Catches: per-rank decisions (ranks ending with different sizes and mismatched micro-batch counts, then a hang
    in a collective), a MAX instead of MIN of 'fits' (the larger device would win and the smaller one OOM), only this
    rank's budget in the key, a cache written or read by every rank (rank 1's own directory must stay empty), a
    fake-path hit taken without checking that every rank has the same key, a failure on one rank read as 'does not
    fit' on the other (the ranks' probes fall out of step), an exception that leaves the other rank waiting in a
    collective, and a process group of another size than world_size accepted."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    build = gpt_builder(CONFIG)
    peaks = {b: measure_fake_peak(build, b, max_seq_len=32, vocab_size=256, world_size=WORLD) for b in (1, 2, 4, 8, 16)}
    gb_big = (peaks[8] + peaks[16]) / 2 / 0.85 / GiB  # 8 fits, 16 does not
    gb_small = (peaks[2] + peaks[4]) / 2 / 0.85 / GiB  # 2 fits, 4 does not
    gb_tiny = peaks[1] / 2 / 0.85 / GiB  # nothing fits
    # one process, the same world_size and budget: the answer the two ranks must agree on
    alone = {gb: discover_device_batch_size(build, device_memory_gb=gb, use_cache=False, log=lambda *a: None,
                                            **ARGS)[0] for gb in (gb_big, gb_small)}
    assert alone == {gb_big: 8, gb_small: 2}
    base_dirs = [str(tmp_path / f"base{r}") for r in range(WORLD)]
    ctx = mp.start_processes(worker, args=(free_port(), str(tmp_path), base_dirs, gb_big, gb_small, gb_tiny),
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
    assert r0["devices"] == r1["devices"] == [int(gb_big * GiB)] * 2
    assert r0["same_again"] == r1["same_again"] == [8, True]
    assert r0["small_rank1"][:2] == r1["small_rank1"][:2] == [2, False]
    assert "does not fit on another rank" in r0["small_rank1"][2]
    assert r0["small_rank1_again"] == r1["small_rank1_again"] == [2, True, []]
    assert r0["small_rank1_devices"] == r1["small_rank1_devices"] == [int(gb_big * GiB), int(gb_small * GiB)]
    assert r0["keys_differ"][:2] == r1["keys_differ"][:2] == [8, False]
    # rank 0's entry (its own key) is found, but rank 1's key differs: the size is probed once before it is used
    assert r0["keys_differ_again"] == r1["keys_differ_again"] == [8, True, [[8, "cache check"]]]
    assert len(os.listdir(os.path.join(base_dirs[0], "auto_batch_cache"))) == 3  # same, small_rank1, keys_differ
    assert not os.path.exists(os.path.join(base_dirs[1], "auto_batch_cache"))
    assert r1["failure"] == r1["failure_vs_no_fit"] == "ValueError: simulated failure on rank 1"
    for name in ("failure", "failure_vs_no_fit"):
        assert r0[name].startswith("RuntimeError: auto_batch_size: another rank failed while probing "
                                   "device_batch_size="), r0[name]
    assert r0["world_size"] == r1["world_size"] == "ValueError: world_size=4 but the process group has 2 ranks"
    assert r0["after"] == r1["after"] == 2.0
