"""
Automatic device batch size: the largest per-device micro-batch (rows of max_seq_len tokens) whose training step fits
in memory on every rank, cached across runs (discover_device_batch_size), and the step-down when a later step runs
out of memory (OOMStepDown). Only grad_accum_steps moves: the candidates are the divisors of total_batch_size /
(max_seq_len * world_size), so the tokens per optimizer step never change. A size fits if its peak (measured by
nanotrain.memory) is at most margin * device memory on every rank; ranks agree on each decision in one all-reduce,
errors included, so no rank waits forever. The cache is one JSON file per key under <base_dir>/auto_batch_cache/.
"""

import gc
import hashlib
import inspect
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from nanotrain.common import (
    UserError,
    any_rank,
    atomic_write_json,
    get_base_dir,
    is_distributed,
    print0,
    rng_state,
    set_rng_state,
)
from nanotrain.fsdp import is_fsdp
from nanotrain.gpt import GPT
from nanotrain.memory import FakeProbe, GiB, RealProbe, device_memory_budget, is_oom_error

ALGORITHM_VERSION = 1  # bump when the probe recipe, the measurement or the search changes: old cache entries then miss
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


def next_smaller_candidate(candidates, batch_size):
    """The largest candidate strictly smaller than batch_size, or None: the step-down after an out-of-memory step
    (halving, as Composer's auto microbatching does, may break divisibility)."""
    return max((c for c in candidates if c < batch_size), default=None)


def gpt_builder(model_config, *, activation_checkpointing=False, **optimizer_kwargs):
    """
    A build_probe(device) -> (model, [adamw, muon]) for nanotrain.gpt.GPT: created directly on `device` (works under
    FakeTensorMode, unlike meta + to_empty), init_weights(), activation_checkpointing set as training sets it, fresh
    optimizers from setup_optimizers(**optimizer_kwargs); advances torch's global RNG. It carries `key_fields` (GPT
    config, activation checkpointing, optimizer arguments) for the cache key, so another model never hits its entry.
    """
    def build_probe(device):
        with torch.device(device):
            model = GPT(model_config)
        model.init_weights()
        model.activation_checkpointing = bool(activation_checkpointing)
        return model, model.setup_optimizers(**optimizer_kwargs)

    build_probe.key_fields = {"gpt_config": dict(vars(model_config)), "optimizer_kwargs": dict(optimizer_kwargs),
                              "activation_checkpointing": bool(activation_checkpointing)}
    return build_probe


class PackedRows(torch.nn.Module):
    """The memory shape chat_sft trains, for the probes: (B, T) rows as one packed row of B*T tokens in B segments
    (block-diagonal attention), or as B padded rows with packing=False."""

    def __init__(self, model, packing):
        super().__init__()
        self.model, self.packing = model, packing

    def forward(self, x, y):
        if not self.packing:
            return self.model(x, y)
        B, T = x.shape
        doc_ids = torch.arange(B, device=x.device).repeat_interleave(T).view(1, B * T)
        return self.model(x.reshape(1, B * T), y.reshape(1, B * T), doc_ids=doc_ids)


def sft_builder(model_config, packing, activation_checkpointing=False, **optimizer_kwargs):
    """build_probe(device) -> (PackedRows(GPT), [adamw, muon]) for chat_sft: gpt_builder's model wrapped in
    PackedRows; key_fields also hold `packing`."""
    build_gpt = gpt_builder(model_config, activation_checkpointing=activation_checkpointing, **optimizer_kwargs)

    def build_probe(device):
        model, optimizers = build_gpt(device)
        return PackedRows(model, packing), optimizers
    build_probe.key_fields = {**build_gpt.key_fields, "packing": packing}
    return build_probe


def code_fingerprint(build_probe):
    """sha256 (hex str) of the Python sources that decide the probe's memory: every .py file of the nanotrain package
    (model, optimizers, nanotrain.memory's probe step, the builders), of the top-level package defining build_probe
    and build_probe's own file. In the key, it makes the fake-path peak a pure function of the key."""
    files = set()

    def add_tree(root):
        for dirpath, _, names in os.walk(root):
            files.update(os.path.join(dirpath, n) for n in names if n.endswith(".py"))

    add_tree(os.path.dirname(os.path.abspath(__file__)))
    module = sys.modules.get(getattr(build_probe, "__module__", None) or "")
    package = (getattr(module, "__package__", None) or "").split(".")[0]
    if package and package in sys.modules and getattr(sys.modules[package], "__file__", None):
        add_tree(os.path.dirname(os.path.abspath(sys.modules[package].__file__)))
    try:
        source = inspect.getsourcefile(build_probe)
    except TypeError:  # a builtin or a callable object without source
        source = None
    if source and os.path.isfile(source):  # not for "<stdin>" or notebook cells
        files.add(os.path.abspath(source))
    digest = hashlib.sha256()
    for path in sorted(files):
        with open(path, "rb") as f:
            digest.update(os.path.relpath(path, os.path.dirname(path) + "/..").encode() + b"\0" + f.read())
    return digest.hexdigest()


