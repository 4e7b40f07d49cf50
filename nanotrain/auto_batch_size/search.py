"""
Automatic device batch size: the largest per-device micro-batch (rows of max_seq_len tokens) whose training step fits
in memory on every rank (discover_device_batch_size), cached across runs (nanotrain.auto_batch_size.cache). Only
grad_accum_steps moves: the candidates are the divisors of total_batch_size / (max_seq_len * world_size), so the tokens
per optimizer step never change. A size fits if its peak (measured by nanotrain.auto_batch_size.probe) is at most margin *
device memory on every rank; ranks agree on each decision in one all-reduce, errors included, so no rank waits
forever. A later out-of-memory step steps down (nanotrain.auto_batch_size.stepdown).
"""

import math
import os
import time

import torch
import torch.distributed as dist

from nanotrain.auto_batch_size.cache import (
    ALGORITHM_VERSION,
    cache_key,
    cache_path,
    code_fingerprint,
    drop_cached,
    read_cached,
    write_cached,
)
from nanotrain.auto_batch_size.probe import FakeProbe, GiB, RealProbe, device_memory_budget
from nanotrain.common import atomic_write_json, is_distributed, print0, rank_world, rng_state, set_rng_state
from nanotrain.errors import UserError

DEFAULT_MARGIN = 0.85  # fraction of the device memory the training step may use
MAX_COMPILED_PROBES = 3  # compiled probes per discovery (each is a recompile; torch._dynamo's recompile_limit is 8)


