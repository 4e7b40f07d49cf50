"""
Export a trained GPT as one safetensors file and load it back.

safetensors (Hugging Face, https://github.com/huggingface/safetensors): an 8-byte header length, a JSON header (name,
dtype, shape and byte range of every tensor, plus a free "__metadata__" dict of strings), then the raw little-endian
tensor bytes. Loading it runs no pickle, unlike torch.save's model.pt. The file holds the model's state dict under
nanotrain's own parameter names (wte.weight, blocks.{i}.attn.c_q.weight, ..., lm_head.weight; nn.Linear's
(out_features, in_features) layout, untied wte and lm_head) and this metadata (all strings):
    format            "nanotrain-gpt"
    model_config      JSON of the GPTConfig fields
    dtype             the stored dtype of the floating tensors ("float32" or "bfloat16")
    nanotrain_version nanotrain.__version__ of the exporter
    plus the caller's extra entries (scripts/export.py adds tokenizer_sha256 and source_checkpoint).
"""

import json
import os
import re

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import nanotrain
from nanotrain.errors import UserError, replacing
from nanotrain.gpt import GPT, GPTConfig, build_model

FORMAT = "nanotrain-gpt-2"  # 2: value embeddings, smear, backout, lambdas in the model
WRAPPER_PREFIXES = re.compile(r"^(?:_orig_mod\.|module\.)+")  # torch.compile's OptimizedModule, DistributedDataParallel


def clean_state_dict(state_dict):
    """
    The state dict with the wrapper prefixes of torch.compile ("_orig_mod.") and DDP ("module.") removed from the
    front of every key, in any order and nesting (DDP(compile(model)) gives "module._orig_mod."). Values unchanged.
    """
    return {WRAPPER_PREFIXES.sub("", key): value for key, value in state_dict.items()}


def export_safetensors(model_or_state_dict, model_config, path, dtype=None, metadata=None):
    """
    Writes `path` (e.g. <run_dir>/export/model.safetensors) atomically: a temporary file in the same directory, then
    os.replace, so a reader never sees a partial file. model_or_state_dict: a GPT (possibly wrapped by torch.compile
    and/or DDP) or its state dict (prefixes "_orig_mod." / "module." are stripped); tensors may live on any device
    and are written from the CPU, contiguous. model_config: the GPTConfig (or its dict). dtype: None keeps the
    tensors' dtype (fp32 master weights), torch.bfloat16 halves the file (floating tensors only). metadata: optional
    dict of extra str -> str entries. Raises UserError if the state dict's names or shapes are not those of
    GPT(model_config), and an OSError naming `path` when the file cannot be written (safetensors reports a full disk
    as a SafetensorError carrying the system's error number; it is raised as that OSError); no temporary file is
    left. Returns the path.
    """
    config = dict(model_config) if isinstance(model_config, dict) else dict(vars(model_config))
    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) \
        else model_or_state_dict
    state = clean_state_dict(state)
    with torch.device("meta"):
        expected = GPT(GPTConfig(**config)).state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != tuple(expected[k].shape)]
    if missing or unexpected or wrong:
        raise UserError(f"cannot export to {path}: the weights do not match the model config {config} (missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}, wrong shape {wrong[:3]})")
    cast = lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t
    tensors = {key: cast(t.detach().to("cpu")).contiguous() for key, t in state.items()}
    stored = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()})
    meta = {"format": FORMAT, "model_config": json.dumps(config, sort_keys=True), "dtype": ",".join(stored),
            "nanotrain_version": nanotrain.__version__}
    meta.update({str(k): str(v) for k, v in (metadata or {}).items()})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replacing(path) as tmp:
        try:
            save_file(tensors, tmp, metadata=meta)
        except SafetensorError as exc:  # "... I/O error: No space left on device (os error 28)"
            code = re.search(r"\(os error (\d+)\)", str(exc))
            if code is None:
                raise
            raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), path) from exc
    return path


def read_metadata(path):
    """The "__metadata__" dict (str -> str) of a safetensors file. Raises UserError naming the file if it is missing
    or not a readable safetensors file."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file (export one with python scripts/export.py)")
    try:
        with safe_open(path, framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as exc:  # safetensors raises its own SafetensorError (header, size) or OSError
        raise UserError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc}); export it "
                        f"again") from None


def load_safetensors(path, device="cpu"):
    """
    Rebuilds the GPT from a file written by export_safetensors. Returns (model, config): model in eval mode with
    fp32 weights on `device` (a bfloat16 export is upcast exactly, so its values are the bf16-rounded weights), its
    rotary buffers recomputed; config the GPTConfig from the metadata. Raises UserError naming the file if it is
    missing, not a safetensors file, truncated, not a nanotrain export, or its tensors do not fit the config.
    """
    meta = read_metadata(path)
    if meta.get("format") != FORMAT or "model_config" not in meta:
        raise UserError(f"{path}: not a nanotrain export (metadata format={meta.get('format')!r}, expected "
                        f"{FORMAT!r} with a model_config)")
    try:
        config = GPTConfig(**json.loads(meta["model_config"]))
        with safe_open(path, framework="pt", device="cpu") as f:
            state = {key: f.get_tensor(key) for key in f.keys()}
        model = build_model(config, device, {"model": state})  # load_state_dict is strict
    except UserError as exc:
        raise UserError(f"{path}: {exc}") from None
    except Exception as exc:  # bad JSON, truncated data, names or shapes that do not fit the config
        raise UserError(f"{path}: cannot load the model ({type(exc).__name__}: {str(exc)[:300]}); export it "
                        f"again") from None
    return model.eval(), config
