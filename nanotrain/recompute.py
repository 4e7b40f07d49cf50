"""
Activation checkpointing of the GPT's blocks: what a block keeps for backward and what it recomputes, per block,
with torch's own checkpoint (torch.utils.checkpoint.checkpoint, non-reentrant, so it composes with torch.compile, DDP,
FSDP2 and FakeTensorMode). Policies, cheapest in compute first:
- "none": autograd keeps every activation it needs.
- "selective": the outputs of the matmuls and of attention (aten mm, addmm, bmm, baddbmm, the SDPA kernels,
  flash-attn) are kept, everything else of the block (RMSNorm, rotary, QK norm, gates, casts, ReLU^2, residual adds,
  the value-embedding lookup) is recomputed in backward: create_selective_checkpoint_contexts with a policy function,
  the "selective activation recomputation" of Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models") and torchtitan's op-level SAC. Recomputes no matmul.
- "full": only the block's input is kept and the whole block is recomputed in backward (Chen et al. 2016, "Training
  Deep Nets with Sublinear Memory Cost"): ~one extra forward of the blocks per step.
Loss and gradients are the same under every policy (the model has no dropout, so no RNG state is replayed).
"""

from functools import partial

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nanotrain.errors import UserError

POLICIES = ("none", "selective", "full")  # cheapest in compute first
# aten ops whose outputs "selective" keeps: the matmuls and the attention kernels (CPU, CUDA flash / efficient /
# cuDNN, and the ops those call)
SAVED_ATEN_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward", "_efficient_attention_forward",
})


def policy_name(value, name="activation_checkpointing", allow_auto=False):
    """
    The policy (one of POLICIES, or "auto" with allow_auto) of a setting's value, a policy name. Raises UserError
    naming --<name> for anything else.
    """
    if value in POLICIES or (allow_auto and value == "auto"):
        return value
    allowed = "|".join(POLICIES + (("auto",) if allow_auto else ()))
    raise UserError(f"--{name}={value!r}: expected {allowed}")


def _keep_matmul_outputs(ctx, op, *args, **kwargs):
    """The "selective" policy function (torch.utils.checkpoint's policy_fn signature): keep the outputs of
    SAVED_ATEN_OPS and of flash-attn's ops, recompute every other op."""
    keep = op.namespace == "flash_attn" or (op.namespace == "aten" and op.overloadpacket.__name__ in SAVED_ATEN_OPS)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def run_block(fn, x, policy):
    """
    fn(x) under `policy` (one of POLICIES): "none" calls it; "full" and "selective" run it under
    torch.utils.checkpoint.checkpoint (use_reentrant=False, no RNG replay), "selective" with
    create_selective_checkpoint_contexts(_keep_matmul_outputs). fn may read other tensors from its closure (they are
    kept by whoever owns them). Returns fn(x).
    """
    if policy == "none":
        return fn(x)
    if policy == "full":
        return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False)
    return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _keep_matmul_outputs))


def recompute_flops(model, batch_size, seq_len, device="cpu"):
    """
    The FLOPs a training step recomputes under model.activation_checkpointing: torch.utils.flop_counter's count
    (matmuls and attention kernels; elementwise ops count 0) of one forward + backward of `batch_size` rows of
    `seq_len` random tokens, minus the same count with "none", divided by the latter. Runs on fake tensors (no
    memory, no compute): `model` must have been built under the caller's torch._subclasses.FakeTensorMode on
    `device`, or be a real model (then it computes). Returns (extra_fraction (float), flops_without (int)).
    """
    from torch.utils.flop_counter import FlopCounterMode
    saved = model.activation_checkpointing
    counts = {}
    try:
        for key, value in (("with", saved), ("without", "none")):
            model.activation_checkpointing = value
            idx = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
            counter = FlopCounterMode(display=False)
            with counter:
                model(idx, idx).backward()
            counts[key] = counter.get_total_flops()
            model.zero_grad(set_to_none=True)
    finally:
        model.activation_checkpointing = saved
    return (counts["with"] - counts["without"]) / counts["without"], counts["without"]
