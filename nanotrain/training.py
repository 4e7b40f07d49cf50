"""
The training step, written once, and the small pieces every stage's loop shares: precision set-up, the batch
arithmetic, the lr and momentum schedules, forward_backward (the micro-steps of one optimizer step, with the one
gradient-sync rule of DDP and FSDP2), optimizer_step (no host read: a non-finite gradient norm's update is gated off
on the device), step_stats / read_step_stats (the loop's one host read per step) and the finiteness checks. Every caller goes through
forward_backward: base_train and mid_train (rows of equal length), chat_sft (token-weighted micro-batches), the
automatic batch size's out-of-memory step-down (the same rows in smaller micro-batches) and its memory probe (the
step itself). The loops stay in the scripts, to be read top to bottom; a run directory's life is nanotrain.run.
"""

import gc
import inspect
import math
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanotrain.common import any_rank, check_compile_toolchain, fast_bf16
from nanotrain.errors import UserError
from nanotrain.fsdp import is_fsdp

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def precision(dtype, device):
    """
    Resolves the --dtype setting: "" means bfloat16 autocast on CUDA and on CPUs with fast bf16 matmuls (AVX512-BF16
    or AMX, as nanotrain.common.fast_bf16 decides it once per process; under torch.distributed the ranks agree, so
    every rank must call this), float32 elsewhere. Parameters, gradients and optimizer state stay fp32 in
    every case (autocast only lowers the matmuls). Returns (compute dtype, autocast context): (torch.bfloat16,
    torch.autocast(device.type, bfloat16)) or (torch.float32, nullcontext()).
    Raises UserError for anything but "", "bfloat16", "float32".
    """
    if not dtype:  # measured only when asked for (a given --dtype skips the CPU measurement)
        fast = device.type == "cuda" or (device.type == "cpu" and fast_bf16(device))
        dtype = "bfloat16" if fast else "float32"
    if dtype not in COMPUTE_DTYPES:
        raise UserError(f"--dtype={dtype!r}: expected 'bfloat16', 'float32' or '' (auto)")
    compute_dtype = COMPUTE_DTYPES[dtype]
    ctx = torch.autocast(device.type, dtype=compute_dtype) if compute_dtype != torch.float32 else nullcontext()
    return compute_dtype, ctx


def resolve_compile(compile, device):
    """
    Resolves the --compile setting: None means on for CUDA and off elsewhere. Returns a bool. Raises UserError
    (check_compile_toolchain) when compiling on CPU without a C++ compiler.
    """
    use_compile = (device.type == "cuda") if compile is None else bool(compile)
    if use_compile:
        check_compile_toolchain(device)
    return use_compile


def resolve_activation_checkpointing(setting, device, discovered):
    """
    Resolves base_train's --activation_checkpointing: "" means "auto" on CUDA when the device batch size is
    discovered (the policy is then chosen with the batch size: nanotrain.auto_batch_size.policy), "none" otherwise (a
    given or fixed batch size, or CPU/MPS, where the fake-tensor probes are cheap but the recompute is not). A given
    setting is returned as it is (nanotrain.gpt.policy_name checks it). Returns a str or the given value.
    """
    return setting or ("auto" if torch.device(device).type == "cuda" and discovered else "none")


def grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, world_size):
    """
    The gradient accumulation steps of an optimizer step of total_batch_size tokens made of micro-batches of
    device_batch_size rows of max_seq_len tokens on world_size ranks: total_batch_size / (device_batch_size *
    max_seq_len * world_size). Raises UserError when a value is below 1 or the division is not exact; the message
    names the nearest valid --total_batch_size values and, where one exists, nearby valid --device_batch_size values.
    """
    if min(device_batch_size, total_batch_size, max_seq_len, world_size) < 1:
        raise UserError(f"--device_batch_size={device_batch_size}, --total_batch_size={total_batch_size} and "
                        f"--max_seq_len={max_seq_len} must be positive")
    per = device_batch_size * max_seq_len * world_size
    if total_batch_size % per == 0:
        return total_batch_size // per
    lo, hi = (total_batch_size // per) * per, (total_batch_size // per + 1) * per
    valid = f"--total_batch_size={lo} or {hi}" if lo > 0 else f"--total_batch_size={hi}"
    msg = (f"--total_batch_size={total_batch_size} is not a multiple of device_batch_size * max_seq_len * "
           f"world_size = {device_batch_size} * {max_seq_len} * {world_size} = {per}; nearest valid: {valid}")
    if total_batch_size % (max_seq_len * world_size) == 0:
        n = total_batch_size // (max_seq_len * world_size)
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        near = sorted(divisors, key=lambda d: abs(d - device_batch_size))[:3]
        msg += (f", or --device_batch_size in {sorted(near)} (divisors of {total_batch_size} / ({max_seq_len} * "
                f"{world_size}) = {n})")
    raise UserError(msg)


def lr_multiplier(step, total_steps, warmup_ratio=0.0, warmdown_ratio=0.2, final_lr_frac=0.0):
    """
    The lr multiplier of optimizer step `step` (0-based) of `total_steps`: linear warmup over the first
    round(warmup_ratio * total_steps) steps, then 1.0, then a linear warmdown to final_lr_frac over the last
    round(warmdown_ratio * total_steps) steps (the trapezoidal schedule of nanochat / modded-nanogpt).
    It counts optimizer steps, not micro-steps, so it does not depend on gradient accumulation.
    """
    warmup, warmdown = round(warmup_ratio * total_steps), round(warmdown_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if step <= total_steps - warmdown:
        return 1.0
    progress = (total_steps - step) / warmdown
    return progress + (1 - progress) * final_lr_frac


B_REF = 2**19  # tokens per step of the reference run (nanochat's d12 optimum, measured there)
BATCH_EXPONENT = 0.383  # Power Lines: the optimal total batch grows as the horizon to this power


def auto_total_batch_size(horizon_tokens, ref_horizon_tokens):
    """
    The automatic total batch size in tokens (--total_batch_size=-1), nanochat's rule (scripts/base_train.py at
    92d63d4): 2^round(log2(B_REF * (D / D_ref)^0.383)), D the run's training horizon in tokens (the data:param ratio
    times GPT.num_scaling_params), D_ref the same horizon of the depth-12 model (nanochat's reference, where B_REF =
    2^19 tokens was measured optimal). The exponent is the Power Lines fit (Bergsma et al. 2025, "Power Lines: Scaling
    Laws for Weight Decay and Batch Size in LLM Pre-training", arXiv:2505.13738). Returns an int power of two.
    """
    return 2 ** round(math.log2(B_REF * (horizon_tokens / ref_horizon_tokens) ** BATCH_EXPONENT))


def hparam_transfer_scales(total_batch_size, horizon_tokens, ref_horizon_tokens):
    """
    How the reference run's learning rates and weight decay move to a run of total_batch_size tokens per step and a
    horizon of horizon_tokens (nanochat's transfer from d12): every lr times sqrt(B / B_REF) (the square-root rule for
    Adam-type optimizers; Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"), and
    the Muon weight decay times sqrt(B / B_REF) * (D_ref / D), which keeps the AdamW timescale tau = B / (lr * wd * D)
    constant (Wang & Aitchison 2024, "How to set AdamW's weight decay as you scale model and dataset size",
    arXiv:2405.13698). Returns (lr_scale, weight_decay_scale), floats.
    """
    lr_scale = math.sqrt(total_batch_size / B_REF)
    return lr_scale, lr_scale * ref_horizon_tokens / horizon_tokens


def muon_weight_decay_for(model_dim):
    """
    The default Muon (cautious) weight decay of a model of width `model_dim`: 0.4 up to model_dim 512, then shrinking
    with the width squared, 0.4 * (512 / model_dim)^2 (0.064 at 1280). Above 512 it follows nanochat's sweeps (~0.40
    at model_dim 512, ~0.08 at 1280); below 512 it is capped at 0.4 instead of following the square (1.6 at 256):
    dev/LOG.md, "Muon weight decay capped at 0.4 (a decision)".
    """
    return 0.4 * min(1.0, (512 / model_dim) ** 2)


def muon_momentum(step, *, warmup_steps=300, start=0.85, end=0.95, total_steps=0, warmdown_ratio=0.0, final=None):
    """
    Muon's momentum at optimizer step `step` (0-based): linear from `start` to `end` over the first `warmup_steps`
    steps (0: `end` from the start), then `end`; with `final` given, linear from `end` at the start of the lr
    warmdown (the last round(warmdown_ratio * total_steps) of total_steps, as in lr_multiplier) to `final` at the
    last step (nanochat 2026: 0.85 -> 0.97 over 400 steps, then down to 0.90; the warmup wins where both apply).
    """
    if step < warmup_steps:
        frac = step / warmup_steps
        return (1 - frac) * start + frac * end
    warmdown = round(warmdown_ratio * total_steps)
    if final is None or warmdown == 0 or step < total_steps - warmdown:
        return end
    return end + (final - end) * (step - (total_steps - warmdown)) / warmdown



# Out-of-memory messages, matched as substrings of str(exc) for RuntimeError and its subclasses (torch.OutOfMemoryError
# and torch.AcceleratorError both subclass RuntimeError in torch 2.13). (marker, where the string comes from)
OOM_MESSAGES = (
    ("CUDA out of memory.", "pytorch c10/cuda/CUDACachingAllocator.cpp (TORCH_CHECK_WITH(OutOfMemoryError, ...)), "
                            "raised as torch.OutOfMemoryError"),
    ("CUDA error: out of memory", "pytorch C10_CUDA_CHECK (c10/cuda/CUDAException.cpp): 'CUDA error: ' + "
                                  "cudaGetErrorString(cudaErrorMemoryAllocation), torch.AcceleratorError on recent "
                                  "torch; also matched by Composer's auto microbatching"),
    ("HIP out of memory.", "the hipified CUDACachingAllocator of ROCm builds (torch.OutOfMemoryError)"),
    ("HIP error: out of memory", "C10_HIP_CHECK, the hipified C10_CUDA_CHECK of ROCm builds"),
    ("XPU out of memory.", "pytorch c10/xpu/XPUCachingAllocator.cpp (TORCH_CHECK_WITH(OutOfMemoryError, ...))"),
    ("Allocation is out of device memory on current platform.",
     "intel-extension-for-pytorch csrc/gpu/utils/DPCPP.h (std::runtime_error -> RuntimeError); matched by OTX's "
     "adaptive batch size"),
    ("MPS backend out of memory", "pytorch aten/src/ATen/mps/MPSAllocator.mm (TORCH_CHECK -> RuntimeError)"),
    ("DefaultCPUAllocator: can't allocate memory", "pytorch c10/core/impl/alloc_cpu.cpp; the string is in the "
                                                  "installed libc10.so (torch 2.13) and torch.empty(2**50) raises it "
                                                  "as a plain RuntimeError"),
)


def is_oom_error(exc):
    """
    True if `exc` is an out-of-memory error of some accelerator: a torch.OutOfMemoryError (alias
    torch.cuda.OutOfMemoryError), or a RuntimeError (torch.AcceleratorError included) whose message contains one of
    OOM_MESSAGES (CUDA, ROCm/HIP, XPU, MPS, CPU allocator). Everything else is False and must propagate: treating any
    error as "too big" hides real bugs (Lightning's is_oom_error only knows CUDA and misses XPU and MPS).
    """
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and any(marker in str(exc) for marker, _ in OOM_MESSAGES))


def micro_batches(inputs, targets, micro_batch_size):
    """
    The rows of one optimizer step cut into micro-batches for forward_backward: inputs, targets int64 (N, T) with N a
    multiple of micro_batch_size. Returns a list of N // micro_batch_size dicts {"x": (micro_batch_size, T),
    "y": (micro_batch_size, T)} (views, no copy). Raises ValueError if N is not a multiple of micro_batch_size.
    """
    n_rows = inputs.size(0)
    if micro_batch_size < 1 or n_rows % micro_batch_size != 0:
        raise ValueError(f"{n_rows} rows do not split into micro-batches of {micro_batch_size}")
    return [{"x": inputs[i:i + micro_batch_size], "y": targets[i:i + micro_batch_size]}
            for i in range(0, n_rows, micro_batch_size)]


def wrap_ddp(model, device, world_size):
    """
    `model` wrapped in torch.nn.parallel.DistributedDataParallel when world_size > 1 (device_ids=[device.index] on
    CUDA), else `model` itself: one process has no gradient to average, and the wrapper would only cost memory (a
    flat copy of every gradient in its buckets, which the batch-size probes do not measure for one process) and,
    under torch.compile, split the compiled graph at its bucket boundaries (DDPOptimizer). forward_backward's
    gradient-sync rule applies to whatever this returns.
    """
    if world_size <= 1:
        return model
    return torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                     else None)