def candidate_batch_sizes(total_batch_size, max_seq_len, world_size, max_batch_size=None):
    """
    The device batch sizes (rows per micro-batch per rank) that keep grad_accum_steps a whole number >= 1 (nanochat's
    total_batch_size % (device_batch_size * max_seq_len * world_size) == 0): the divisors of total_batch_size /
    (max_seq_len * world_size), capped at max_batch_size (None: no cap). Returns list[int], ascending. Raises
    UserError (naming the flags and the arithmetic) if that is not a positive whole number or no candidate is left.
    """
    if min(total_batch_size, max_seq_len, world_size) < 1:
        raise UserError(f"--total_batch_size={total_batch_size}, --max_seq_len={max_seq_len} and world_size="
                        f"{world_size} must be positive")
    tokens_per_row = max_seq_len * world_size
    if total_batch_size % tokens_per_row != 0:
        raise UserError(f"--total_batch_size={total_batch_size} is not a multiple of max_seq_len * world_size = "
                        f"{max_seq_len} * {world_size} = {tokens_per_row} (remainder {total_batch_size % tokens_per_row}"
                        f"), so no device_batch_size gives a whole number of gradient accumulation steps")
    n = total_batch_size // tokens_per_row
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    divisors = sorted(set(small + [n // d for d in small]))
    if max_batch_size is not None:
        divisors = [d for d in divisors if d <= max_batch_size]
        if not divisors:
            raise UserError(f"--max_batch_size={max_batch_size} leaves no candidate device_batch_size (expected >= 1)")
    return divisors


def search_batch_size(fits, candidates, start_index=None):
    """
    The largest candidate for which fits(candidate) (int -> bool) is True, assuming that if B fits every smaller one
    does: bisection over `candidates` (ascending distinct positive ints), or first `start_index` (a predicted index)
    and its neighbour. Calls fits at most ceil(log2(len(candidates))) + 2 times, never twice on one size. Raises
    UserError if not even the smallest candidate fits; ValueError for bad candidates.
    """
    cands = list(candidates)
    if not cands or any(c < 1 for c in cands) or any(a >= b for a, b in zip(cands, cands[1:])):
        raise ValueError(f"candidates must be ascending distinct positive ints, got {cands}")
    lo, hi = -1, len(cands)

    def probe(i):
        nonlocal lo, hi
        if fits(cands[i]):
            lo = i
        else:
            hi = i

    if start_index is not None:
        p = min(max(int(start_index), 0), len(cands) - 1)
        probe(p)
        neighbour = p + 1 if lo == p else p - 1
        if lo < neighbour < hi:
            probe(neighbour)
    while hi - lo > 1:
        probe((lo + hi) // 2)
    if lo < 0:
        raise UserError(f"no device_batch_size fits in memory: not even the smallest candidate, {cands[0]}; use a "
                        f"larger --device_memory_gb (CPU/MPS budget), a smaller --max_seq_len, a smaller model, or "
                        f"activation checkpointing")
    return cands[lo]


def _reduce_max(values, device):
    """Element-wise MAX of a list of floats over the ranks in one all-reduce (the values themselves on one rank)."""
    if not (is_distributed() and dist.get_world_size() > 1):
        return list(values)
    flag_device = torch.device("cpu") if "gloo" in str(dist.get_backend()) else device
    t = torch.tensor(values, dtype=torch.float64, device=flag_device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _agree(fn, device, what):
    """Runs fn() on every rank. If it raises anywhere, every rank raises after one all_reduce (the failing rank its
    own exception, the others a RuntimeError), so nobody waits forever in a later collective."""
    error, value = None, None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below
        error = exc
    (failed,) = _reduce_max([1.0 if error is not None else 0.0], device)
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"auto_batch_size: another rank failed while {what}; see its traceback")
    return value


def _refine_compiled(fits_compiled, candidates, batch_size, max_probes=MAX_COMPILED_PROBES):
    """
    The compiled step of the eager search's `batch_size` usually needs less memory (inductor fuses the fp32 soft-cap
    and cross-entropy of the head), sometimes more: verify it with fits_compiled(B) -> bool, step down one candidate
    on failure, else step up while the larger ones fit, in at most max_probes probes (each is a recompile). Returns
    the largest compiled-verified size; raises UserError if no probed size fits.
    """
    i = candidates.index(batch_size)
    probes = 0
    while probes < max_probes and i >= 0:
        probes += 1
        if fits_compiled(candidates[i]):
            break
        i -= 1
    else:
        raise UserError(f"the compiled model does not fit at device_batch_size <= {batch_size} (checked {probes} sizes; "
                        f"the eager step does fit); run with --compile=False or a smaller --max_batch_size")
    best = candidates[i]
    while best == batch_size and probes < max_probes and i + 1 < len(candidates):
        probes += 1
        if not fits_compiled(candidates[i + 1]):
            break
        i += 1
        best = batch_size = candidates[i]
    return best


def discover_device_batch_size(build_probe, *, max_seq_len, vocab_size, total_batch_size, world_size, device,
                               amp_dtype=None, compile=False, margin=DEFAULT_MARGIN, device_memory_gb=None,
                               max_batch_size=None, use_cache=True, key_fields, probe=None, log=print0,
                               record_path=None):
    """
    The largest candidate_batch_sizes(total_batch_size, max_seq_len, world_size, max_batch_size) whose training step
    (nanotrain.auto_batch_size.probe.probe_step) peaks at most margin * device memory on every rank. Call it on every rank before the
    training model is built; result and record are the same on all ranks; RNG states are restored.
    build_probe(device) -> (model, optimizers) as training uses them (gpt_builder, sft_builder): on CPU/MPS called per
    probe under FakeTensorMode; on CUDA once, probed for real, then its parameters restored and optimizer state
    cleared. amp_dtype: training's compute dtype (torch.bfloat16: autocast; torch.float32 or None: none). compile: on
    CUDA, compiled probes verify (and may raise) the eager search's size; elsewhere it is only in the cache key.
    margin: a fraction of the bytes.
    device_memory_gb: the budget in GiB (CPU/MPS; on CUDA an emulated smaller device). key_fields: JSON-able facts
    that change memory, merged with build_probe.key_fields. probe: "fake" | "real" | None (real on CUDA only).
    log: print-like; one line per probe, then `Auto-discovery found device_batch_size=N | grad_accum_steps=... |
    probes=... | ...s | cache hit/miss`. record_path: rank 0 writes the record there (JSON).
    Returns (batch_size, record): a JSON-able dict of device_batch_size, grad_accum_steps, candidates, budget_bytes,
    limit_bytes, margin, device, measurement, probes (batch_size, peak_bytes, result, seconds, phase), cache_hit,
    cache_key, cache_path, seconds, algorithm_version. Raises UserError when nothing fits or for bad arguments; a
    non-OOM error of a probe propagates on its rank and a RuntimeError is raised on the others.
    """
    t_start = time.perf_counter()
    device = torch.device(device)
    if not 0 < margin <= 1:
        raise UserError(f"--batch_size_margin={margin}: expected a fraction in (0, 1]")
    rank, ranks = rank_world()
    if ranks > 1 and ranks != world_size:
        raise ValueError(f"world_size={world_size} but the process group has {ranks} ranks")
    probe = probe or ("real" if device.type == "cuda" else "fake")
    if probe not in ("fake", "real"):
        raise ValueError(f"probe={probe!r}: expected 'fake', 'real' or None")
    amp_dtype = None if amp_dtype == torch.float32 else amp_dtype  # fp32: no autocast, the same cache key as None
    candidates = candidate_batch_sizes(total_batch_size, max_seq_len, world_size, max_batch_size)
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    budget, device_description = device_memory_budget(device, device_memory_gb, local_world_size)
    limit = margin * budget
    key_fields = {**getattr(build_probe, "key_fields", {}), **key_fields}
    devices = [device_description]
    if ranks > 1:  # every rank's device (or budget) is part of the key: the smallest decides the size
        devices = [None] * world_size
        dist.all_gather_object(devices, device_description)
    key = cache_key(key_fields=key_fields, max_seq_len=max_seq_len, vocab_size=vocab_size, amp_dtype=amp_dtype,
                    compile=compile, devices=devices, world_size=world_size, margin=margin, candidates=candidates,
                    code=code_fingerprint(build_probe))
    compiled_checks = bool(compile) and probe == "real" and device.type == "cuda"
    if probe == "real":
        fraction = limit / device_description["total_memory"] if device.type == "cuda" else None
        prober = RealProbe(build_probe, device, max_seq_len, vocab_size, amp_dtype, world_size, fraction, log)
    else:
        prober = FakeProbe(build_probe, device, max_seq_len, vocab_size, amp_dtype, world_size)
    record = {"device_batch_size": None, "grad_accum_steps": None, "candidates": candidates, "budget_bytes": budget,
              "limit_bytes": int(limit), "margin": margin, "device": device_description, "measurement": prober.kind,
              "probes": [], "cache_hit": False, "cache_key": key, "cache_path": None, "seconds": None,
              "algorithm_version": ALGORITHM_VERSION}
    where = device_description.get("name") or device_description.get("source")
    log(f"auto_batch_size: candidates {candidates} | budget {budget / GiB:.2f} GiB ({where}) | "
        f"limit {margin:g} x budget = {limit / GiB:.2f} GiB | measurement: {prober.kind}")

    def fits(batch_size, phase, compiled=False):
        t0 = time.perf_counter()
        error, peak, result = None, 0, "error"
        try:
            peak, oom, thrash = prober.measure(batch_size, compiled)
            result = "OOM" if oom else "thrash" if thrash else "over budget" if peak > limit else "fits"
        except Exception as exc:  # noqa: BLE001 - re-raised after the other ranks know
            error = exc
        bad, peak = _reduce_max([1.0 if error is not None else 0.0 if result == "fits" else 0.5, float(peak)], device)
        if error is not None:
            raise error
        if bad == 1.0:
            raise RuntimeError(f"auto_batch_size: another rank failed while probing device_batch_size={batch_size}; "
                               f"see its traceback")
        ok = bad == 0.0
        if not ok and result == "fits":
            result = "does not fit on another rank"
        seconds = time.perf_counter() - t0
        record["probes"].append({"batch_size": batch_size, "peak_bytes": int(peak), "result": result,
                                 "seconds": round(seconds, 3), "phase": phase})
        log(f"auto_batch_size: probe device_batch_size={batch_size} ({phase}) | {result} | peak {peak / GiB:.3f} GiB"
            f"{' (max over ranks)' if ranks > 1 else ''} = {100 * peak / budget:.1f}% of budget | {seconds:.2f}s")
        return ok

    saved_rng = rng_state(device)
    batch_size, hit = None, False
    try:
        _agree(prober.__enter__, device, "building the model for batch-size discovery")
        limit_any_rank = margin * max(d["budget_bytes"] for d in devices)
        cached = _agree(lambda: read_cached(key, limit_any_rank, log) if use_cache and rank == 0 else None, device,
                        "reading the batch-size cache")
        # rank 0's cached size goes to every rank; a fake-path hit also needs the same key on every rank
        digest = float(int(os.path.basename(cache_path(key))[:13], 16))  # 52 bits: exact in float64
        cached, high, neg_low = _reduce_max([float(cached or 0), digest, -digest], device)
        cached, same_key_everywhere = int(cached), high == -neg_low
        if cached and probe == "fake" and same_key_everywhere:
            # the fake measurement is a pure function of the key (code fingerprint included): nothing to re-measure
            batch_size, hit = cached, True
            log(f"auto_batch_size: cache hit device_batch_size={cached}, verified by the code fingerprint and its probes")
        elif cached:
            if fits(cached, "cache check", compiled=compiled_checks):
                batch_size, hit = cached, True
            else:
                log(f"auto_batch_size: the cached device_batch_size={cached} no longer fits; dropping the entry")
                if rank == 0:
                    drop_cached(key)
        if batch_size is None:
            try:
                batch_size = search_batch_size(lambda b: fits(b, "search"), candidates)
            except UserError:
                smallest = [p for p in record["probes"] if p["batch_size"] == candidates[0]][-1]
                raise UserError(f"no device_batch_size fits in memory: the smallest candidate, {candidates[0]}, "
                                f"peaks at {smallest['peak_bytes'] / GiB:.2f} GiB ({smallest['result']}) but the "
                                f"limit is {margin:g} x {budget / GiB:.2f} GiB = {limit / GiB:.2f} GiB; use a larger "
                                f"--device_memory_gb (CPU/MPS budget), a smaller --max_seq_len, a smaller model or "
                                f"activation checkpointing") from None
            if compiled_checks:
                batch_size = _refine_compiled(lambda b: fits(b, "compiled", compiled=True), candidates, batch_size)
    finally:
        try:
            prober.__exit__(None, None, None)
        finally:
            set_rng_state(saved_rng, device)
    if use_cache and rank == 0 and not hit:
        record["cache_path"] = write_cached(key, batch_size, record["probes"])
    elif use_cache:
        record["cache_path"] = cache_path(key)
    seconds = time.perf_counter() - t_start
    grad_accum_steps = total_batch_size // (batch_size * max_seq_len * world_size)
    record.update(device_batch_size=batch_size, grad_accum_steps=grad_accum_steps, cache_hit=hit,
                  seconds=round(seconds, 3))
    log(f"Auto-discovery found device_batch_size={batch_size} | grad_accum_steps={grad_accum_steps} | "
        f"probes={len(record['probes'])} | {seconds:.2f}s | cache {'hit' if hit else 'miss'}")
    if record_path is not None and rank == 0:
        atomic_write_json(record_path, record)
    return batch_size, record
