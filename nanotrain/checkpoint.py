"""
Checkpoints: atomic save, load, resume, retention.

Layout of a run directory (<base_dir>/<stage>/<run>/):
    config.json                 the run's final settings
    metrics.jsonl               one JSON object per line (training steps and evaluations)
    checkpoints/step_000100/    one complete checkpoint:
        model.pt                model state dict (fp32 tensors)
        optim.pt                list of optimizer state dicts (identical on every rank under DDP; saved by rank 0)
                                (under FSDP2 the shards are gathered first: the files are the same in both modes,
                                so a run can resume with or without --fsdp; nanotrain.fsdp)
        rank_00000.pt ...       per-rank state: RNG states and the data loader position
        meta.json               step, settings, model config, tokens seen, version, git commit (written last)

A checkpoint is written into step_XXXXXX.tmp/ by all ranks and renamed by rank 0 once every file is in place, so a
directory named step_XXXXXX/ with a meta.json is always complete. Everything is loaded with
torch.load(weights_only=True): no arbitrary pickle is ever executed.
"""

import json
import os
import shutil
import warnings

import torch

import nanotrain
from nanotrain.common import UserError, atomic_write_json, barrier, get_base_dir, git_commit, print0
from nanotrain.fsdp import full_state_dicts, is_fsdp, load_optimizer_states

CHECKPOINT_FORMAT = 1


def get_run_dir(stage, run):
    """<base_dir>/<stage>/<run>, created if missing. stage is "base", "mid" or "sft"."""
    path = os.path.join(get_base_dir(), stage, run)
    os.makedirs(path, exist_ok=True)
    return path


def save_checkpoint(run_dir, step, model, optimizers, meta, rank_state, rank=0, world_size=1, keep_last=0):
    """
    Writes checkpoints/step_{step:06d}/ atomically. Collective under DDP and FSDP: every rank must call it.
    model: the unwrapped nn.Module (its state dict is saved by rank 0; a model sharded with FSDP2 is gathered first,
    so the file is the unsharded state dict); optimizers: list (rank 0 saves their states, gathered likewise);
    meta: JSON-serialisable dict (step, version and git commit are added); rank_state: this rank's dict of tensors and
    plain values (RNG, loader state). keep_last > 0 deletes all but the newest keep_last checkpoints.
    Returns the checkpoint's path.
    """
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    torch.save(rank_state, os.path.join(tmp, f"rank_{rank:05d}.pt"))
    if is_fsdp(model):  # collective: all ranks gather, rank 0 receives
        model_state, optim_states = full_state_dicts(model, optimizers)
    elif rank == 0:
        model_state, optim_states = model.state_dict(), [opt.state_dict() for opt in optimizers]
    if rank == 0:
        torch.save(model_state, os.path.join(tmp, "model.pt"))
        torch.save(optim_states, os.path.join(tmp, "optim.pt"))
    barrier()
    if rank == 0:
        meta = dict(meta, step=step, world_size=world_size, format=CHECKPOINT_FORMAT,
                    nanotrain_version=nanotrain.__version__, git_commit=git_commit(), torch_version=torch.__version__)
        atomic_write_json(os.path.join(tmp, "meta.json"), meta)
        if os.path.exists(final):  # saving the same step again (e.g. a resumed run that stops at once)
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        if keep_last > 0:
            for path in list_checkpoints(run_dir)[:-keep_last]:
                shutil.rmtree(path, ignore_errors=True)
    barrier()
    return final


def load_optimizers(model, optimizers, states):
    """
    Loads the optimizer states of a checkpoint (the "optim" list of load_checkpoint) into `optimizers`, the list
    model.setup_optimizers() returned. For a model sharded with FSDP2 each rank keeps its shard of the full states
    (collective; nanotrain.fsdp.load_optimizer_states), else opt.load_state_dict. Raises ValueError on a count mismatch.
    """
    if len(states) != len(optimizers):
        raise ValueError(f"the checkpoint has {len(states)} optimizer states, the model {len(optimizers)} optimizers")
    if is_fsdp(model):
        load_optimizer_states(model, optimizers, states)
        return
    for opt, state in zip(optimizers, states):
        opt.load_state_dict(state)