def forward_backward(model, batches, autocast_ctx, *, loss_scale=None, catch_oom=False, on_micro_step=None):
    """
    The micro-steps of one optimizer step: forward and backward of every micro-batch in `batches`, gradients
    accumulating in .grad. batches: a list of dicts {"x", "y": int64 (B, T) inputs and targets (-1: not trained),
    optionally "doc_ids": int64 (B, T) for packed rows} (micro_batches(), sft_data.micro_batch()). The loss of each:
    - loss_scale None (rows of equal length, every target trained: pretraining, mid-training): the micro-batch's mean
      loss divided by the number of micro-batches, so the accumulated gradient is that of the mean loss over all the
      step's tokens; returns the mean of the micro-batches' mean losses (detached 0-dim tensor).
    - loss_scale a float (SFT): the micro-batch's summed loss (loss_reduction="sum") times loss_scale, e.g.
      sft_data.token_loss_scale (world size / global trained targets): the gradient is then that of the token-mean
      loss over the whole step, whatever its split into micro-batches and ranks; returns the sum of the scaled losses
      (detached 0-dim fp32 tensor; its mean over ranks is the step's token-mean loss).
      A micro-batch with "weights" (fp32 (B, T), RL's advantage per token, 0 where not trained) sums the per-token
      losses times their weights instead (loss_reduction="none"), then times loss_scale; loss_scale is required.
    The gradient-sync rule, the only one in nanotrain: under DDP (model is DistributedDataParallel) the gradients
    are all-reduced in the last micro-step's backward only (no_sync() on the others, as in nanoGPT); under FSDP2
    (nanotrain.fsdp) likewise only the last micro-step reduce-scatters (set_requires_gradient_sync), the others
    accumulate unsharded gradients locally (as much gradient memory as DDP until that reduce-scatter).
    catch_oom=True (the automatic batch size's step-down): an out-of-memory error (is_oom_error) of a micro-step is
    caught and the ranks agree after every micro-step (one all-reduce each), so that no rank waits in a collective
    that another left; if any rank ran out of memory every rank drops its gradients and None is returned (the caller
    redoes the step in smaller micro-batches). DDP's sync then runs after the last micro-step instead, one all-reduce
    per gradient and a division by the world size: the same average. Not for FSDP2, whose collectives run inside
    forward and backward (ValueError).
    on_micro_step: called after each micro-step's backward (the memory probe resets its tracker's module state).
    Every rank must pass the same number of micro-batches. Raises ValueError for no micro-batch.
    """
    if not batches:
        raise ValueError("forward_backward: no micro-batch")
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    sharded = is_fsdp(model)
    if catch_oom and sharded:
        raise ValueError("forward_backward: catch_oom=True is not possible under FSDP2 (collectives inside forward "
                         "and backward)")
    n = len(batches)
    total = torch.zeros((), device=batches[0]["x"].device)
    oom = False
    for i, b in enumerate(batches):
        sync = i == n - 1 and not catch_oom  # with catch_oom, DDP's all-reduce comes after the loop
        if sharded:
            model.set_requires_gradient_sync(sync)
        try:
            with model.no_sync() if ddp and not sync else nullcontext():
                weights = b.get("weights")
                kwargs = {} if loss_scale is None else {"loss_reduction": "sum" if weights is None else "none"}
                if b.get("doc_ids") is not None:
                    kwargs["doc_ids"] = b["doc_ids"]
                with autocast_ctx:
                    loss = model(b["x"], b["y"], **kwargs)
                if weights is not None:  # per-token losses (B*T,) times their weights, summed
                    loss = (loss * weights.reshape(-1)).sum()
                if loss_scale is None:
                    total += loss.detach()
                    (loss / n).backward()
                else:
                    (loss * loss_scale).backward()
                    total += loss.detach().float() * loss_scale
        except Exception as exc:  # only OOM is recoverable, and only when asked; cleaned up below, outside except
            if not (catch_oom and is_oom_error(exc)):
                raise
            oom = True
        loss = None  # the micro-step's graph is gone before the next one (or before the cleanup)
        if on_micro_step is not None:
            on_micro_step()
        if catch_oom and any_rank(oom, total.device):  # every rank redoes the step if one ran out of memory
            model.zero_grad(set_to_none=True)
            gc.collect()
            if total.device.type == "cuda":
                torch.cuda.empty_cache()
            return None
    if catch_oom and ddp:  # the sync no_sync() skipped: one all-reduce per gradient, then the mean
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for handle in [dist.all_reduce(g, async_op=True) for g in grads]:
            handle.wait()
        torch._foreach_div_(grads, dist.get_world_size())
    return total / n if loss_scale is None else total


