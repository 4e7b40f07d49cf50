"""
Automatic device batch size: the largest per-device micro-batch (rows of max_seq_len tokens) whose training step fits
in memory, found quickly, the same on every rank, cached across runs. Only grad_accum_steps moves: the candidates are
the divisors of total_batch_size / (max_seq_len * world_size), so the tokens per optimizer step never change.

How (design notes and pitfalls P1-P12: shared/reference/autobatch.md; the issue: "Automatic device batch size"):
- Candidates, not integers (nanochat #532 crashed on sizes that break divisibility). Binary search over the sorted
  candidate list, at most ceil(log2(n)) + 2 probes; exact under monotonicity. Lightning's BatchSizeFinder
  ('binsearch') and the seed design gallop 1, 2, 4, ... over integers first, which needs ~2*log2(n) probes on a
  long list (the counter-example is in the tests).
- Margin in bytes (OTX's memory band, Ludwig PR #3958's temporary ceiling): a probe fits only if its peak is at most
  margin * device memory. Lightning 2.6 scales the found batch by (1 - margin) instead, which halves power-of-two
  sizes (32 * 0.85 -> 27 -> 16).
- The probe is the real training step (torchtitan's "iter 0 does not have optimizer state"; +31 % measured in the
  reference): 2 micro-steps (forward + backward of loss/2), grad clipping, one step of every optimizer (so the lazily
  created AdamW/Muon state exists), zero_grad(set_to_none=True), one more micro-step. Synthetic tokens from a local
  torch.Generator; the data loader is never touched.
- CUDA: real probes (Accelerate's find_executable_batch_size / Composer's auto microbatching catch the OOM), with
  torch.cuda.set_per_process_memory_fraction(margin) during discovery, the peak from max_memory_reserved, the
  allocator's num_alloc_retries as a thrash signal (Composer), clean-up outside the except block (pytorch #18853),
  uncompiled search then compiled verification (Composer #2214: a recompile per probe is slow and counts towards
  torch._dynamo's recompile_limit of 8).
- CPU and MPS: the OS kills the process instead of raising (torch-max-mem), so device memory is a budget
  (--device_memory_gb, default CPU_MEMORY_FRACTION of MemAvailable per local rank) and each probe measures the peak
  bytes of the step WITHOUT allocating them: the model is built under FakeTensorMode and the step runs under
  torch.distributed._tools.mem_tracker.MemTracker (torchtitan scripts/estimate/estimation.py does the same for FSDP).
  Measured on this CPU (torch 2.13): the fake peak equals MemTracker's peak on a real CPU run of the same step to the
  byte, and the process RSS high-water mark of the real step exceeded it by 8-14 % (depth 2, B=16, T=128, V=8192:
  +13 % with 2 threads, +8 % with 1; depth 4, B=32, T=256: +14 %; fp32), i.e. malloc and kernel scratch overhead
  that the default 0.85 margin (1/0.85 = +18 %) absorbs.
- DDP: all ranks probe in lockstep (they probe their own device) and each decision is one all_reduce over the default
  group of (status, peak): a size fits only if it fits on every rank, so the smallest device wins. An exception on one
  rank is announced through the same all_reduce before it is raised, so no rank waits forever (Lightning refuses DDP;
  lm-eval #1743 hangs). DDP's gradient buckets (a flat copy of the gradients, gradient_as_bucket_view=False) are added
  analytically so that no collective runs inside a probe.
- torch.compile (CUDA): the search runs eager; then compiled probes verify the size, step down on failure, and step up
  while the compiled step fits (at most MAX_COMPILED_PROBES recompiles): inductor fuses the fp32 soft-cap and
  cross-entropy chain that dominates the eager peak of nanochat's head, so the compiled step often fits a larger size.
- Cache: one JSON file per key under <base_dir>/auto_batch_cache/ (toma caches per call site and free memory; our key
  is richer), written atomically by rank 0. A hit is verified before use: by one probe at the cached size on real
  devices; on the fake path by the code fingerprint in the key (the fake measurement is a pure function of the key).

Public API: candidate_batch_sizes, search_batch_size, next_smaller_candidate, is_oom_error, probe_step,
measure_fake_peak, device_memory_budget, gpt_builder, cache_key, cache_path, drop_cached, discover_device_batch_size,
and plan mode: python -m nanotrain.auto_batch_size --depths=12,20,26,32 --device_memory_gb=80
"""

import argparse
import contextlib
import gc
import hashlib
import inspect
import io
import json
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from nanotrain.common import UserError, atomic_write_json, get_base_dir, print0

ALGORITHM_VERSION = 1  # bump when the probe recipe, the measurement or the search changes: old cache entries then miss
DEFAULT_MARGIN = 0.85  # fraction of the device memory the training step may use
CPU_MEMORY_FRACTION = 0.5  # default CPU/MPS budget: this fraction of MemAvailable, split among the local ranks
MAX_COMPILED_PROBES = 3  # compiled probes per discovery (each is a recompile; torch._dynamo's recompile_limit is 8)
GiB = 2**30
MiB = 2**20

