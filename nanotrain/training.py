"""
The small pieces of a training loop that every stage (base_train, mid_train, chat_sft) shares: precision set-up, the
lr schedule, the optimizer step, the metrics log, and the replica check under DDP (stop signals: nanotrain.stop).
Models sharded with FSDP2 (nanotrain.fsdp) go through the same functions.
The loops themselves stay in the scripts, to be read top to bottom.
"""

import json
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanotrain.common import (
    UserError,
    atomic_write_json,
    check_compile_toolchain,
    get_base_dir,
    is_distributed,
    print0,
)
from nanotrain.fsdp import is_fsdp
from nanotrain.muon import Muon, ns_dtype_for
from nanotrain.report import write_section

COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def precision(dtype, device):
    """
    Resolves the --dtype setting: "" means bfloat16 autocast on CUDA and on CPUs with fast bf16 matmuls (AVX512-BF16
    or AMX, as nanotrain.muon.ns_dtype_for decides it once per process; under torch.distributed the ranks agree, so
    every rank must call this), float32 elsewhere. Parameters, gradients and optimizer state stay fp32 in
    every case (autocast only lowers the matmuls). Returns (compute dtype, autocast context): (torch.bfloat16,
    torch.autocast(device.type, bfloat16)) or (torch.float32, nullcontext()).
    Raises UserError for anything but "", "bfloat16", "float32".
    """
    if not dtype:  # measured only when asked for (a given --dtype skips the CPU measurement)
        fast_bf16 = device.type == "cuda" or (device.type == "cpu" and ns_dtype_for(device) == torch.bfloat16)
        dtype = "bfloat16" if fast_bf16 else "float32"
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


def muon_weight_decay_for(model_dim):
    """
    The default Muon (cautious) weight decay of a model of width `model_dim`: 0.4 up to model_dim 512, then shrinking
    with the width squared, 0.4 * (512 / model_dim)^2 (0.064 at 1280). Above 512 it follows nanochat's sweeps (~0.40
    at model_dim 512, ~0.08 at 1280); below 512 the square would keep growing (1.6 at 256), which helped this repo's
    100-step runs but hurt its 400-step CPU recipe, so it is capped.
    """
    return 0.4 * min(1.0, (512 / model_dim) ** 2)


def muon_momentum(step, warmup_steps=300, start=0.85, end=0.95, total_steps=0, warmdown_ratio=0.0, final=None):
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


def forward_backward(model, inputs, targets, micro_batch_size, autocast_ctx):
    """
    The micro-steps of one pretraining optimizer step. inputs, targets: int64 (N, T) with N a multiple of
    micro_batch_size; they run as N // micro_batch_size micro-batches whose gradients accumulate in .grad.
    Each micro-batch's mean loss is divided by the number of micro-batches, so the accumulated gradient is the gradient
    of the mean loss over all N * T tokens (every micro-batch holds the same number of tokens: pretraining targets are
    never -1). Under DDP (model is DistributedDataParallel) gradients are all-reduced only in the last micro-step's
    backward (no_sync on the others, as in nanoGPT); under FSDP2 (nanotrain.fsdp) likewise only the last micro-step
    reduce-scatters (set_requires_gradient_sync), the others accumulate unsharded gradients locally (as much gradient
    memory as DDP until that reduce-scatter; syncing every micro-step would keep less and communicate more).
    Returns the mean loss over the N rows (detached 0-dim tensor). Raises ValueError if N is not a multiple of
    micro_batch_size.
    """
    n_rows = inputs.size(0)
    if n_rows % micro_batch_size != 0:
        raise ValueError(f"{n_rows} rows do not split into micro-batches of {micro_batch_size}")
    n_micro = n_rows // micro_batch_size
    is_ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    sharded = is_fsdp(model)
    loss_sum = torch.zeros((), device=inputs.device)
    for i in range(n_micro):
        x = inputs[i * micro_batch_size:(i + 1) * micro_batch_size]
        y = targets[i * micro_batch_size:(i + 1) * micro_batch_size]
        if is_ddp:
            model.require_backward_grad_sync = i == n_micro - 1
        elif sharded:
            model.set_requires_gradient_sync(i == n_micro - 1)
        with autocast_ctx:
            loss = model(x, y)
        loss_sum += loss.detach()
        (loss / n_micro).backward()
    return loss_sum / n_micro