def optimizer_step(model, optimizers, lrm, momentum, grad_clip, *, skip_nonfinite=True):
    """
    One update of every optimizer, queued without a host read: the global gradient norm (a device tensor), clipped to
    grad_clip if > 0 (torch.nn.utils.clip_grad_norm_: the clip coefficient stays on the device), each group's lr set
    to initial_lr * lrm (lrm None: lrs as they are) and Muon's momentum (groups with an "ns_steps" entry; momentum
    None: unchanged), then opt.step(finite=torch.isfinite(grad_norm)) on every optimizer, and the gradients zeroed
    (set to None). nanotrain's optimizers (nanotrain.optim) gate their update on the device: a NaN/inf norm (with
    the soft-capped loss a NaN gradient shows up a step before a NaN loss) leaves every parameter and optimizer state
    bit for bit unchanged; the caller stops the run with check_finite when it reads the norm. An optimizer whose
    step() takes no `finite` (e.g. torch.optim.SGD) costs one host read: it steps only if the norm is finite
    (skip_nonfinite=False: it steps without that read; the memory probe under FakeTensorMode has no values).
    Returns the gradient norm before clipping (a plain 0-dim fp32 tensor on the device, also when grad_clip is 0).
    Under FSDP2 the norm is computed over the shards and all-reduced (a replicated DTensor, made plain here), so it
    is the global norm on every rank.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:  # the norm alone: no pass multiplying every gradient by 1
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if hasattr(grad_norm, "full_tensor"):  # DTensor (FSDP2)
        grad_norm = grad_norm.full_tensor()
    finite = torch.isfinite(grad_norm)
    for opt in optimizers:
        for group in opt.param_groups:
            if lrm is not None:
                group["lr"] = group["initial_lr"] * lrm
            if momentum is not None and "ns_steps" in group:  # a Muon group
                group["momentum"] = momentum
    for opt in optimizers:
        if "finite" in inspect.signature(opt.step).parameters:
            opt.step(finite=finite)
        elif not skip_nonfinite or finite:  # another optimizer: a host read decides
            opt.step()
    model.zero_grad(set_to_none=True)
    return grad_norm


def step_stats(loss, grad_norm, stop_requested, device):
    """
    The numbers of one optimizer step kept on the device, to be read by read_step_stats in one host read after the
    step is queued whole (the loop's only device-to-host read of the step). loss: 0-dim tensor (this rank's;
    forward_backward's); grad_norm: optimizer_step's 0-dim tensor, or None for a step that updated nothing;
    stop_requested: this rank's bool (nanotrain.stop.requested). Under torch.distributed the loss and the stop flag
    are averaged over the ranks in one all-reduce (queued, no host read): the loss's mean, and the flag > 0 if any
    rank asked to stop, so every rank reads the same numbers and stops after the same step. Collective: every rank must
    call it. Returns an opaque value for read_step_stats.
    """
    flag = torch.full((), float(stop_requested), device=device)  # a fill, not a (synchronising) host copy
    local = torch.stack([loss.detach().float().reshape(()), flag])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(local)
        local = local / dist.get_world_size()  # the loss's mean; the flag's share of the ranks, > 0 if any
    norm = grad_norm.detach().float().reshape(()) if grad_norm is not None else torch.zeros((), device=device)
    return torch.stack([local[0], norm, local[1]]), grad_norm is not None


def read_step_stats(stats, step, run_dir):
    """
    Reads step_stats' numbers to the host with one device-to-host copy and checks them: returns (loss (float, the
    mean over ranks), grad_norm (float, or None where the step updated nothing), stop (bool: a stop was requested on
    some rank)). Raises check_finite's UserError naming `step` (0-based) for a non-finite loss or gradient norm of
    a step that updated: its update was not applied (nanotrain's optimizers gate it on the device), so the weights
    and optimizer state are those of the step before.
    """
    values, updated = stats
    loss, grad_norm, stop = values.tolist()
    if updated:
        check_finite(loss, step, run_dir)
        check_finite(grad_norm, step, run_dir, "gradient norm")
    return loss, grad_norm if updated else None, stop > 0


def check_finite(value, step, run_dir, what="loss"):
    """
    Raises UserError naming the step if `value` (the loss, or the gradient norm) is NaN or inf. A non-finite
    gradient norm's update was not applied (optimizer_step), so the weights and the last checkpoint are intact.
    """
    if not math.isfinite(value):
        raise UserError(f"non-finite {what} {value} at step {step}; stopped before the update (the last checkpoint "
                        f"in {run_dir}/checkpoints is intact; try a lower lr)")