# Out-of-memory messages, matched as substrings of str(exc) for RuntimeError and its subclasses (torch.OutOfMemoryError
# and torch.AcceleratorError both subclass RuntimeError in torch 2.13). (marker, where the string comes from)
OOM_MESSAGES = (
    ("CUDA out of memory.", "pytorch c10/cuda/CUDACachingAllocator.cpp (TORCH_CHECK_WITH(OutOfMemoryError, ...)), "
                            "raised as torch.OutOfMemoryError"),
    ("CUDA error: out of memory", "pytorch C10_CUDA_CHECK (c10/cuda/CUDAException.cpp): 'CUDA error: ' + "
                                  "cudaGetErrorString(cudaErrorMemoryAllocation), torch.AcceleratorError on recent "
                                  "torch; matched by Composer PR #3400"),
    ("HIP out of memory.", "the hipified CUDACachingAllocator of ROCm builds (torch.OutOfMemoryError)"),
    ("HIP error: out of memory", "C10_HIP_CHECK, the hipified C10_CUDA_CHECK of ROCm builds"),
    ("XPU out of memory.", "pytorch c10/xpu/XPUCachingAllocator.cpp (TORCH_CHECK_WITH(OutOfMemoryError, ...))"),
    ("Allocation is out of device memory on current platform.",
     "intel-extension-for-pytorch csrc/gpu/utils/DPCPP.h (std::runtime_error -> RuntimeError); matched by OTX's "
     "adaptive batch size"),
    ("MPS backend out of memory", "pytorch aten/src/ATen/mps/MPSAllocator.mm (TORCH_CHECK -> RuntimeError)"),
    ("DefaultCPUAllocator: can't allocate memory", "pytorch c10/core/impl/alloc_cpu.cpp; the string is in the "
                                                  "installed libc10.so (torch 2.13) and torch.empty(2**50) raises it "
                                                  "as a plain RuntimeError (measured)"),
)


# ----------------------------------------------------------------------------- candidates and search