def cache_key(*, key_fields, max_seq_len, vocab_size, amp_dtype, compile, devices, world_size, margin, candidates,
              code=None):
    """The cache key (a JSON-able dict) of these arguments (`devices`: every rank's device_memory_budget description;
    `code`: code_fingerprint(build_probe)), the torch version, the CUDA allocator settings (PYTORCH_CUDA_ALLOC_CONF,
    PYTORCH_ALLOC_CONF: they change fragmentation) and ALGORITHM_VERSION."""
    return {"algorithm_version": ALGORITHM_VERSION,
            "key_fields": json.loads(json.dumps(key_fields or {}, sort_keys=True, default=str)),
            "max_seq_len": max_seq_len, "vocab_size": vocab_size, "amp_dtype": str(amp_dtype), "compile": bool(compile),
            "devices": devices, "world_size": world_size, "torch": torch.__version__, "margin": margin,
            "candidates": list(candidates), "code": code,
            "alloc_conf": [os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), os.environ.get("PYTORCH_ALLOC_CONF", "")]}


def cache_path(key):
    """<base_dir>/auto_batch_cache/<sha256 of the canonical JSON of key>.json"""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return os.path.join(get_base_dir(), "auto_batch_cache", f"{digest}.json")


def check_probes(batch_size, probes, limit_bytes):
    """
    Raises ValueError (naming what is wrong) unless `probes` (a cache entry's list of dicts with batch_size,
    peak_bytes, result, phase) give batch_size as the answer of the phase that decided it ("compiled" if there are
    compiled probes, else "search"): in that phase batch_size was probed with result "fits", every "fits" probe peaks
    at most limit_bytes (bytes), batch_size is the largest size that fits and is below every size that does not.
    Returns None. Raises KeyError or TypeError for malformed probes.
    """
    phase = "compiled" if any(p["phase"] == "compiled" for p in probes) else "search"
    probes = [p for p in probes if p["phase"] == phase]
    fit = sorted(p["batch_size"] for p in probes if p["result"] == "fits")
    no_fit = sorted(p["batch_size"] for p in probes if p["result"] != "fits")
    if batch_size not in fit:
        raise ValueError(f"device_batch_size={batch_size} has no {phase} probe that fits")
    for p in probes:
        if p["result"] == "fits" and not p["peak_bytes"] <= limit_bytes:
            raise ValueError(f"its {phase} probe at device_batch_size={p['batch_size']} peaks at {p['peak_bytes']} "
                             f"bytes, over this run's limit of {int(limit_bytes)} bytes")
    if fit[-1] != batch_size or (no_fit and no_fit[0] <= batch_size):
        raise ValueError(f"device_batch_size={batch_size} is not the answer of its {phase} probes (fits: {fit}; does "
                         f"not fit: {no_fit})")


def read_cached(key, limit_bytes, log=print0):
    """
    The cached device batch size (int) for `key`, or None when there is no entry or it is ignored. limit_bytes: the
    largest margin * budget over the ranks, in bytes (a probe records the max peak over the ranks). A file that is not
    valid JSON, whose stored key differs from `key` (foreign or edited), whose size is not a candidate or whose probes
    do not give that size within limit_bytes (check_probes) is ignored with one warning line naming the file (and left
    to be replaced). Never raises for the file's contents.
    """
    path = cache_path(key)
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
        batch_size = entry["device_batch_size"]
        if entry["key"] != key:
            raise ValueError("its key does not match this run's key")
        if batch_size not in key["candidates"]:
            raise ValueError(f"device_batch_size={batch_size!r} is not a candidate")
        check_probes(batch_size, entry["probes"], limit_bytes)
        return int(batch_size)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log(f"auto_batch_size: warning: ignoring the cache file {path}: {type(exc).__name__}: {exc}")
        return None


