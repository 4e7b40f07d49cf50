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
        meta.json               step, settings, model config, tokens seen, the tokenizer's sha256, version, git
                                commit (written last)
    .lock                       held (fcntl.flock) by the process that trains the run: a second run of the same name
                                refuses to start while the first one runs

A checkpoint is written into step_XXXXXX.tmp/ by all ranks and renamed by rank 0 once every file is in place, so a
directory named step_XXXXXX/ with a meta.json is always complete. Everything is loaded with
torch.load(weights_only=True): no arbitrary pickle is ever executed.
"""

import errno
import json
import os
import shutil
import socket
import sys
import time
import warnings

import torch

import nanotrain
from nanotrain.common import (
    UserError,
    all_reduce_scalar,
    any_rank,
    atomic_write_json,
    barrier,
    get_base_dir,
    git_commit,
    print0,
)
from nanotrain.fsdp import full_state_dicts, is_fsdp, load_optimizer_states

try:  # POSIX (Linux, macOS); elsewhere runs are not locked
    import fcntl
except ImportError:
    fcntl = None

CHECKPOINT_FORMAT = 1
LOCK_FILE = ".lock"
_held_locks = {}  # real path of a run directory -> the open lock file this process holds until it exits


def get_run_dir(stage, run):
    """<base_dir>/<stage>/<run>, created if missing. stage is "base", "mid" or "sft"."""
    path = os.path.join(get_base_dir(), stage, run)
    os.makedirs(path, exist_ok=True)
    return path


def lock_run_dir(run_dir, device, rank=0):
    """
    Makes this process the only writer of `run_dir` until it exits: rank 0 takes an exclusive fcntl.flock on
    <run_dir>/.lock and writes its pid, host, start time and command line into it. The kernel releases the lock
    however the process ends (SIGKILL included), so a finished or killed run never blocks the next one. Collective
    under DDP (every rank calls it; `device` carries the agreement). Taking it again in the same process is a no-op.
    Raises UserError naming the holder (pid, host, start, command) when another process holds the lock.
    """
    key = os.path.realpath(run_dir)
    taken, holder = True, ""
    if rank == 0 and fcntl is not None and key not in _held_locks:
        f = open(os.path.join(run_dir, LOCK_FILE), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            taken = False
        else:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                    f"{' '.join(sys.argv)}\n")
            f.flush()
            _held_locks[key] = f
    if any_rank(not taken, device):
        raise UserError(f"the run directory {run_dir} is in use by {holder or 'another process'}; wait for it to "
                        f"end or choose another --run_name")


def _free_bytes(path):
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _save_failed(exc, root, final, tmp, rank):
    """The one-line UserError for a checkpoint write that failed with `exc`, after removing the unfinished `tmp`."""
    free = _free_bytes(root)  # measured before the cleanup gives the space back
    shutil.rmtree(tmp, ignore_errors=True)
    previous = [p for p in list_checkpoints(os.path.dirname(root)) if p != final]
    kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
    full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or (free is not None and
                                                                                    free < 64 * 2**20)
    what = (f"disk full ({free / 2**20:.1f} MiB free)" if full and free is not None else "disk full" if full else
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return UserError(f"writing the checkpoint {final} failed on rank {rank}: {what}; its unfinished files were "
                     f"removed and {kept}; free space, then run again with --resume=True")


def save_checkpoint(run_dir, step, model, optimizers, meta, rank_state, rank=0, world_size=1, keep_last=0):
    """
    Writes checkpoints/step_{step:06d}/ atomically. Collective under DDP and FSDP: every rank must call it.
    model: the unwrapped nn.Module (its state dict is saved by rank 0; a model sharded with FSDP2 is gathered first,
    so the file is the unsharded state dict); optimizers: list (rank 0 saves their states, gathered likewise);
    meta: JSON-serialisable dict (step, version and git commit are added); rank_state: this rank's dict of tensors and
    plain values (RNG, loader state). keep_last > 0 deletes all but the newest keep_last checkpoints.
    Unfinished directories of earlier writes (step_*.tmp, left by a killed run) are removed first. Returns the
    checkpoint's path. Raises UserError (one line: "disk full" when the filesystem is out of space) if a file cannot
    be written; the unfinished directory is then removed and the earlier checkpoints are untouched.
    """
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for name in os.listdir(root):
            if name.endswith((".tmp", ".old")):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        os.makedirs(tmp)
    barrier()
    if is_fsdp(model):  # collective: all ranks gather, rank 0 receives
        model_state, optim_states = full_state_dicts(model, optimizers)
    elif rank == 0:
        model_state, optim_states = model.state_dict(), [opt.state_dict() for opt in optimizers]
    try:
        torch.save(rank_state, os.path.join(tmp, f"rank_{rank:05d}.pt"))
        if rank == 0:
            torch.save(model_state, os.path.join(tmp, "model.pt"))
            torch.save(optim_states, os.path.join(tmp, "optim.pt"))
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as a RuntimeError
        raise _save_failed(exc, root, final, tmp, rank) from None
    barrier()
    if rank == 0:
        meta = dict(meta, step=step, world_size=world_size, format=CHECKPOINT_FORMAT,
                    nanotrain_version=nanotrain.__version__, git_commit=git_commit(), torch_version=torch.__version__)
        try:
            atomic_write_json(os.path.join(tmp, "meta.json"), meta)
        except OSError as exc:
            raise _save_failed(exc, root, final, tmp, rank) from None
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
    (collective; nanotrain.fsdp.load_optimizer_states), else opt.load_state_dict. The learning rates and weight decay
    of this run's flags win over the checkpoint's: every param group keeps the "initial_lr" and "weight_decay" that
    setup_optimizers gave it (a loaded state dict would bring the saved ones back). Returns the list of changes as
    readable strings ("AdamW group 0: initial_lr 0.004 -> 0.002"), empty when the flags are unchanged.
    Raises ValueError on a count mismatch.
    """
    if len(states) != len(optimizers):
        raise ValueError(f"the checkpoint has {len(states)} optimizer states, the model {len(optimizers)} optimizers")
    fresh = [[{k: g[k] for k in ("initial_lr", "weight_decay") if k in g} for g in opt.param_groups]
             for opt in optimizers]
    if is_fsdp(model):
        load_optimizer_states(model, optimizers, states)
    else:
        for opt, state in zip(optimizers, states):
            opt.load_state_dict(state)
    changes = []
    for opt, groups in zip(optimizers, fresh):
        for i, (group, want) in enumerate(zip(opt.param_groups, groups)):
            for k, v in want.items():
                if group.get(k) != v:
                    changes.append(f"{type(opt).__name__} group {i}: {k} {group.get(k):.6g} -> {v:.6g}")
                    group[k] = v
    return changes