def candidate_batch_sizes(total_batch_size, max_seq_len, world_size, max_batch_size=None):
    """
    The device batch sizes (rows per micro-batch per rank) that keep grad_accum_steps a whole number >= 1: the sorted
    divisors B of N = total_batch_size / (max_seq_len * world_size), capped at max_batch_size (None: no cap).
    Source: nanochat's `total_batch_size % (device_batch_size * max_seq_len * world_size) == 0` (nanochat #532).
    Returns list[int], ascending. Raises UserError (naming the flags and the arithmetic) if N is not a positive whole
    number or if max_batch_size leaves no candidate.
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
    The largest candidate for which fits(candidate) is True, assuming monotonicity (if B fits, every smaller one fits).
    fits: callable int -> bool, used as given (in DDP the caller's fits already agreed across ranks).
    candidates: ascending distinct positive ints. start_index: optional predicted index to probe first (then its
    neighbour above if it fits, below if not); without it, plain bisection over the list.
    Calls fits at most ceil(log2(len(candidates))) + 2 times and never twice on the same size (bisection keeps an
    open bracket (lo, hi) of indices, lo known to fit, hi known not to, and only probes strictly inside it).
    Unlike Lightning's 'binsearch' / the seed design, it never gallops 1, 2, 4, ... first, which costs ~2*log2(n)
    calls on a long list. Raises UserError if not even the smallest candidate fits; ValueError for bad candidates.
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
    """
    The largest candidate strictly smaller than batch_size, or None if there is none: the step-down used when a
    training step runs out of memory after discovery (then grad_accum_steps grows so the tokens per step stay equal;
    Composer's auto microbatching halves instead, which may break divisibility).
    """
    smaller = [c for c in candidates if c < batch_size]
    return max(smaller) if smaller else None


def is_oom_error(exc):
    """
    True if `exc` is an out-of-memory error of some accelerator: a torch.OutOfMemoryError (alias
    torch.cuda.OutOfMemoryError), or a RuntimeError (torch.AcceleratorError included) whose message contains one of
    OOM_MESSAGES (CUDA, ROCm/HIP, XPU, MPS, CPU allocator). Everything else is False and must propagate
    (pitfall P7; Lightning's is_oom_error only knows CUDA and misses XPU and MPS).
    """
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    msg = str(exc)
    return any(marker in msg for marker, _ in OOM_MESSAGES)


# ----------------------------------------------------------------------------- the probe

def probe_step(model, optimizers, batch_size, max_seq_len, vocab_size, *, device, amp_dtype=None, generator=None,
               on_micro_step=None, optimizer_step=True):
    """
    One probe = the memory-relevant part of scripts/base_train.py's optimizer step, on synthetic tokens:
    micro-step (forward + backward of loss/2), micro-step (loss/2, gradients accumulate), clip_grad_norm_(1.0),
    step() of every optimizer (creates the lazy optimizer state), model.zero_grad(set_to_none=True), one more
    micro-step (activations while the optimizer state is alive). Pitfalls P1 (lazy state, grads during accumulation).
    model(idx, targets) must return the scalar loss; idx, targets: int64 (batch_size, max_seq_len) drawn with
    torch.randint from `generator` (a torch.Generator on device's type; the global RNG is not used).
    amp_dtype: autocast dtype (e.g. torch.bfloat16) or None for none. on_micro_step: called after each micro-step
    (MemTracker.reset_mod_stats). optimizer_step=False skips the optimizer step (only to show that such a probe
    underestimates). Returns None; raises whatever the step raises (OOM included).
    """
    device = torch.device(device)

    def micro_step(scale):
        idx = torch.randint(0, vocab_size, (batch_size, max_seq_len), generator=generator, device=device)
        targets = torch.randint(0, vocab_size, (batch_size, max_seq_len), generator=generator, device=device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = model(idx, targets)
        (loss * scale).backward()
        if on_micro_step is not None:
            on_micro_step()

    micro_step(0.5)
    micro_step(0.5)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if optimizer_step:
        for opt in optimizers:
            opt.step()
    model.zero_grad(set_to_none=True)
    micro_step(1.0)


def _peak_tracker():
    """
    A torch.distributed._tools.mem_tracker.MemTracker that keeps only the global peak. The stock tracker also updates
    every module's peak snapshot after every op (O(modules) per op: 13 s of a 20 s depth-20 probe, measured); we
    override that one private method. The test test_peak_tracker_matches_stock_memtracker pins the equivalence.
    """
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakMemTracker(MemTracker):
        def _update_peak_stats(self, peak_state):
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    return PeakMemTracker()


def _tracker_peak_bytes(tracker):
    """Peak total bytes of a MemTracker over all devices it saw."""
    return int(sum(snap["Total"] for snap in tracker.get_tracker_snapshot("peak").values()))


def _ddp_bucket_bytes(model):
    """Bytes of DDP's gradient buckets: one flat copy of every gradient (DistributedDataParallel's default
    gradient_as_bucket_view=False), added when world_size > 1 so that no collective runs inside a probe."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def _quiet_build(build_model, device):
    """build_model(device) with its stdout silenced (setup_optimizers prints on every probe otherwise)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return build_model(device)


def measure_fake_peak(build_model, batch_size, *, max_seq_len, vocab_size, device="cpu", amp_dtype=None,
                      world_size=1, optimizer_step=True):
    """
    Peak bytes of probe_step at `batch_size`, measured without allocating them: build_model(device) is called inside
    torch._subclasses.fake_tensor.FakeTensorMode (so it must create its modules inside the call, directly on
    `device`: FakeTensorMode cannot swap meta parameters in nn.Module.to_empty, torch 2.13), and the step runs under
    MemTracker (parameters, buffers, gradients, activations, temporaries, optimizer state; exact storage bytes,
    rounded to 512 B on CUDA like the caching allocator). Plus DDP's gradient buckets when world_size > 1.
    build_model(device) -> (model, optimizers). Returns int bytes. Takes ~1 s for depth 4 / seq 256 and ~4 s for
    depth 20 / seq 2048 on this 2-core CPU (the work grows with the number of ops, not with batch_size).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    with FakeTensorMode():
        try:
            model, optimizers = _quiet_build(build_model, device)
        except RuntimeError as exc:
            if "Couldn't swap" not in str(exc):
                raise
            raise ValueError("build_model must create the model directly on the device it is given (e.g. with "
                             "torch.device(device): GPT(config)); meta + to_empty() cannot run under "
                             "FakeTensorMode; see gpt_builder") from exc
        tracker = _peak_tracker()
        tracker.track_external(model, *optimizers)
        with tracker:
            probe_step(model, optimizers, batch_size, max_seq_len, vocab_size, device=device, amp_dtype=amp_dtype,
                       generator=generator, on_micro_step=tracker.reset_mod_stats, optimizer_step=optimizer_step)
        extra = _ddp_bucket_bytes(model) if world_size > 1 else 0
    return _tracker_peak_bytes(tracker) + extra


class _FakeProbe:
    """CPU/MPS probes: measure_fake_peak on a fresh fake model per probe; never allocates, never OOMs."""

    kind = "fake tensors + MemTracker (no memory allocated)"

    def __init__(self, build_model, device, max_seq_len, vocab_size, amp_dtype, world_size):
        self.args = dict(max_seq_len=max_seq_len, vocab_size=vocab_size, device=device, amp_dtype=amp_dtype,
                         world_size=world_size)
        self.build_model = build_model

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def measure(self, batch_size, compiled=False):
        """Returns (peak_bytes, oom=False, thrash=False)."""
        return measure_fake_peak(self.build_model, batch_size, **self.args), False, False


class _RealProbe:
    """
    Real probes on one model built once by build_model(device): on CUDA (peak = torch.cuda.max_memory_reserved,
    allocator capped at `fraction` of the device), elsewhere only for tests and explicit probe="real" (peak = a
    MemTracker on the real tensors; a real host OOM kills the process). On exit the parameters are restored bitwise
    from a CPU snapshot (so build_model may return an existing model), the optimizer state is cleared, the memory
    fraction is restored. OOM errors are caught and cleaned up outside the except block (pytorch #18853); every other
    error propagates.
    """

    kind = "real step"

    def __init__(self, build_model, device, max_seq_len, vocab_size, amp_dtype, world_size, fraction=None, log=print0):
        self.build_model, self.device, self.fraction, self.log = build_model, torch.device(device), fraction, log
        self.max_seq_len, self.vocab_size, self.amp_dtype, self.world_size = max_seq_len, vocab_size, amp_dtype, world_size
        self.is_cuda = self.device.type == "cuda"
        self.model = self.optimizers = self.compiled_model = self.snapshot = None
        self.prev_fraction = None
        if self.is_cuda:
            self.kind = "real step on CUDA, peak = max_memory_reserved"

    def __enter__(self):
        self.model, self.optimizers = _quiet_build(self.build_model, self.device)
        self.snapshot = [p.detach().to("cpu", copy=True) for p in self.model.parameters()]
        self.extra_bytes = _ddp_bucket_bytes(self.model) if self.world_size > 1 else 0
        if self.is_cuda:
            self.total = torch.cuda.get_device_properties(self.device).total_memory
            self.prev_fraction = torch.cuda.get_per_process_memory_fraction(self.device)
            if self.fraction is not None:
                torch.cuda.set_per_process_memory_fraction(self.fraction, self.device)
            self._cleanup(check=False)
            self.baseline = torch.cuda.memory_allocated(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            foreign = total - free - torch.cuda.memory_reserved(self.device)
            if foreign > 0.05 * total:
                self.log(f"auto_batch_size: warning: {foreign / GiB:.2f} GiB of {self.device} is used outside this "
                         f"process's allocator (CUDA context, other processes, NCCL); probes cannot see it")
        return self

    def __exit__(self, *exc):
        try:
            if self.model is not None and self.snapshot is not None:
                with torch.no_grad():
                    for p, saved in zip(self.model.parameters(), self.snapshot):
                        p.copy_(saved)
                self._cleanup(check=False)
        finally:
            if self.is_cuda and self.prev_fraction is not None:
                torch.cuda.set_per_process_memory_fraction(self.prev_fraction, self.device)
            self.model = self.optimizers = self.compiled_model = self.snapshot = None
            if self.is_cuda:
                gc.collect()
                _empty_cache_guarded()
        return False

    def _cleanup(self, check=True):
        """Drop gradients and optimizer state; on CUDA also collect reference cycles (a caught exception's traceback
        can keep probe tensors alive), release the cache, reset the peak and check the baseline."""
        self.model.zero_grad(set_to_none=True)
        for opt in self.optimizers:
            opt.state.clear()
        if self.is_cuda:
            gc.collect()  # ~0.3 s in a big process, so only where memory is measured by the allocator
            torch.cuda.synchronize(self.device)
            _empty_cache_guarded()
            torch.cuda.reset_peak_memory_stats(self.device)
            leaked = torch.cuda.memory_allocated(self.device) - self.baseline
            if check and leaked > max(64 * MiB, 0.01 * self.total):
                self.log(f"auto_batch_size: warning: {leaked / MiB:.0f} MiB still allocated after a probe (later "
                         f"probes see less memory, so the result errs on the small side)")

    def measure(self, batch_size, compiled=False):
        """Runs probe_step; returns (peak_bytes, oom, thrash). Non-OOM errors propagate."""
        model = self.model
        if compiled:
            if self.compiled_model is None:
                self.compiled_model = torch.compile(self.model, dynamic=False)
            model = self.compiled_model
        generator = torch.Generator(device=self.device).manual_seed(0)
        tracker = None
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            retries = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)
        else:
            tracker = _peak_tracker()
            tracker.track_external(self.model, *self.optimizers)
        oom = False
        try:
            with tracker if tracker is not None else contextlib.nullcontext():
                probe_step(model, self.optimizers, batch_size, self.max_seq_len, self.vocab_size, device=self.device,
                           amp_dtype=self.amp_dtype, generator=generator,
                           on_micro_step=tracker.reset_mod_stats if tracker is not None else None)
            if self.is_cuda:
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is an OOM
            if not is_oom_error(exc):
                raise
            oom = True
        # out of the except block: the exception, its traceback and the probe's tensors are unreachable now
        if self.is_cuda:
            peak = torch.cuda.max_memory_reserved(self.device)
            thrash = torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0) > retries
        else:
            peak, thrash = _tracker_peak_bytes(tracker), False
        self._cleanup()
        return peak + self.extra_bytes, oom, thrash


def _empty_cache_guarded():
    """torch.cuda.empty_cache(), ignoring an OOM raised by empty_cache itself (Lightning's garbage_collection_cuda)."""
    try:
        torch.cuda.empty_cache()
    except RuntimeError as exc:
        if not is_oom_error(exc):
            raise


# ----------------------------------------------------------------------------- memory budget

def _mem_available_bytes():
    """MemAvailable from /proc/meminfo (Linux), else the physical memory from sysconf (macOS/BSD), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_budget(device, device_memory_gb=None, local_world_size=1):
    """
    The device memory the step may use before the margin, in bytes, and a JSON-able description for logs and the
    cache key. device_memory_gb is in GiB (2**30 bytes; an "80 GB" H100 reports about 79.2 GiB).
    - CUDA: the device's total_memory, or min(total, device_memory_gb) to emulate a smaller device.
    - CPU/MPS: device_memory_gb, else CPU_MEMORY_FRACTION (0.5) of MemAvailable (/proc/meminfo; the physical memory
      from sysconf where /proc is missing) divided by local_world_size, rounded down to whole GiB (256 MiB below
      1 GiB) so that the cache key stays stable while MemAvailable drifts; on MPS also capped at
      torch.mps.recommended_max_memory().
    Returns (budget_bytes, description). Raises UserError for device_memory_gb <= 0 or an unknown machine size.
    """
    device = torch.device(device)
    if device_memory_gb is not None and device_memory_gb <= 0:
        raise UserError(f"--device_memory_gb={device_memory_gb}: expected a positive number of GiB")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        budget = props.total_memory if device_memory_gb is None else min(props.total_memory,
                                                                          int(device_memory_gb * GiB))
        return budget, {"type": "cuda", "name": props.name, "total_memory": props.total_memory,
                        "budget_bytes": budget}
    if device_memory_gb is not None:
        budget = int(device_memory_gb * GiB)
        return budget, {"type": device.type, "budget_bytes": budget, "source": "--device_memory_gb"}
    avail = _mem_available_bytes()
    if avail is None:
        raise UserError("cannot read this machine's memory size (/proc/meminfo, sysconf); pass --device_memory_gb")
    share = CPU_MEMORY_FRACTION * avail / max(1, local_world_size)
    if device.type == "mps" and hasattr(torch.mps, "recommended_max_memory"):
        share = min(share, torch.mps.recommended_max_memory() / max(1, local_world_size))
    step = GiB if share >= GiB else 256 * MiB
    budget = max(256 * MiB, int(share // step) * step)
    return budget, {"type": device.type, "budget_bytes": budget,
                    "source": f"{CPU_MEMORY_FRACTION} x MemAvailable / {local_world_size} local rank(s)"}


# ----------------------------------------------------------------------------- model factory for nanotrain's GPT

def gpt_builder(model_config, *, activation_checkpointing=False, **optimizer_kwargs):
    """
    A build_model(device) -> (model, [adamw, muon]) for nanotrain.gpt.GPT: the model is created directly on `device`
    (works under FakeTensorMode, unlike meta + to_empty), initialised with init_weights(), its
    activation_checkpointing attribute set as training sets it (the probes then measure the checkpointed step), and
    setup_optimizers(**optimizer_kwargs) gives fresh optimizers without state. Uses (and so advances) torch's global
    RNG; discover_device_batch_size restores it. The returned function carries `key_fields` (the GPT config, the
    activation checkpointing flag and the optimizer arguments), which discover_device_batch_size puts into the cache
    key, so a size found without checkpointing is never reused with it (or the other way round).
    """
    from nanotrain.gpt import GPT

    def build_model(device):
        with torch.device(device):
            model = GPT(model_config)
        model.init_weights()
        model.activation_checkpointing = bool(activation_checkpointing)
        return model, model.setup_optimizers(**optimizer_kwargs)

    # discover_device_batch_size adds these to the cache key, so a different model can never hit this model's entry
    build_model.key_fields = {"gpt_config": dict(vars(model_config)),
                              "activation_checkpointing": bool(activation_checkpointing),
                              "optimizer_kwargs": dict(optimizer_kwargs)}
    return build_model


# ----------------------------------------------------------------------------- cache

def code_fingerprint(build_model):
    """
    sha256 (hex str) of the Python sources that decide the probe's memory: every .py file of the nanotrain package
    (model, optimizers, this probe recipe), of the top-level package that defines build_model (if any), and
    build_model's own file (e.g. a script). torch's code is covered by its version in the cache key.
    Why: on the fake-tensor path the measured peak is a pure function of the cache key once the key includes the code,
    so a cache hit there is verified by this fingerprint (milliseconds) instead of re-running the identical fake
    measurement (~3 s in a fresh process, mostly the one-off import and warm-up of FakeTensorMode). An edit anywhere
    in those files is a cache miss (safe, just a new search). On real devices a hit is verified by a probe.
    """
    files = set()

    def add_tree(root):
        for dirpath, _, names in os.walk(root):
            files.update(os.path.join(dirpath, n) for n in names if n.endswith(".py"))

    add_tree(os.path.dirname(os.path.abspath(__file__)))
    module = sys.modules.get(getattr(build_model, "__module__", None) or "")
    package = (getattr(module, "__package__", None) or "").split(".")[0]
    if package and package in sys.modules and getattr(sys.modules[package], "__file__", None):
        add_tree(os.path.dirname(os.path.abspath(sys.modules[package].__file__)))
    try:
        source = inspect.getsourcefile(build_model)
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
    """
    The cache key (a JSON-able dict): key_fields (the caller's model config, activation checkpointing, ...),
    max_seq_len, vocab_size, the autocast dtype, the compile flag, `devices` (the device description of every rank,
    from device_memory_budget: CUDA name and total memory, or the CPU budget), world_size, torch version, margin, the
    candidate list, the CUDA allocator settings
    (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF, pitfall P10), ALGORITHM_VERSION and `code`
    (code_fingerprint(build_model)).
    """
    return {
        "algorithm_version": ALGORITHM_VERSION,
        "key_fields": json.loads(json.dumps(key_fields or {}, sort_keys=True, default=str)),
        "max_seq_len": max_seq_len,
        "vocab_size": vocab_size,
        "amp_dtype": str(amp_dtype),
        "compile": bool(compile),
        "devices": devices,
        "world_size": world_size,
        "torch": torch.__version__,
        "margin": margin,
        "candidates": list(candidates),
        "alloc_conf": [os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), os.environ.get("PYTORCH_ALLOC_CONF", "")],
        "code": code,
    }


def cache_path(key):
    """<base_dir>/auto_batch_cache/<sha256 of the canonical JSON of key>.json"""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return os.path.join(get_base_dir(), "auto_batch_cache", f"{digest}.json")


def read_cached(key, log=print0):
    """
    The cached device batch size for `key`, or None. A file that is not valid JSON, whose stored key differs from
    `key` (foreign or edited) or whose size is not a candidate is ignored with a warning (and left to be replaced).
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
    """Removes the cache entry for `key` (e.g. record["cache_key"] after a training step ran out of memory).
    Returns True if a file was removed."""
    try:
        os.remove(cache_path(key))
        return True
    except FileNotFoundError:
        return False


# ----------------------------------------------------------------------------- distributed agreement

def _dist_active():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _reduce_max(values, device):
    """Element-wise MAX of a list of floats over all ranks of the default group (identity without DDP)."""
    if not _dist_active():
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


# ----------------------------------------------------------------------------- compiled verification

def _refine_compiled(fits_compiled, candidates, batch_size, max_probes=MAX_COMPILED_PROBES):
    """
    The eager search found `batch_size`; the compiled step usually needs less memory (inductor fuses the fp32
    soft-cap + cross-entropy chain of nanochat's head), sometimes more (nanochat #443). So: verify batch_size with
    the compiled model; on failure step down one candidate at a time; if it passed at once, try the next larger
    candidates while probes remain. At most max_probes compiled probes (each one is a recompile; torch._dynamo falls
    back to eager after recompile_limit = 8). fits_compiled(B) -> bool. Returns the largest compiled-verified size;
    raises UserError if no probed size fits.
    """
    i = candidates.index(batch_size)
    probes = 0
    while probes < max_probes and i >= 0:
        probes += 1
        if fits_compiled(candidates[i]):
            break
        i -= 1
    else:
        raise UserError(f"the compiled model does not fit at device_batch_size <= {batch_size} (checked "
                        f"{probes} sizes; the eager step does fit); run with --compile=False or a smaller "
                        f"--max_batch_size")
    best = candidates[i]
    while best == batch_size and probes < max_probes and i + 1 < len(candidates):
        probes += 1
        if not fits_compiled(candidates[i + 1]):
            break
        i += 1
        best = batch_size = candidates[i]
    return best


# ----------------------------------------------------------------------------- discovery

def _save_rng():
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def _restore_rng(state):
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])


