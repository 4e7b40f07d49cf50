"""
The checkpoint directory's format, and reading one back with every file verified before it is used (the operations
on checkpoints, save, retention, resume and loading for inference, are nanotrain.checkpoint's): the names of a
checkpoint directory and of its copies (step_XXXXXX, .tmp, .old), its commit marker meta.json, the format number;
meta.json's keys and types, the tensor files loaded with torch.load(weights_only=True) (nanotrain.tensor_file), the
model's names and shapes against its model_config, the optimizer, rank and OSFT files. A checkpoint that cannot be
used raises CheckpointError, one line naming the file, so that readers can fall back to an older one.
"""

import dataclasses
import json
import os

import torch

from nanotrain.gpt import GPT, GPTConfig
from nanotrain.tensor_file import CheckpointError, load_tensor_file

CHECKPOINT_FORMAT = 2  # 2: the model gained value embeddings, smear, backout and x0/resid lambdas
OSFT_FILE = "osft.pt"  # the frozen bases of an OSFT stage (nanotrain.osft), when it has them
MARKER = "meta.json"  # written last into a checkpoint directory: a directory holding it is complete


def parse_name(name):
    """(step, suffix) of a checkpoint directory name "step_000100" + ("", ".tmp" or ".old"), else None."""
    stem, dot, ext = name.partition(".")
    if not (stem.startswith("step_") and stem[5:].isdigit() and (not dot or ext in ("tmp", "old"))):
        return None
    return int(stem[5:]), dot + ext


