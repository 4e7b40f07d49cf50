"""
Sharded data parallel training with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`), for models whose
parameters, gradients and optimizer state outgrow one device. Sources: the PyTorch FSDP2 docs
(https://pytorch.org/docs/stable/distributed.fsdp.fully_shard.html), the FSDP2 RFC (pytorch/pytorch#114299) and
torch.distributed.checkpoint.state_dict for full (unsharded) state dicts.

Every parameter becomes a DTensor sharded on dim 0 over a 1-D device mesh of all ranks (rank r holds rows
r*ceil(n/world) onwards, as torch.chunk splits them). Each transformer block is one FSDP group (one all-gather before
its forward and backward, one reduce-scatter of its gradients), the root module holds the rest (wte, lm_head).
Muon gathers the whole matrices it needs itself (nanotrain.muon); AdamW works on the shards elementwise. Checkpoints are
gathered into exactly the files a DDP or single-process run writes (nanotrain.checkpoint), so runs can switch modes.
torch.compile composes, compile then shard (torch's "Where to apply torch.compile?": compile the modules a
distributed wrapper is given, not the wrapper; torchtitan does the same per block): shard_model(compile_backend=...)
compiles each block in place (nn.Module.compile) before fully_shard; the root (embedding, head, chunked loss) stays
eager, and FSDP2's hooks, excluded from Dynamo tracing, run between the compiled blocks.
torch.distributed.fsdp/.tensor are slow to import: they are imported inside the functions.
"""

from contextlib import contextmanager

import torch
import torch.distributed as dist


def is_fsdp(model):
    """
    True if `model` (an nn.Module, or torch.compile's wrapper of one) was sharded by fully_shard. Does not import
    FSDP when it was never loaded.
    """
    import sys
    mod = sys.modules.get("torch.distributed.fsdp")
    return mod is not None and isinstance(getattr(model, "_orig_mod", model), mod.FSDPModule)


def mixed_precision_policy(compute_dtype):
    """
    The FSDP2 MixedPrecisionPolicy of a run whose compute dtype (nanotrain.training.precision) is `compute_dtype`,
    torch.bfloat16 or torch.float32: parameters are all-gathered and computed in that dtype (the sharded master
    weights, gradients and optimizer state stay fp32), gradients are reduce-scattered in fp32
    (reduce_dtype=torch.float32, so averaging over ranks does not round to bf16). Raises ValueError for another dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if compute_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"mixed_precision_policy: expected torch.bfloat16 or torch.float32, got {compute_dtype!r}")
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    assert policy.reduce_dtype == torch.float32, "gradients must be reduced in fp32"
    return policy


def shard_model(model, device, compute_dtype, compile_backend=None):
    """
    Shards a GPT in place with fully_shard and returns it (now also an FSDPModule): each block of model.blocks first,
    resharded after its forward (its all-gathered weights are freed and gathered again for backward), then the root
    (wte, lm_head; kept unsharded after forward since backward starts with lm_head). The mesh is 1-D over all ranks
    on device.type (nccl on CUDA, gloo on CPU: the process group of nanotrain.common.compute_init).
    model: fp32 parameters on the CPU or on `device` (fully_shard moves each group to `device` before cutting it,
    so only one group at a time is whole on the device). compute_dtype: torch.bfloat16 or torch.float32
    (mixed_precision_policy). compile_backend: None (no compile) or a torch.compile backend ("inductor"): each block
    is compiled in place (block.compile(dynamic=False, backend=...)) before it is sharded.
    Raises RuntimeError if no process group is initialised.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("shard_model needs torch.distributed to be initialised (run under torchrun)")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = mixed_precision_policy(compute_dtype)
    for block in model.blocks:
        if compile_backend is not None:  # compile, then shard
            block.compile(dynamic=False, backend=compile_backend)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    return model


@contextmanager
def gathered_root(model):
    """
    Keeps the root's own parameters (wte, lm_head) all-gathered inside the block, for code that calls
    model.forward directly instead of model(...) (nanotrain.engine.Engine's KV-cache decoding), which skips the
    root's FSDP hooks; the blocks gather theirs in their own hooks as always. Collective: every rank must enter it and run the same forwards.
    A no-op for a model that is not sharded.
    """
    if not is_fsdp(model):
        yield model
        return
    model.unshard()
    try:
        yield model
    finally:
        model.reshard()


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)


def full_state_dicts(model, optimizers):
    """
    Gathers the full (unsharded) model and optimizer state dicts of a sharded model onto rank 0's CPU, in the format
    of model.state_dict() and opt.state_dict() of the unsharded model (parameter names; optimizer state keyed by
    parameter index in param-group order), so the files match a DDP run's. Collective: every rank must call it.
    Returns (model_state, [optimizer_state, ...]) on rank 0 and ({}, [{}, ...]) on the other ranks.
    Source: torch.distributed.checkpoint.state_dict (full_state_dict=True, cpu_offload=True).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    model_state = get_model_state_dict(model, options=_options(cpu_offload=True))
    optim_states = []
    for opt in optimizers:
        osd = get_optimizer_state_dict(model, opt, options=_options(cpu_offload=True))
        if not osd:  # ranks other than 0
            optim_states.append({})
            continue
        names = [name for group in osd["param_groups"] for name in group["params"]]
        index = {name: i for i, name in enumerate(names)}
        state = {index[name]: osd["state"][name] for name in names if name in osd["state"]}
        groups = [dict(group, params=[index[name] for name in group["params"]]) for group in osd["param_groups"]]
        optim_states.append({"state": state, "param_groups": groups})
    return model_state, optim_states


def load_optimizer_states(model, optimizers, states):
    """
    Loads full optimizer state dicts (as opt.state_dict() of an unsharded model returns them, e.g. from optim.pt of a
    DDP or FSDP checkpoint; any device) into the optimizers of a sharded model: each rank keeps its shard of every
    state tensor (Muon's momentum_buffer, AdamW's exp_avg/exp_avg_sq; step and hyperparameters as saved).
    Collective: every rank must call it with the same states. Raises ValueError if the number of optimizers or of
    parameters per optimizer differs from the states.
    """
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    if len(states) != len(optimizers):
        raise ValueError(f"{len(states)} optimizer states for {len(optimizers)} optimizers")
    names_of = {p: name for name, p in model.named_parameters()}
    for opt, sd in zip(optimizers, states):
        names = [names_of[p] for group in opt.param_groups for p in group["params"]]
        if sum(len(g["params"]) for g in sd["param_groups"]) != len(names):
            raise ValueError(f"optimizer state has {sum(len(g['params']) for g in sd['param_groups'])} parameters, "
                             f"the optimizer {len(names)}")
        osd = {"state": {names[i]: v for i, v in sd["state"].items()},
               "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in sd["param_groups"]]}
        set_optimizer_state_dict(model, opt, osd, options=_options())
        for group, saved in zip(opt.param_groups, sd["param_groups"]):  # as saved: the round trip makes tuples lists
            group.update({k: v for k, v in saved.items() if k != "params"})