def discover_device_batch_size(build_model, *, max_seq_len, vocab_size, total_batch_size, world_size, device,
                               amp_dtype=None, compile=False, margin=DEFAULT_MARGIN, device_memory_gb=None,
                               max_batch_size=None, use_cache=True, key_fields, probe=None, log=print0):
    """
    The largest device_batch_size among candidate_batch_sizes(total_batch_size, max_seq_len, world_size,
    max_batch_size) whose training step (probe_step) peaks at most margin * device memory, on every rank.
    Call it on every rank after the process group is up and before the training model is built (CUDA probes need the
    memory); the result and the record are identical on all ranks.

    build_model(device) -> (model, optimizers): a fresh model and its optimizers as training uses them (see
    gpt_builder). On CPU/MPS it is called inside FakeTensorMode once per probe; on CUDA once, and that model is
    probed for real (its parameters are restored bitwise afterwards and its optimizers' state cleared).
    amp_dtype: the autocast dtype of training (torch.bfloat16) or None. compile: training uses torch.compile; on
    CUDA the search runs eager, then compiled probes verify (and, memory permitting, raise) the size; on CPU/MPS the
    flag only enters the cache key (the fake step is eager). margin: fraction of device memory the step may use
    (bytes, not batch units). device_memory_gb: the budget in GiB (CPU/MPS; on CUDA an emulated smaller device).
    use_cache: read/verify/write <base_dir>/auto_batch_cache/ (a hit costs one probe on real devices and none on the
    fake path, whose key contains code_fingerprint(build_model)). key_fields (required): a JSON-able dict of the
    facts that change memory and are not arguments here (model config, activation checkpointing, ...); merged with
    build_model.key_fields when the factory has it (gpt_builder does). probe: "fake" | "real" | None (real on CUDA,
    fake elsewhere; "real" on CPU measures a real step and risks the host). log: a print-like function (rank 0).

    Logs one line per probe and then `Auto-discovery found device_batch_size=N | grad_accum_steps=... | probes=...
    | ...s | cache hit/miss`. Returns (batch_size, record) with record a JSON-able dict: device_batch_size,
    grad_accum_steps, candidates, budget_bytes, limit_bytes, margin, device, measurement, probes (batch_size,
    peak_bytes, result, seconds, phase), cache_hit, cache_key, cache_path, seconds.
    Raises UserError when nothing fits or for bad arguments; any non-OOM error of a probe propagates on its rank and
    a RuntimeError is raised on the others.
    """
    t_start = time.perf_counter()
    device = torch.device(device)
    if not 0 < margin <= 1:
        raise UserError(f"--batch_size_margin={margin}: expected a fraction in (0, 1]")
    if _dist_active() and dist.get_world_size() != world_size:
        raise ValueError(f"world_size={world_size} but the process group has {dist.get_world_size()} ranks")
    rank = dist.get_rank() if _dist_active() else 0
    probe = probe or ("real" if device.type == "cuda" else "fake")
    if probe not in ("fake", "real"):
        raise ValueError(f"probe={probe!r}: expected 'fake', 'real' or None")
    candidates = candidate_batch_sizes(total_batch_size, max_seq_len, world_size, max_batch_size)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    budget, device_description = device_memory_budget(device, device_memory_gb, local_world)
    limit = margin * budget
    key_fields = {**getattr(build_model, "key_fields", {}), **key_fields}
    code = code_fingerprint(build_model)
    devices = [device_description]
    if _dist_active():  # every rank's device (or budget) is part of the key: the smallest decides the size
        devices = [None] * world_size
        dist.all_gather_object(devices, device_description)
    key = cache_key(key_fields=key_fields, max_seq_len=max_seq_len, vocab_size=vocab_size, amp_dtype=amp_dtype,
                    compile=compile, devices=devices, world_size=world_size, margin=margin, candidates=candidates,
                    code=code)
    compiled_checks = bool(compile) and probe == "real" and device.type == "cuda"
    if probe == "real":
        fraction = limit / device_description["total_memory"] if device.type == "cuda" else None
        prober = _RealProbe(build_model, device, max_seq_len, vocab_size, amp_dtype, world_size, fraction, log)
    else:
        prober = _FakeProbe(build_model, device, max_seq_len, vocab_size, amp_dtype, world_size)
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
        ranks = " (max over ranks)" if _dist_active() else ""
        log(f"auto_batch_size: probe device_batch_size={batch_size} ({phase}) | {result} | peak {peak / GiB:.3f} GiB"
            f"{ranks} = {100 * peak / budget:.1f}% of budget | {seconds:.2f}s")
        return ok

    rng_state = _save_rng()
    batch_size, hit = None, False
    try:
        _agree(prober.__enter__, device, "building the model for batch-size discovery")
        cached = _agree(lambda: read_cached(key, log) if use_cache and rank == 0 else None, device,
                        "reading the batch-size cache")
        # rank 0's cached size goes to every rank; a fake-path hit also needs the same key on every rank
        digest = float(int(os.path.basename(cache_path(key))[:13], 16))  # 52 bits: exact in float64
        cached, high, neg_low = _reduce_max([float(cached or 0), digest, -digest], device)
        cached, same_key_everywhere = int(cached), high == -neg_low
        if cached and probe == "fake" and same_key_everywhere:
            # the fake measurement is a pure function of the key (code fingerprint included): nothing to re-measure
            batch_size, hit = cached, True
            log(f"auto_batch_size: cache hit device_batch_size={cached}, verified by the code fingerprint")
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
            _restore_rng(rng_state)
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
    return batch_size, record


