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
        osft.pt                 the frozen bases of an orthogonal subspace fine-tuning stage (nanotrain.osft), if any
        rank_00000.pt ...       per-rank state: RNG states and the data loader position
        meta.json               step, settings, model config, tokens seen, the tokenizer's sha256, version, git
                                commit (written last)
    .lock                       held (fcntl.flock) by the process that trains the run: a second run of the same name
                                refuses to start while the first one runs

A checkpoint is written into step_XXXXXX.tmp/ by all ranks (every file fsynced), meta.json last (its commit marker),
and committed by rank 0 with one rename (nanotrain.durable: an existing step_XXXXXX/ goes to step_XXXXXX.old/ first
and is deleted only after the commit is durable). A kill at any instant leaves a complete copy of the newest
committed step, which every reader finds: list_checkpoints takes, per step, the newest complete copy among .tmp,
the plain name and .old, and the next save renames it into place before it writes. Everything is loaded with
torch.load(weights_only=True): no arbitrary pickle is ever executed. A checkpoint that cannot be used (a torn or
foreign file, a meta.json without the keys its reader needs, weights that do not fit its model_config) raises
CheckpointError, one line naming the file; readers skip it for an older one (load_latest, resume_checkpoint,
load_model without --step). Reading one checkpoint directory back, every file verified, is
nanotrain.checkpoint_format's job (load_checkpoint).
"""

import errno
import os
import shutil
import sys
import warnings

import torch
from torch.utils._pytree import tree_map

import nanotrain
from nanotrain.checkpoint_format import CHECKPOINT_FORMAT, MARKER, OSFT_FILE, load_checkpoint, parse_name
from nanotrain.common import all_reduce_scalar, atomic_write_json, barrier, get_base_dir, git_commit, print0
from nanotrain.durable import best_copy, commit, fsync_path, is_complete, recover, remove_dir
from nanotrain.errors import UserError
from nanotrain.fp8 import plain_tensor
from nanotrain.fsdp import full_state_dicts, is_fsdp, load_optimizer_states
from nanotrain.gpt import GPTConfig, build_model
from nanotrain.tensor_file import CheckpointError
from nanotrain.tokenizer import get_tokenizer


def step_of(path):
    """The step of a checkpoint directory path (any of its copies: step_000100, .tmp, .old). Raises ValueError."""
    parsed = parse_name(os.path.basename(path))
    if parsed is None:
        raise ValueError(f"{path} is not a checkpoint directory (step_XXXXXX)")
    return parsed[0]


class _DropsWritesOnceClosed:
    """
    The file torch.save writes a checkpoint file through: its own file's methods, except that write and seek do
    nothing once it is closed. torch's zip writer (torch._C.PyTorchFileWriter) writes the archive's end from its C++
    destructor when torch.save was interrupted before it did (a second Ctrl-C between two bytecodes of torch.save's
    exit). That destructor runs when the KeyboardInterrupt's traceback is freed, long after `with open(...)` closed
    the file; a write that raises there ("write to closed file") aborts the process (std::terminate) after the
    right line was printed. The unfinished file is deleted with its directory anyway.
    """

    def __init__(self, f):
        self.f = f

    def write(self, b):
        return len(memoryview(b)) if self.f.closed else self.f.write(b)

    def seek(self, *args):
        return 0 if self.f.closed else self.f.seek(*args)

    def __getattr__(self, name):
        return getattr(self.f, name)


def _save_tensors(obj, path):
    """torch.save(obj) to `path`, flushed and fsynced before it returns (durable before the commit marker)."""
    with open(path, "wb") as f:
        torch.save(obj, _DropsWritesOnceClosed(f))
        f.flush()
        os.fsync(f.fileno())


SAVES = {"writing": None, "written": None, "after_stop": False}  # this process's saves, for interrupted_line


def interrupted_line():
    """
    The line a training script prints when a second Ctrl-C ends it (nanotrain.common.run_script): whether the
    checkpoint of the step in progress was written, from this process's saves (SAVES) and, for a save the Ctrl-C
    broke into, the disk (a copy that reached its marker is complete: nanotrain.durable). Always names --resume=True.
    """
    writing, written = SAVES["writing"], SAVES["written"]
    head = "interrupted by a second Ctrl-C"
    if writing is not None:
        step = step_of(writing)
        if best_copy(writing, MARKER) is not None:
            return (f"{head} once step {step}'s checkpoint was written ({writing}); run again with --resume=True to "
                    f"continue from it")
        return (f"{head} while step {step}'s checkpoint was being written: it was NOT written (its unfinished files "
                f"are ignored); run again with --resume=True to continue from the previous checkpoint")
    if written is not None and SAVES["after_stop"]:
        return (f"{head} after this step's checkpoint was written (step {step_of(written)}: {written}); run again "
                f"with --resume=True to continue from it")
    newest = f"the newest one this run wrote is step {step_of(written)} ({written})" if written else \
        "this run wrote none"
    return (f"{head} before the checkpoint of the step in progress was written ({newest}); run again with "
            f"--resume=True to continue from the last checkpoint")


def _ctrl_c_in(exc):
    """True when a KeyboardInterrupt is among the exceptions `exc` was raised while handling (or from)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def _save_failed(exc, root, final, tmp, rank):
    """The one-line UserError for a checkpoint write that failed with `exc`, after removing the unfinished `tmp`."""
    try:
        free = shutil.disk_usage(root).free  # measured before the cleanup gives the space back
    except OSError:
        free = None
    if not is_complete(tmp, MARKER):  # a complete one (the commit's rename failed) is the newest copy: kept
        shutil.rmtree(tmp, ignore_errors=True)
    previous = [p for p in list_checkpoints(os.path.dirname(root)) if p != final]
    kept = f"the previous checkpoint {previous[-1]} is intact" if previous else "no earlier checkpoint exists"
    full = (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) or (free is not None and
                                                                                    free < 64 * 2**20)
    what = (f"disk full ({free / 2**20:.1f} MiB free)" if full and free is not None else "disk full" if full else
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    return UserError(f"writing the checkpoint {final} failed on rank {rank}: {what}; its unfinished files were "
                     f"removed and {kept}; free space, then run again with --resume=True")


def save_checkpoint(run_dir, step, model, optimizers, meta, rank_state, rank=0, world_size=1, keep_last=0,
                    osft_state=None):
    """
    Writes checkpoints/step_{step:06d}/ atomically. Collective under DDP and FSDP: every rank must call it.
    model: the unwrapped nn.Module (its state dict is saved by rank 0; a model sharded with FSDP2 is gathered first,
    so the file is the unsharded state dict); optimizers: list (rank 0 saves their states, gathered likewise);
    meta: JSON-serialisable dict (step, version and git commit are added); rank_state: this rank's dict of tensors and
    plain values (RNG, loader state). keep_last > 0 deletes all but the newest keep_last checkpoints. osft_state: the
    frozen bases of orthogonal subspace fine-tuning (nanotrain.osft.OSFT.state_dict), saved by rank 0 as osft.pt.
    The write is safe at every instant (nanotrain.durable): first the copies an interrupted earlier save left are
    recovered (a complete one renamed into place, incomplete ones removed), then the files go into
    step_XXXXXX.tmp/, each fsynced, meta.json last, and rank 0 commits the directory with a rename and an fsync of
    checkpoints/; older checkpoints beyond keep_last are deleted only after that. Returns the checkpoint's path.
    Raises UserError (one line: "disk full" when the filesystem is out of space) if a file cannot be written; the
    unfinished directory is then removed and the earlier checkpoints are untouched.
    """
    root = os.path.join(run_dir, "checkpoints")
    final = os.path.join(root, f"step_{step:06d}")
    tmp = final + ".tmp"
    stop = sys.modules.get("nanotrain.stop")  # looked up, not imported: importing it installs signal handlers
    after_stop = bool(stop is not None and stop.requested)
    SAVES["writing"] = final
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        for s in sorted({p[0] for p in map(parse_name, os.listdir(root)) if p is not None}):
            recover(os.path.join(root, f"step_{s:06d}"), MARKER)
        os.makedirs(tmp)
    barrier()
    if is_fsdp(model):  # collective: all ranks gather, rank 0 receives
        model_state, optim_states = full_state_dicts(model, optimizers)
    elif rank == 0:
        model_state, optim_states = model.state_dict(), [opt.state_dict() for opt in optimizers]
    try:
        _save_tensors(rank_state, os.path.join(tmp, f"rank_{rank:05d}.pt"))
        if rank == 0:  # plain tensors: --fp8 under FSDP2 wraps the fp32 weights (nanotrain.fp8.plain_tensor)
            model_state, optim_states = tree_map(plain_tensor, (model_state, optim_states))
            _save_tensors(model_state, os.path.join(tmp, "model.pt"))
            _save_tensors(optim_states, os.path.join(tmp, "optim.pt"))
            if osft_state is not None:
                _save_tensors(osft_state, os.path.join(tmp, OSFT_FILE))
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as a RuntimeError
        if _ctrl_c_in(exc):  # torch.save turns a Ctrl-C inside its file writes into a RuntimeError: still a Ctrl-C
            shutil.rmtree(tmp, ignore_errors=True)
            raise KeyboardInterrupt from None
        raise _save_failed(exc, root, final, tmp, rank) from None
    except KeyboardInterrupt:  # a second Ctrl-C: the unfinished copy goes (the previous checkpoint is intact)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier()
    if rank == 0:
        meta = dict(meta, step=step, world_size=world_size, format=CHECKPOINT_FORMAT,
                    nanotrain_version=nanotrain.__version__, git_commit=git_commit(), torch_version=torch.__version__)
        try:
            fsync_path(tmp)  # the files' directory entries, before the marker that declares them complete
            atomic_write_json(os.path.join(tmp, MARKER), meta)
            fsync_path(tmp)
            commit(tmp, final, MARKER)
        except OSError as exc:
            raise _save_failed(exc, root, final, tmp, rank) from None
        if keep_last > 0:
            for path in list_checkpoints(run_dir)[:-keep_last]:
                remove_dir(path, MARKER)
    barrier()
    SAVES.update(writing=None, written=final, after_stop=after_stop)
    return final


def load_optimizers(model, optimizers, states):
    """
    Loads the optimizer states of a checkpoint (the "optim" list of load_checkpoint) into `optimizers`, the list
    setup_optimizers(model) returned. For a model sharded with FSDP2 each rank keeps its shard of the full states
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
    `comm_device`, default `device`), with the optimizer state, tensors on `device`; rank 0 prints the path and step
    it resumes from. None (and a line on rank 0 that the run starts fresh) when run_dir has no checkpoint at all. Raises UserError when checkpoints exist but none can
    be read on some rank: resuming would silently lose the run, so the user must choose (--resume=False starts over).
    """
    paths, skipped = list_checkpoints(run_dir), []
    ckpt = load_latest(run_dir, device, rank, meta_keys=RESUME_META_KEYS, skipped=skipped)
    step = ckpt["meta"]["step"] if ckpt is not None else -1
    agreed = int(all_reduce_scalar(step, "min", comm_device or device))
    if not paths:
        print0(f"--resume=True: {run_dir} has no checkpoint yet; starting fresh")
        return None
    if agreed < 0:  # one line: the newest checkpoint's problem (on a rank that read none, else the first rank's)
        why = f" (newest: {skip_reason(skipped[0][1])})" if skipped else " on another rank"
        raise UserError(f"--resume=True: none of the {len(paths)} checkpoints in {run_dir} can be read{why}; run "
                        f"with --resume=False to start this run over from step 0")
    for path, exc in skipped:
        warnings.warn(f"skipping unreadable checkpoint {path}: {skip_reason(exc)}")
    if agreed != step:  # another rank could not read this rank's newest: take the one every rank has
        path = next(p for p in paths if step_of(p) == agreed)
        print0(f"--resume=True: resuming from {path}, the newest checkpoint every rank can read")
        ckpt = load_checkpoint(path, device, rank, meta_keys=RESUME_META_KEYS)
    else:
        print0(f"--resume=True: resuming from {ckpt['path']} (step {step})")
    return ckpt


def check_resume(ckpt, run_dir, settings, keys, world_size):
    """
    Raises UserError unless the checkpoint `ckpt` (from resume_checkpoint) was written by a run with the same
    settings[key] for every key in `keys` (settings that change what is trained: data, sizes, seeds) and the same
    world_size (each rank's loader and RNG state are saved per rank). The message names the first differing flag.
    """
    old = ckpt["meta"]["config"]
    for key in keys:
        if key not in old:
            raise UserError(f"--resume=True: the checkpoint {ckpt['path']} records no --{key} in its meta.json "
                            f"config (written by another version?); run with --resume=False to start over")
        if old[key] != settings[key]:
            raise UserError(f"--resume=True: the checkpoint in {run_dir} has {key}={old[key]!r} but this run "
                            f"has --{key}={settings[key]!r}")
    if ckpt["meta"]["world_size"] != world_size or ckpt["rank_state"] is None:
        raise UserError(f"--resume=True: the checkpoint {ckpt['path']} was written with world_size "
                        f"{ckpt['meta']['world_size']}; resume with the same number of processes ({world_size})")


def list_checkpoints(run_dir):
    """
    Paths of the complete checkpoints of a run, oldest first, one per step: of the copies a save can leave
    (step_XXXXXX.tmp, step_XXXXXX, step_XXXXXX.old; nanotrain.durable) the newest that holds its meta.json. Reads only.
    """
    root = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = sorted({p[0] for p in map(parse_name, os.listdir(root)) if p is not None})
    paths = (best_copy(os.path.join(root, f"step_{s:06d}"), MARKER) for s in steps)
    return [p for p in paths if p is not None]


# what the readers of a checkpoint take from its meta.json besides "step" and "world_size" (which save_checkpoint
# always writes): every training stage on resume, and inference (load_model)
RESUME_META_KEYS = ("config", "model_config", "tokens_seen", "train_time")
INFERENCE_META_KEYS = ("model_config",)

def skip_reason(exc):
    """One line for why a checkpoint was skipped: a CheckpointError's "<file> <problem>", else the exception's type
    and the first line of its message."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    first = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


def load_latest(run_dir, device, rank=0, load_optimizer=True, meta_keys=(), skipped=None):
    """
    The newest readable checkpoint of a run, as load_checkpoint() returns it, or None if there is none.
    A partial or corrupt checkpoint is skipped for the previous one: with a warning naming the file and what is
    wrong with it (skip_reason), or, when `skipped` is a list, appended to it as (path, exception) instead, newest
    first, for the caller to report.
    """
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return load_checkpoint(path, device, rank, load_optimizer, meta_keys)
        except Exception as e:  # anything a damaged file can raise: fall back to the previous checkpoint
            if skipped is None:
                warnings.warn(f"skipping unreadable checkpoint {path}: {skip_reason(e)}")
            else:
                skipped.append((path, e))
    return None


def find_run_dir(stage, run=""):
    """The run directory of `stage` named `run`, or (run == "") the one with the newest checkpoint; None if none."""
    stage_dir = os.path.join(get_base_dir(), stage)
    if run:
        path = os.path.join(stage_dir, run)
        return path if os.path.isdir(path) else None
    runs = [os.path.join(stage_dir, name) for name in os.listdir(stage_dir)] if os.path.isdir(stage_dir) else []
    newest = {r: os.path.getmtime(os.path.join(ckpts[-1], MARKER)) for r in runs if (ckpts := list_checkpoints(r))}
    return max(newest, key=newest.get) if newest else None  # the first of equal times, as listdir gives them


def _what(exc, base):
    """What is wrong with a skipped checkpoint, its file named relative to `base` (nanotrain.checkpoint.skip_reason
    for an error other than a CheckpointError)."""
    return f"{os.path.relpath(exc.file, base)} {exc.problem}" if isinstance(exc, CheckpointError) else skip_reason(exc)


def load_model(stage, run_name="", step=-1, device="cpu"):
    """
    Loads a checkpoint of a training stage for inference, as scripts/sample.py does: the newest run of `stage`
    ("base", "mid", "sft" or "rl") if run_name is "", and its newest checkpoint if step < 0. Returns
    (model in eval mode (fp32 weights on `device`), tokenizer, checkpoint path, meta dict).

    A checkpoint that cannot be used (nanotrain.tensor_file.CheckpointError: a missing, truncated or garbage file, a
    pickle of arbitrary objects, a meta.json without "model_config", weights that do not fit it) is handled as
    training's resume handles it: without a step, the newest readable checkpoint is loaded and one line
    `warning: ...` on stderr names every newer one skipped, what is wrong with it, and the one loaded (stderr, like
    the scripts' `checkpoint: ...` line, because stdout of sample.py and chat_cli.py is the generated text); a
    checkpoint asked for by step that cannot be used is an error, never replaced by another.
    Raises UserError (one line) if there is no such run or checkpoint, no readable checkpoint (naming the newest
    one's bad file and what is wrong), an unreadable requested step, or no tokenizer or another one than the
    model's.
    """
    if stage not in ("base", "mid", "sft", "rl"):
        raise UserError(f"--source={stage!r}: expected 'base', 'mid', 'sft' or 'rl'")
    run_dir = find_run_dir(stage, run_name)
    script = {"base": "base_train.py", "mid": "mid_train.py", "sft": "chat_sft.py", "rl": "chat_rl.py"}[stage]
    paths = list_checkpoints(run_dir) if run_dir is not None else []
    if not paths:
        where = f" for --run_name={run_name}" if run_name else ""
        raise UserError(f"no {stage} checkpoint found{where}; train one first (python scripts/{script})")
    if step >= 0:  # that checkpoint or an error, never another one
        path = next((p for p in paths if step_of(p) == step), None)
        if path is None:
            raise UserError(f"--step={step}: no such checkpoint in {run_dir}")
        try:
            ckpt = load_checkpoint(path, device, load_optimizer=False, meta_keys=INFERENCE_META_KEYS)
        except CheckpointError as e:
            raise UserError(f"cannot read the checkpoint {path}: {_what(e, path)}") from None
    else:  # the newest readable one, as a resume takes it
        skipped = []  # (path, exception) of the newer checkpoints that cannot be used, newest first
        ckpt = load_latest(run_dir, device, load_optimizer=False, meta_keys=INFERENCE_META_KEYS, skipped=skipped)
        if ckpt is None:
            path, e = skipped[0]
            n = len(skipped) - 1
            older = f" (and the {n} older checkpoint{'s' if n > 1 else ''} cannot be read either)" if n else ""
            raise UserError(f"cannot read the checkpoint {path}: {_what(e, path)}{older}")
        path = ckpt["path"]
        if skipped:
            why = "; ".join(_what(e, os.path.dirname(p)) for p, e in skipped)
            print(f"warning: loaded the older checkpoint {path}: the newer one{'s' if len(skipped) > 1 else ''} "
                  f"cannot be read: {why}", file=sys.stderr, flush=True)
    tokenizer = get_tokenizer()
    model = build_model(GPTConfig(**ckpt["meta"]["model_config"]), device, ckpt, tokenizer.get_vocab_size(),
                        tokenizer_sha256=tokenizer.fingerprint())
    return model.eval(), tokenizer, path, ckpt["meta"]