def resume_checkpoint(run_dir, device, rank=0, comm_device=None):
    """
    The checkpoint a --resume=True run continues from: the newest checkpoint of run_dir that every rank can read
    (load_latest on each rank, then the ranks agree on the oldest of their choices: collective under DDP over
    `comm_device`, default `device`), with the optimizer state, tensors on `device`. None (and a line on rank 0 that
    the run starts fresh) when run_dir has no checkpoint at all. Raises UserError when checkpoints exist but none can
    be read on some rank: resuming would silently lose the run, so the user must choose (--resume=False starts over).
    """
    paths = list_checkpoints(run_dir)
    ckpt = load_latest(run_dir, device, rank)
    step = ckpt["meta"]["step"] if ckpt is not None else -1
    agreed = int(all_reduce_scalar(step, "min", comm_device or device))
    if not paths:
        print0(f"--resume=True: {run_dir} has no checkpoint yet; starting fresh")
        return None
    if agreed < 0:
        raise UserError(f"--resume=True: none of the {len(paths)} checkpoints in {run_dir} can be read (see the "
                        f"warnings above); run with --resume=False to start this run over from step 0")
    if agreed != step:  # another rank could not read this rank's newest: take the one every rank has
        path = next(p for p in paths if p.endswith(f"step_{agreed:06d}"))
        print0(f"--resume=True: resuming from {path}, the newest checkpoint every rank can read")
        ckpt = load_checkpoint(path, device, rank)
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
    mapped to `device` (rank state stays on the CPU). rank_state is None when the checkpoint was written by fewer
    than rank + 1 processes; with load_optimizer (a resume) a missing rank file of a rank that did write is an
    incomplete checkpoint. Raises ValueError/RuntimeError/OSError (FileNotFoundError for a missing file) if it is
    unreadable.
    """
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    model = torch.load(os.path.join(path, "model.pt"), map_location=device, weights_only=True)
    optim = None
    if load_optimizer:
        optim = torch.load(os.path.join(path, "optim.pt"), map_location=device, weights_only=True)
    rank_file = os.path.join(path, f"rank_{rank:05d}.pt")
    if load_optimizer and rank < meta.get("world_size", 1) and not os.path.exists(rank_file):
        raise FileNotFoundError(f"{rank_file} is missing")
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