# ----------------------------------------------------------------------------- plan mode

def plan(depths, *, max_seq_len=2048, vocab_size=65536, total_batch_size=524288, device_memory_gb=80.0,
         margin=DEFAULT_MARGIN, world_size=1, activation_checkpointing=False, out=print):
    """
    Plan mode: ESTIMATES, without a GPU, the largest device_batch_size of nanotrain's GPT at each depth for a CUDA
    device with device_memory_gb GiB, bf16 autocast, eager step (probe_step measured by measure_fake_peak, searched
    by search_batch_size). Uses fake CUDA tensors when torch can run a CUDA device here; on a CPU-only torch build
    the autograd engine cannot record fake CUDA tensors (InputMetadata asks for a CUDA device guard, which a
    CPU-only build does not have: c10::impl::ensureCUDADeviceGuardSet only replaces an existing one, and the process
    aborts with "PyTorch is not linked with support for cuda devices"), so it measures fake CPU tensors in bf16
    (CPU autocast; the CPU flash-attention kernel, whose memory matches CUDA's flash attention) and says so.
    activation_checkpointing: measure the step with per-block activation checkpointing (GPT.activation_checkpointing).
    Prints a table (depth, params, candidate, estimated peak GiB, fits) and returns {depth: batch_size}.
    """
    from nanotrain.gpt import GPT, config_from_depth

    fake_device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = device_memory_gb * GiB
    limit = margin * budget
    candidates = candidate_batch_sizes(total_batch_size, max_seq_len, world_size)
    out(f"Plan mode: an ESTIMATE (not a measurement on a GPU) of the largest device_batch_size for a CUDA device with "
        f"{device_memory_gb:g} GiB; a size fits if its peak <= {margin:g} x {device_memory_gb:g} = "
        f"{limit / GiB:.4g} GiB. max_seq_len={max_seq_len}, vocab_size={vocab_size}, total_batch_size="
        f"{total_batch_size}, world_size={world_size}, bf16 autocast, uncompiled step "
        f"(2 micro-steps + optimizer step + 1 micro-step), activation checkpointing "
        f"{'on' if activation_checkpointing else 'off'}.")
    if fake_device == "cpu":
        out("Measured with fake CPU tensors in bf16: this torch is CPU-only and cannot record fake CUDA tensors for "
            "autograd. Live tensor bytes only: the CUDA caching allocator, the CUDA context (~0.5 GiB), NCCL buffers "
            "and cuBLAS workspaces come on top (the margin is for them); torch.compile usually needs less.")
    else:
        out("Measured with fake CUDA tensors (live tensor bytes, rounded to 512 B like the caching allocator).")
    out(f"{'depth':>5} | {'params':>14} | {'device_batch_size':>17} | {'est. peak GiB':>13} | fits")
    t0 = time.perf_counter()
    found = {}
    for depth in depths:
        config = config_from_depth(depth, vocab_size, max_seq_len)
        with torch.device("meta"):
            num_params = GPT(config).num_params()
        build_model = gpt_builder(config, activation_checkpointing=activation_checkpointing)
        peaks = {}

        def fits(batch_size):
            peaks[batch_size] = measure_fake_peak(build_model, batch_size, max_seq_len=max_seq_len,
                                                  vocab_size=vocab_size, device=fake_device,
                                                  amp_dtype=torch.bfloat16, world_size=world_size)
            return peaks[batch_size] <= limit

        rng_state = _save_rng()
        try:
            found[depth] = search_batch_size(fits, candidates)
        except UserError:
            found[depth] = None
        finally:
            _restore_rng(rng_state)
        for b in sorted(peaks):
            out(f"{depth:>5} | {num_params:>14,} | {b:>17} | {peaks[b] / GiB:>13.2f} | "
                f"{'yes' if peaks[b] <= limit else 'no'}")
        if found[depth] is None:
            out(f"{depth:>5} | => nothing fits, not even device_batch_size={candidates[0]}")
        else:
            accum = total_batch_size // (found[depth] * max_seq_len * world_size)
            out(f"{depth:>5} | => device_batch_size={found[depth]} (grad_accum_steps={accum})")
    out(f"Estimated in {time.perf_counter() - t0:.1f}s.")
    return found