def optimizer_step(model, optimizers, lrm, momentum, grad_clip):
    """
    One update of every optimizer: clip the (already synchronised, so global) gradient norm to grad_clip if > 0,
    set each group's lr to initial_lr * lrm and Muon's momentum, step, and zero the gradients (set to None).
    If the global gradient norm is NaN/inf nothing is updated and the gradients are dropped (with the soft-capped
    loss a NaN gradient shows up a step before a NaN loss); the caller stops with check_finite on the returned norm.
    Returns the gradient norm before clipping (a plain 0-dim fp32 tensor, also when grad_clip is 0). Under FSDP2 the
    norm is computed over the shards and all-reduced by clip_grad_norm_ (a replicated DTensor, made plain here), so it
    is the global norm on every rank.
    """
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else math.inf)
    if hasattr(grad_norm, "full_tensor"):  # DTensor (FSDP2)
        grad_norm = grad_norm.full_tensor()
    if not torch.isfinite(grad_norm):
        model.zero_grad(set_to_none=True)
        return grad_norm
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lrm
            if isinstance(opt, Muon):
                group["momentum"] = momentum
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return grad_norm


def check_finite(value, step, run_dir, what="loss"):
    """
    Raises UserError naming the step if `value` (the loss, or the gradient norm) is NaN or inf. Called before the
    update is applied, so the weights and the last checkpoint are intact.
    """
    if not math.isfinite(value):
        raise UserError(f"non-finite {what} {value} at step {step}; stopped before the update (the last checkpoint "
                        f"in {run_dir}/checkpoints is intact; try a lower lr)")


class MetricsLog:
    """
    metrics.jsonl in the run directory, one JSON object per line, written by rank 0. A fresh run starts it empty; a
    resumed run keeps the rows before the step it resumes from and that step's training row (rows with "dt"); the
    evaluation rows of that step and everything later are dropped, because the resumed run evaluates at its first
    step again (the saving run may or may not have: a regular save comes before the evaluation, a stop request
    saves and leaves before it), so every evaluation appears exactly once.

    On resume, an unparseable last line is the torn row of a killed run and is dropped. Any other line that is not a
    JSON object with an int "step" (a file rewritten as one JSON list, rows of another tool) cannot be placed before
    or after the resume step: the resume stops with UserError naming file:line, before anything is changed, so the
    user decides what becomes of those rows (repair or remove them, then resume again).
    """

    def __init__(self, run_dir, resume_step=None, master=True):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = None
        if not master:
            return
        if resume_step is None:
            if os.path.exists(self.path):
                os.remove(self.path)
        elif os.path.exists(self.path):
            with open(self.path, encoding="utf-8", errors="surrogateescape") as f:
                lines = [(n, ln if ln.endswith("\n") else ln + "\n") for n, ln in enumerate(f, 1) if ln.strip()]
            keep = []
            for i, (number, line) in enumerate(lines):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    if i == len(lines) - 1:  # the torn last row of a killed run
                        continue
                    row = None
                if not (isinstance(row, dict) and type(row.get("step")) is int):
                    raise UserError(f"{self.path}:{number}: expected a JSON object with an int \"step\", got "
                                    f"{line.strip()[:60]!r}; nothing was changed: repair or remove that line, then "
                                    f"resume again")
                if row["step"] < resume_step or (row["step"] == resume_step and "dt" in row):
                    keep.append(line)
            with open(self.path + ".tmp", "w", encoding="utf-8", errors="surrogateescape") as f:
                f.writelines(keep)
            os.replace(self.path + ".tmp", self.path)
        self.file = open(self.path, "a")

    def log(self, **row):
        if self.file is not None:
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()

    def close(self):
        if self.file is not None:
            self.file.close()