def _check_meta(meta_file, meta, meta_keys):
    """Raises CheckpointError unless `meta` (a loaded meta.json) is an object with the keys a reader needs."""
    if not isinstance(meta, dict):
        raise CheckpointError(meta_file, f"holds a JSON {type(meta).__name__}, not an object")
    missing = [k for k in ("step", "world_size", *meta_keys) if k not in meta]
    if missing:
        raise CheckpointError(meta_file, f"lacks the key{'s' if len(missing) > 1 else ''} "
                                         f"{', '.join(repr(k) for k in missing)}")
    for key, least in (("step", 0), ("world_size", 1)):
        if type(meta[key]) is not int or meta[key] < least:
            raise CheckpointError(meta_file, f"has {key}={meta[key]!r}; expected an int >= {least}")
    if meta.get("format", 1) != CHECKPOINT_FORMAT:
        raise CheckpointError(meta_file, f"is checkpoint format {meta.get('format', 1)!r}, written by another version "
                                         f"of nanotrain (this one reads format {CHECKPOINT_FORMAT}: format 1 predates "
                                         f"the model's value embeddings, smear, backout and lambdas); train it again")
    name = os.path.basename(os.path.dirname(meta_file))
    parsed = parse_name(name)
    if parsed is not None and parsed[0] != meta["step"]:
        raise CheckpointError(meta_file, f"has step={meta['step']} but is in the directory {name}")
    if "config" in meta and not isinstance(meta["config"], dict):
        raise CheckpointError(meta_file, f"has \"config\" {str(meta['config'])[:80]!r}; expected an object")
    for key in ("tokens_seen", "train_time"):
        if key in meta and (type(meta[key]) not in (int, float) or meta[key] < 0):
            raise CheckpointError(meta_file, f"has {key}={meta[key]!r}; expected a number >= 0")
    if "model_config" in meta:  # the sizes every checkpoint has recorded; GPTConfig fields added later may be absent
        required = ("max_seq_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "model_dim")
        fields = {f.name for f in dataclasses.fields(GPTConfig)}
        mc = meta["model_config"]
        if not (isinstance(mc, dict) and set(required) <= set(mc) <= fields
                and all(type(mc[k]) is int and mc[k] >= 1 for k in required)):
            raise CheckpointError(meta_file, f"has \"model_config\" {str(mc)[:400]}; expected an object of the "
                                             f"ints >= 1 {', '.join(required)}")


def _check_model_state(model_file, state, meta_file, meta):
    """
    Raises CheckpointError unless `state` (model.pt) is a non-empty dict of named tensors and, when `meta` has a
    model_config, holds exactly the names and shapes of that GPT (compared on the meta device: no memory).
    """
    if not isinstance(state, dict) or not state:
        what = "an empty dict" if isinstance(state, dict) else f"a {type(state).__name__}"
        raise CheckpointError(model_file, f"holds {what}, not the model's weights (a state dict of tensors)")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if bad:
        raise CheckpointError(model_file, f"is not a state dict of tensors (entry {str(bad[0])[:80]!r} is "
                                          f"a {type(state[bad[0]]).__name__})")
    if "model_config" not in meta:
        return
    try:
        with torch.device("meta"):
            expected = GPT(GPTConfig(**meta["model_config"])).state_dict()
    except Exception as exc:
        raise CheckpointError(meta_file, f"has a \"model_config\" that makes no model ({type(exc).__name__}: "
                                         f"{str(exc)[:200]})") from None
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or wrong:
        parts = [f"{len(v)} {what} (e.g. {v[0]})" for v, what in ((missing, "missing"), (unexpected, "unexpected"),
                                                                    (wrong, "of the wrong shape")) if v]
        raise CheckpointError(model_file, f"does not fit the model_config of {meta_file}: {len(state)} tensors, "
                                          f"{', '.join(parts)}")


def load_checkpoint(path, device, rank=0, load_optimizer=True, meta_keys=()):
    """
    Loads one checkpoint directory. Returns {"meta", "model", "optim" (or None), "rank_state" (or None), "osft" (the
    OSFT bases of osft.pt, loaded with the optimizer state; None without), "path"},
    tensors mapped to `device` (rank state stays on the CPU). rank_state is None when the checkpoint was written by
    fewer than rank + 1 processes; with load_optimizer (a resume) a missing rank file of a rank that did write is an
    incomplete checkpoint. meta_keys: the keys of meta.json the caller needs besides "step" and "world_size"
    (RESUME_META_KEYS, INFERENCE_META_KEYS).
    Raises CheckpointError (a UserError: one line naming the file and what is wrong) if the checkpoint cannot be
    used: meta.json missing, not a JSON object, without one of those keys, or with a step other than its directory's
    or a malformed model_config; a .pt file missing, damaged or holding arbitrary Python objects (load_tensor_file);
    model.pt not a non-empty state dict of tensors, or (with a model_config) not the names and shapes of that GPT;
    optim.pt not a list, a rank file not a dict; with load_optimizer, osft.pt missing from a run whose config has
    osft_rank_ratio > 0, or not the OSFT state. So every reader (resume, inference) treats a checkpoint with a bad
    meta.json or bad weights like a torn one, and can fall back to an older checkpoint.
    """
    meta_file = os.path.join(path, "meta.json")
    try:
        with open(meta_file, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(meta_file, "is missing") from None
    except OSError as exc:
        raise CheckpointError(meta_file, f"cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(meta_file, f"is not valid JSON ({str(exc).splitlines()[0][:200]})") from None
    _check_meta(meta_file, meta, meta_keys)
    model_file = os.path.join(path, "model.pt")
    model = load_tensor_file(model_file, device)
    _check_model_state(model_file, model, meta_file, meta)
    optim = None
    if load_optimizer:
        optim_file = os.path.join(path, "optim.pt")
        optim = load_tensor_file(optim_file, device)
        if not isinstance(optim, list):
            raise CheckpointError(optim_file, f"holds a {type(optim).__name__}, not the list of optimizer states")
    rank_file = os.path.join(path, f"rank_{rank:05d}.pt")
    if load_optimizer and rank < meta["world_size"] and not os.path.exists(rank_file):
        raise CheckpointError(rank_file, "is missing")
    rank_state = None
    if os.path.exists(rank_file):
        rank_state = load_tensor_file(rank_file, "cpu")
        if not isinstance(rank_state, dict):
            raise CheckpointError(rank_file, f"holds a {type(rank_state).__name__}, not this rank's state (a dict)")
    osft = None
    osft_file = os.path.join(path, OSFT_FILE)
    config = meta.get("config") or {}
    needs_osft = isinstance(config.get("osft_rank_ratio"), (int, float)) and config["osft_rank_ratio"] > 0
    if load_optimizer and needs_osft and not os.path.exists(osft_file):
        raise CheckpointError(osft_file, "is missing (the run trains with --osft_rank_ratio > 0)")
    if load_optimizer and os.path.exists(osft_file):
        osft = load_tensor_file(osft_file, device)
        if not isinstance(osft, dict) or not isinstance(osft.get("bases"), dict):
            raise CheckpointError(osft_file, "is not the OSFT state (a dict with the bases)")
    return {"meta": meta, "model": model, "optim": optim, "rank_state": rank_state, "osft": osft, "path": path}
