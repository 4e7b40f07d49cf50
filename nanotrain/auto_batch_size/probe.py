"""
The memory of one training step, in bytes: probe_step runs the training step itself (nanotrain.training's
forward_backward, optimizer_step, forward_backward) on synthetic tokens; measure_fake_peak measures its peak without
allocating it (FakeTensorMode + MemTracker); FakeProbe and RealProbe measure it at a given batch size (fake tensors on
CPU/MPS, a real step on CUDA with out-of-memory errors caught); device_memory_budget gives the bytes a step may use on
a device. nanotrain.auto_batch_size.search searches the device batch size with these.
"""

import contextlib
import gc
import os

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from nanotrain.common import indexed_device, print0
from nanotrain.errors import UserError
from nanotrain.training import forward_backward, is_oom_error, optimizer_step

GiB = 2**30
MiB = 2**20
CPU_MEMORY_FRACTION = 0.5  # default CPU/MPS budget: this fraction of MemAvailable, split among the local ranks
# The compiled training step's peak over the eager one's (torch.cuda.max_memory_reserved of probe_step), measured once:
# one H200, torch 2.11, depth 20, T = 2048, 32 rows, bf16 autocast, no activation checkpointing: 72.89 GiB compiled
# against 64.86 GiB eager. Plan mode (scripts/auto_batch_plan.py) multiplies its eager estimate by it for a compiled
# step; the finder on CUDA does not use it: it probes the compiled step itself (search._refine_compiled).
COMPILED_OVER_EAGER = 72.89 / 64.86

def probe_step(model, optimizers, batch_size, max_seq_len, vocab_size, *, device, amp_dtype=None, generator=None,
               on_micro_step=None, optimizer_step_on=True):
    """
    One probe = the training step that decides the memory, on synthetic tokens: nanotrain.training.forward_backward
    of two micro-batches (gradients accumulate), optimizer_step with gradient clipping at 1 (creates the lazy
    optimizer state, absent before the first step, and zeroes the gradients), then forward_backward of one more
    micro-batch (activations while the optimizer state is alive).
    model(idx, targets) must return the scalar loss; idx, targets: int64 (batch_size, max_seq_len) drawn with
    torch.randint from `generator` (a torch.Generator on device's type; the global RNG is not used).
    amp_dtype: the compute dtype: torch.bfloat16 runs under autocast, None or torch.float32 without. on_micro_step:
    called after each micro-step (MemTracker.reset_mod_stats). optimizer_step_on=False skips the optimizer step
    (only to show that such a probe underestimates). Returns None; raises whatever the step raises (OOM included).
    """
    device = torch.device(device)
    autocast_ctx = torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype not in (None, torch.float32))

    def batch():
        idx = torch.randint(0, vocab_size, (batch_size, max_seq_len), generator=generator, device=device)
        targets = torch.randint(0, vocab_size, (batch_size, max_seq_len), generator=generator, device=device)
        return {"x": idx, "y": targets}

    forward_backward(model, [batch(), batch()], autocast_ctx, on_micro_step=on_micro_step)
    if optimizer_step_on:
        optimizer_step(model, optimizers, None, None, 1.0, skip_nonfinite=False)
    else:  # the same clipping and zeroing, without the step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        model.zero_grad(set_to_none=True)
    forward_backward(model, [batch()], autocast_ctx, on_micro_step=on_micro_step)


def _peak_tracker():
    """
    A torch.distributed._tools.mem_tracker.MemTracker that keeps only the global peak. The stock tracker also updates
    every module's peak snapshot after every op (O(modules) work per op); we override that one private method. The
    test test_peak_tracker_matches_stock_memtracker pins the equivalence.
    """
    # imported here, not at the top: mem_tracker loads torch._dynamo and torch.distributed.tensor (slow imports, kept
    # out of start-up as in nanotrain/gpt.py and nanotrain/optim.py), which only a probe needs
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