def open_run_log(run_dir, settings, resume_step, master):
    """
    The start of a stage's records: prints the run directory and (rank 0) the final settings, writes them to
    <run_dir>/config.json atomically, and returns the MetricsLog of the run (resume_step: the step a resumed run
    continues from, None for a fresh run).
    """
    print0(f"Run directory: {run_dir}")
    metrics = MetricsLog(run_dir, resume_step, master)  # first: a metrics.jsonl it refuses leaves config.json as it was
    if master:
        print0("Config: " + json.dumps(settings, sort_keys=True))
        atomic_write_json(os.path.join(run_dir, "config.json"), settings)
    return metrics


def finish_run(model, run_dir, stage, metrics, t_start, summary):
    """
    The end of a training stage: checks that DDP replicas agree (check_replicas), prints the stage's summary line
    and where the outputs are, closes the metrics log and writes the stage's section of the report card
    (nanotrain.report.write_section, rank 0) with the stage's wall time since t_start (time.time() seconds).
    """
    check_replicas(model)
    print0(summary)
    print0(f"Outputs: {run_dir} (base dir {get_base_dir()})")
    metrics.close()
    report = write_section(os.path.basename(run_dir), stage, run_dir, {"wall_time_s": time.time() - t_start})
    if report:  # rank 0 only
        print0(f"Report card: {report}")


def check_replicas(model):
    """
    Under DDP: compares a float64 checksum of every parameter across ranks and raises RuntimeError if any rank's
    parameters differ (replica drift). Returns the checksum (float); a no-op returning None without DDP. Under FSDP2
    (sharded parameters, no replicas; a full_tensor() is the same all-gather on every rank) nothing is compared: it
    prints a note, waits at a barrier like the DDP path and returns None.
    """
    if not is_distributed():
        return None
    if is_fsdp(model):
        print0("Replica check: skipped under FSDP (parameters are sharded across ranks, not replicated)")
        dist.barrier()
        return None
    with torch.no_grad():
        checksum = sum((p.double().flatten() * torch.linspace(1, 2, p.numel(), dtype=torch.float64,
                        device=p.device)).sum() for p in model.parameters())
    sums = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(sums, checksum)
    if any(s.item() != sums[0].item() for s in sums):
        raise RuntimeError(f"parameters differ across ranks: checksums {[s.item() for s in sums]}")
    print0(f"Replica check: parameters identical on all {len(sums)} ranks (checksum {sums[0].item():.10e})")
    dist.barrier()  # every rank is done communicating before any of them tears the process group down
    return sums[0].item()


def step_log_line(step, total_steps, *, loss, grad_norm, lrm, dt, tokens, flops_per_token, peak_flops, world_size):
    """
    The one-line log of optimizer step `step` of `total_steps` and its metrics row (a dict: step, loss, lrm, dt,
    tok_per_sec, mfu). loss: the global mean (float); grad_norm: float or None (not shown); lrm: the lr multiplier;
    dt: the step's wall time in seconds; tokens: the tokens of the step on all ranks; flops_per_token: training FLOPs
    per token; peak_flops: one device's peak FLOP/s. Returns (line, row).
    """
    tok_per_sec = tokens / dt
    mfu = flops_per_token * tokens / dt / (peak_flops * world_size)
    eta = (total_steps - step) * dt
    gn = f" | grad norm {grad_norm:.3f}" if grad_norm is not None else ""
    line = (f"step {step:05d}/{total_steps:05d} ({100 * step / total_steps:.1f}%) | loss {loss:.6f}{gn} | "
            f"lrm {lrm:.3f} | dt {dt * 1000:.1f}ms | tok/s {tok_per_sec:,.0f} | mfu {100 * mfu:.1f}% | "
            f"eta {eta / 60:.1f}m")
    row = dict(step=step, loss=loss, lrm=lrm, dt=dt, tok_per_sec=tok_per_sec, mfu=mfu)
    return line, row
