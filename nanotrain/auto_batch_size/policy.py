"""
--activation_checkpointing=auto: the activation checkpointing policy (nanotrain.gpt) chosen together with the
device batch size. The policies are tried from the cheapest in compute ("none", "selective", "full"). A given
device_batch_size is a requirement: the cheapest policy under which it fits. A discovered one is a wish (the whole
step in one micro-batch): among the policies that recompute at most AUTO_MAX_RECOMPUTE of the step's FLOPs, the
first that reaches it, else the one with the largest size (more gradient accumulation steps cost little; recomputing
costs FLOPs); a costlier policy only when nothing cheaper fits at all. The recompute cost is counted
(torch.utils.flop_counter on fake tensors), not timed.
"""

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from nanotrain.auto_batch_size.search import discover_device_batch_size
from nanotrain.common import atomic_write_json, is_distributed, print0, rng_state, set_rng_state
from nanotrain.errors import UserError
from nanotrain.gpt import POLICIES, recompute_flops

AUTO_MAX_RECOMPUTE = 0.15  # a larger micro-batch is not worth more than this share of extra FLOPs per step


def measure_recompute(build_probe, max_seq_len):
    """
    The share of extra FLOPs (float, 0.0 for none) that build_probe's model recomputes in a training step of one row
    of max_seq_len tokens (nanotrain.gpt.recompute_flops), on fake CPU tensors: no memory, no compute. The
    model's own activation_checkpointing is measured; torch's global RNG (build_probe draws the init) is restored.
    """
    saved = rng_state(torch.device("cpu"))
    try:
        with FakeTensorMode():
            model, _ = build_probe(torch.device("cpu"))
            model = getattr(model, "model", model)  # sft_builder's PackedRows wraps the GPT
            extra, _ = recompute_flops(model, 1, max_seq_len)
    finally:
        set_rng_state(saved, torch.device("cpu"))
    return extra


def choose_policy(found, needed, required=False):
    """
    The policy --activation_checkpointing=auto takes. found: {policy: (device_batch_size or None when nothing fits,
    recompute share)} for policies of POLICIES; needed: the device batch size the run needs. required=True (a given
    device_batch_size): the cheapest policy (POLICIES order) whose size reaches `needed`, else None. Otherwise, among
    the policies that fit and recompute at most AUTO_MAX_RECOMPUTE: the cheapest whose size reaches `needed`, else the
    largest size (the cheapest on a tie); if none of them fits, the cheapest policy that fits at all. Returns a policy
    name, or None when nothing fits.
    """
    order = [p for p in POLICIES if p in found]
    fits = [p for p in order if found[p][0] is not None]
    if required:
        return next((p for p in fits if found[p][0] >= needed), None)
    cheap = [p for p in fits if found[p][1] <= AUTO_MAX_RECOMPUTE]
    if not cheap:
        return fits[0] if fits else None
    return next((p for p in cheap if found[p][0] >= needed), None) or max(cheap, key=lambda p: (found[p][0],
                                                                                              -order.index(p)))


def discover_with_policy(make_builder, policy, *, device_batch_size=None, log=print0, **discover_kwargs):
    """
    The device batch size and, for policy "auto", the activation checkpointing policy. make_builder(policy) ->
    build_probe (nanotrain.auto_batch_size.builders.gpt_builder with that activation_checkpointing); discover_kwargs:
    nanotrain.auto_batch_size.search.discover_device_batch_size's keyword arguments (max_seq_len, total_batch_size,
    world_size, max_batch_size, ...). A policy other than "auto": that discovery, unchanged. "auto": one discovery
    per policy, cheapest first (each capped at the size needed; each its own cache entry), until one reaches the
    size the run needs: device_batch_size when given (required: the cheapest policy under which it fits), else the
    whole step in one micro-batch (total_batch_size / (max_seq_len * world_size), or max_batch_size; a wish); a
    policy recomputing more than AUTO_MAX_RECOMPUTE is not probed when a cheaper one fits and nothing is required;
    then choose_policy. Logs the choice, each policy's size and recompute share. Returns (policy, device_batch_size,
    record): the chosen discovery's record with "activation_checkpointing" (the policy), "recompute_flops" (its
    share) and, for auto, "policies" ({policy: [device_batch_size or None, recompute share]}). Raises UserError when
    nothing fits (or a given device_batch_size fits under no policy).
    """
    if policy != "auto":
        batch_size, record = discover_device_batch_size(make_builder(policy), log=log, **discover_kwargs)
        record.update(activation_checkpointing=policy)
        return policy, batch_size, record
    record_path = discover_kwargs.pop("record_path", None)  # the chosen policy's record is written, at the end
    required = device_batch_size is not None
    rows = discover_kwargs["total_batch_size"] // (discover_kwargs["max_seq_len"] * discover_kwargs["world_size"])
    cap = discover_kwargs.get("max_batch_size")
    needed = device_batch_size if device_batch_size is not None else min(rows, cap or rows)
    found, records = {}, {}
    for p in POLICIES:
        build = make_builder(p)
        extra = 0.0 if p == "none" else measure_recompute(build, discover_kwargs["max_seq_len"])
        if not required and extra > AUTO_MAX_RECOMPUTE and any(s is not None for s, _ in found.values()):
            log(f"activation_checkpointing=auto: {p}: recomputes {100 * extra:.1f}% of the step's FLOPs, more than "
                f"{100 * AUTO_MAX_RECOMPUTE:g}%, and a cheaper policy fits: not probed")
            continue
        try:
            size, records[p] = discover_device_batch_size(build, log=log,
                                                          **{**discover_kwargs, "max_batch_size": needed})
        except UserError:
            size = None
        found[p] = (size, extra)
        log(f"activation_checkpointing=auto: {p}: device_batch_size {size if size is not None else 'none fits'} | "
            f"recomputes {100 * extra:.1f}% of the step's FLOPs (torch.utils.flop_counter)")
        if size is not None and size >= needed:
            break
    chosen = choose_policy(found, needed, required)
    sizes = ", ".join(f"{p}: {s}" for p, (s, _) in found.items())
    if required and chosen is None:
        raise UserError(f"--activation_checkpointing=auto: --device_batch_size={device_batch_size} fits under no "
                        f"policy (largest sizes that fit: {sizes}); use a smaller --device_batch_size")
    if chosen is None:
        raise UserError("--activation_checkpointing=auto: no device_batch_size fits under any policy, not even full "
                        "recomputation; use a smaller --max_seq_len or a smaller model")
    size, extra = found[chosen]
    log(f"activation_checkpointing=auto: chose {chosen} (device_batch_size={size}, the run needs {needed}; "
        f"recomputes {100 * extra:.1f}% of the step's FLOPs)")
    record = records[chosen]
    record.update(activation_checkpointing=chosen, recompute_flops=extra,
                  policies={p: [s, e] for p, (s, e) in found.items()})
    if record_path is not None and not (is_distributed() and dist.get_rank() != 0):
        atomic_write_json(record_path, record)
    return chosen, size, record