def resume_checkpoint(run_dir, device, rank=0):
    """
    The checkpoint a --resume=True run continues from: load_latest(run_dir, device, rank) with the optimizer state,
    or None (and a warning on rank 0 that the run starts fresh) when run_dir has no complete checkpoint.
    """
    ckpt = load_latest(run_dir, device, rank)
    if ckpt is None:
        print0(f"warning: --resume=True but {run_dir} has no complete checkpoint; starting fresh")
    return ckpt


def check_resume(ckpt, run_dir, settings, keys, world_size):
    """
    Raises UserError unless the checkpoint `ckpt` (from resume_checkpoint) was written by a run with the same
    settings[key] for every key in `keys` (settings that change what is trained: data, sizes, seeds) and the same
    world_size (each rank's loader and RNG state are saved per rank). The message names the first differing flag.
    """
    old = ckpt["meta"]["config"]
    for key in keys:
        if old[key] != settings[key]:
            raise UserError(f"--resume=True: the checkpoint in {run_dir} has {key}={old[key]!r} but this run "
                            f"has --{key}={settings[key]!r}")
    if ckpt["meta"]["world_size"] != world_size or ckpt["rank_state"] is None:
        raise UserError(f"--resume=True: the checkpoint {ckpt['path']} was written with world_size "
                        f"{ckpt['meta']['world_size']}; resume with the same number of processes ({world_size})")


def list_checkpoints(run_dir):
    """Paths of the complete checkpoints of a run (a step_XXXXXX/ directory with a meta.json), oldest first."""
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith("step_") and name[5:].isdigit() and os.path.exists(os.path.join(path, "meta.json")):
            out.append((int(name[5:]), path))
    return [p for _, p in sorted(out)]


def load_checkpoint(path, device, rank=0, load_optimizer=True):
    """
    Loads one checkpoint directory. Returns {"meta", "model", "optim" (or None), "rank_state" (or None)}, tensors
    mapped to `device` (rank state stays on the CPU). Raises ValueError/RuntimeError/OSError if it is unreadable.
    """
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    model = torch.load(os.path.join(path, "model.pt"), map_location=device, weights_only=True)
    optim = None
    if load_optimizer:
        optim = torch.load(os.path.join(path, "optim.pt"), map_location=device, weights_only=True)
    rank_file = os.path.join(path, f"rank_{rank:05d}.pt")
    rank_state = torch.load(rank_file, map_location="cpu", weights_only=True) if os.path.exists(rank_file) else None
    return {"meta": meta, "model": model, "optim": optim, "rank_state": rank_state, "path": path}


def load_latest(run_dir, device, rank=0, load_optimizer=True):
    """
    The newest readable checkpoint of a run, as load_checkpoint() returns it, or None if there is none.
    A partial or corrupt checkpoint is skipped with a warning and the previous one is used.
    """
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return load_checkpoint(path, device, rank, load_optimizer)
        except Exception as e:  # corrupt file: fall back to the previous checkpoint
            warnings.warn(f"skipping unreadable checkpoint {path}: {type(e).__name__}: {str(e)[:200]}")
    return None


def find_run_dir(stage, run=""):
    """The run directory of `stage` named `run`, or (run == "") the one with the newest checkpoint; None if none."""
    stage_dir = os.path.join(get_base_dir(), stage)
    if run:
        path = os.path.join(stage_dir, run)
        return path if os.path.isdir(path) else None
    best = None
    if os.path.isdir(stage_dir):
        for name in os.listdir(stage_dir):
            ckpts = list_checkpoints(os.path.join(stage_dir, name))
            if ckpts:
                t = os.path.getmtime(os.path.join(ckpts[-1], "meta.json"))
                if best is None or t > best[0]:
                    best = (t, os.path.join(stage_dir, name))
    return best[1] if best else None