def write_cached(key, batch_size, probes):
    """Writes the cache entry for `key` atomically (nanotrain.common.atomic_write_json). Returns the path."""
    path = cache_path(key)
    atomic_write_json(path, {"key": key, "device_batch_size": batch_size, "probes": probes, "written": time.time()})
    return path


def drop_cached(key):
    """Removes the cache entry for `key` (record["cache_key"]). Returns True if a file was removed."""
    try:
        os.remove(cache_path(key))
        return True
    except FileNotFoundError:
        return False


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
    (nanotrain.memory.probe_step) peaks at most margin * device memory on every rank. Call it on every rank before the
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
    ranks = dist.get_world_size() if is_distributed() else 1
    if ranks > 1 and ranks != world_size:
        raise ValueError(f"world_size={world_size} but the process group has {ranks} ranks")
    rank = dist.get_rank() if ranks > 1 else 0
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


class OOMStepDown:
    """Training steps at a discovered device_batch_size, stepping down when memory runs out. record: the record of
    discover_device_batch_size (reads "candidates", "cache_key"; gets "step_downs"); record_path: its JSON file (None:
    none); device_batch_size (int attribute): the micro-batch size in use now; log: print-like."""

    def __init__(self, record, record_path, device_batch_size, log=print0):
        self.record, self.record_path, self.device_batch_size, self.log = record, record_path, device_batch_size, log

    def forward_backward(self, model, inputs, targets, autocast_ctx, step):
        """
        nanotrain.training.forward_backward of inputs, targets (int64 (N, T), N a multiple of the candidates up to
        device_batch_size) at self.device_batch_size, except that if any rank runs out of memory, every rank zeroes the
        gradients, steps down to the next smaller candidate and redoes the step on the same rows in more micro-batches
        (same tokens, same result). Ranks agree after every micro-step (any_rank); under DDP the micro-steps skip DDP's
        sync and the gradients are averaged at the end instead. After a step-down, rank 0 drops the cache entry, every
        rank appends [step, old_size, new_size] to record["step_downs"], rank 0 rewrites record_path, and
        self.device_batch_size is the new size. Returns the mean loss over the N rows (detached 0-dim tensor).
        Raises UserError if the smallest candidate runs out of memory or the model is sharded with FSDP2 (a rank
        failing inside its all-gathers cannot leave the others); non-OOM errors propagate.
        """
        if is_fsdp(model):
            raise UserError("--fsdp=True: the out-of-memory step-down of --auto_batch_size is not available under FSDP "
                            "(collectives inside forward/backward); use forward_backward")
        is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        device = inputs.device
        micro_batch_size = self.device_batch_size
        while True:
            n_micro = inputs.size(0) // micro_batch_size
            loss_sum = torch.zeros((), device=device)
            oom = False
            for i in range(n_micro):
                rows = slice(i * micro_batch_size, (i + 1) * micro_batch_size)
                if is_ddp:
                    model.require_backward_grad_sync = False
                try:
                    with autocast_ctx:
                        loss = model(inputs[rows], targets[rows])
                    loss_sum += loss.detach()
                    (loss / n_micro).backward()
                except Exception as e:  # only OOM is recoverable; cleaned up below, outside the except block
                    if not is_oom_error(e):
                        raise
                    oom = True
                loss = None
                oom = any_rank(oom, device)  # every rank redoes the step if one ran out of memory
                if oom:
                    break
            if not oom:
                break
            model.zero_grad(set_to_none=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            smaller = next_smaller_candidate(self.record["candidates"], micro_batch_size)
            if smaller is None:
                raise UserError(f"out of memory at device_batch_size={micro_batch_size}, the smallest candidate; use "
                                f"a smaller --max_seq_len or a smaller model")
            self.log(f"out of memory at device_batch_size={micro_batch_size}: stepping down to {smaller} "
                     f"(grad_accum_steps {n_micro} -> {inputs.size(0) // smaller}) and redoing this step")
            micro_batch_size = smaller
        if is_ddp:  # the sync DDP skipped: one all-reduce per gradient, then the mean
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            for h in [dist.all_reduce(g, async_op=True) for g in grads]:
                h.wait()
            torch._foreach_div_(grads, dist.get_world_size())
        if micro_batch_size != self.device_batch_size:
            self.record.setdefault("step_downs", []).append([step, self.device_batch_size, micro_batch_size])
            self.device_batch_size = micro_batch_size
            if not is_distributed() or dist.get_rank() == 0:
                drop_cached(self.record["cache_key"])
                if self.record_path is not None:
                    atomic_write_json(self.record_path, self.record)
        return loss_sum / n_micro