def _parse_bool(text):
    """'True'/'False' (any case) -> bool, else ValueError (argparse turns it into a usage error)."""
    if text.lower() not in ("true", "false"):
        raise ValueError(text)
    return text.lower() == "true"


def main(argv=None):
    """Command line of plan mode; see `python -m nanotrain.auto_batch_size --help`."""
    parser = argparse.ArgumentParser(prog="python -m nanotrain.auto_batch_size",
                                     description="Plan mode: estimate the largest device_batch_size per depth for a "
                                                 "CUDA device of a given size, without a GPU.")
    parser.add_argument("--depth", type=int, default=None, help="one depth (default: --depths)")
    parser.add_argument("--depths", type=str, default="12,20,26,32", help="comma-separated depths")
    parser.add_argument("--max_seq_len", type=int, default=2048)
    parser.add_argument("--vocab_size", type=int, default=65536, help="nanochat's default tokenizer size")
    parser.add_argument("--total_batch_size", type=int, default=524288, help="tokens per optimizer step")
    parser.add_argument("--device_memory_gb", type=float, default=80.0, help="device memory in GiB")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN)
    parser.add_argument("--world_size", type=int, default=1)
    parser.add_argument("--activation_checkpointing", type=_parse_bool, default=False,
                        help="True: measure with per-block activation checkpointing (default False)")
    args = parser.parse_args(argv)
    try:
        depths = [args.depth] if args.depth is not None else [int(d) for d in args.depths.split(",") if d.strip()]
    except ValueError:
        raise UserError(f"--depths={args.depths!r}: expected comma-separated integers, e.g. 12,20,26,32") from None
    if not 0 < args.margin <= 1:
        raise UserError(f"--margin={args.margin}: expected a fraction in (0, 1]")
    if args.device_memory_gb <= 0:
        raise UserError(f"--device_memory_gb={args.device_memory_gb}: expected a positive number of GiB")
    plan(depths, max_seq_len=args.max_seq_len, vocab_size=args.vocab_size, total_batch_size=args.total_batch_size,
         device_memory_gb=args.device_memory_gb, margin=args.margin, world_size=args.world_size,
         activation_checkpointing=args.activation_checkpointing)


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        from nanotrain.common import die
        die(str(e))
    sys.exit(0)