def measure_fake_peak(build_probe, batch_size, *, max_seq_len, vocab_size, device="cpu", amp_dtype=None,
                      world_size=1, optimizer_step=True):
    """
    Peak bytes of probe_step at `batch_size`, measured without allocating them: build_probe(device) is called inside
    torch._subclasses.fake_tensor.FakeTensorMode (so it must create its modules inside the call, directly on
    `device`: FakeTensorMode cannot swap meta parameters in nn.Module.to_empty, torch 2.13), and the step runs under
    MemTracker (parameters, buffers, gradients, activations, temporaries, optimizer state; exact storage bytes,
    rounded to 512 B on CUDA like the caching allocator). Plus DDP's gradient buckets when world_size > 1. The same
    method as torchtitan's scripts/estimate/estimation.py. Tensor bytes only: a real process's RSS adds malloc and
    kernel scratch overhead (dev/LOG.md, "Auto batch size on CPU: a real step's RSS against the fake estimate").
    build_probe(device) -> (model, optimizers). Returns int bytes. Raises ValueError for a meta + to_empty factory.
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    with FakeTensorMode():
        try:
            model, optimizers = build_probe(device)
        except RuntimeError as exc:
            if "Couldn't swap" not in str(exc):
                raise
            raise ValueError("build_probe must create the model directly on the device it is given (e.g. with "
                             "torch.device(device): GPT(config)); meta + to_empty() cannot run under "
                             "FakeTensorMode; see gpt_builder") from exc
        tracker = _peak_tracker()
        tracker.track_external(model, *optimizers)
        with tracker:
            probe_step(model, optimizers, batch_size, max_seq_len, vocab_size, device=device, amp_dtype=amp_dtype,
                       generator=generator, on_micro_step=tracker.reset_mod_stats, optimizer_step_on=optimizer_step)
        extra = _ddp_bucket_bytes(model) if world_size > 1 else 0
    return _tracker_peak_bytes(tracker) + extra


class FakeProbe:
    """
    CPU/MPS probes, where the OS kills the process instead of raising an OOM: measure_fake_peak on a fresh fake model
    per probe; never allocates, never runs out of memory. A context manager (enter/exit do nothing) with
    measure(batch_size, compiled=False) -> (peak_bytes, oom=False, thrash=False); `compiled` is ignored.
    """

    kind = "fake tensors + MemTracker (no memory allocated)"

    def __init__(self, build_probe, device, max_seq_len, vocab_size, amp_dtype, world_size):
        self.args = dict(max_seq_len=max_seq_len, vocab_size=vocab_size, device=device, amp_dtype=amp_dtype,
                         world_size=world_size)
        self.build_probe = build_probe

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def measure(self, batch_size, compiled=False):
        """Returns (peak_bytes, oom=False, thrash=False)."""
        return measure_fake_peak(self.build_probe, batch_size, **self.args), False, False


class RealProbe:
    """
    Real probes on one model built on entry by build_probe(device): on CUDA (peak = torch.cuda.max_memory_reserved,
    the allocator capped at `fraction` of the device, thrash = the allocator had to retry an allocation), elsewhere
    only for tests and an explicit probe="real" (peak = a MemTracker on the real tensors; a real host OOM kills the
    process). measure(batch_size, compiled=False) -> (peak_bytes, oom, thrash), compiled=True probes
    torch.compile(model). On exit the parameters are restored bitwise from a CPU snapshot (so build_probe may return
    the training model), the optimizer state is cleared, the memory fraction is restored. OOM errors are caught and
    cleaned up outside the except block (inside it, the traceback keeps the failed step's tensors alive); every other
    error propagates.
    """

    kind = "real step"

    def __init__(self, build_probe, device, max_seq_len, vocab_size, amp_dtype, world_size, fraction=None, log=print0):
        self.build_probe, self.device, self.fraction, self.log = build_probe, indexed_device(device), fraction, log
        self.max_seq_len, self.vocab_size, self.amp_dtype, self.world_size = max_seq_len, vocab_size, amp_dtype, world_size
        self.is_cuda = self.device.type == "cuda"
        self.model = self.optimizers = self.compiled_model = self.snapshot = self.prev_fraction = None
        if self.is_cuda:
            self.kind = "real step on CUDA, peak = max_memory_reserved"

    def __enter__(self):
        self.model, self.optimizers = self.build_probe(self.device)
        self.snapshot = [p.detach().to("cpu", copy=True) for p in self.model.parameters()]
        self.extra_bytes = _ddp_bucket_bytes(self.model) if self.world_size > 1 else 0
        if self.is_cuda:
            self.total = torch.cuda.get_device_properties(self.device).total_memory
            self.prev_fraction = torch.cuda.get_per_process_memory_fraction(self.device)
            if self.fraction is not None:
                torch.cuda.set_per_process_memory_fraction(self.fraction, self.device)
            self.baseline = 0  # read by _cleanup's leak check only; set for real once the cache is clean
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
            gc.collect()  # costly in a big process, so only where memory is measured by the allocator
            torch.cuda.synchronize(self.device)
            _empty_cache_guarded()
            torch.cuda.reset_peak_memory_stats(self.device)
            leaked = torch.cuda.memory_allocated(self.device) - self.baseline if check else 0
            if leaked > max(64 * MiB, 0.01 * self.total):
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


def _mem_available_bytes():
    """MemAvailable from /proc/meminfo (Linux), else the physical memory from sysconf (macOS/BSD), else None."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_budget(device, device_memory_gb=None, local_world_size=1):
    """
    The device memory the step may use before the margin, in bytes, and a JSON-able description for logs and the
    cache key. device_memory_gb is in GiB (2**30 bytes).
    - CUDA: the device's total_memory, or min(total, device_memory_gb) to emulate a smaller device.
    - CPU/MPS: device_memory_gb, else CPU_MEMORY_FRACTION (0.5) of MemAvailable (/proc/meminfo; the physical memory
      from sysconf where /proc is missing) divided by local_world_size, rounded down to whole GiB (256 MiB below
      1 GiB) so that the cache key stays stable while MemAvailable drifts; on MPS also capped at
      torch.mps.recommended_max_memory().
    Returns (budget_bytes, description). Raises UserError for device_memory_gb <= 0 or an unknown machine size.
    """
    device = indexed_device(device)
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
