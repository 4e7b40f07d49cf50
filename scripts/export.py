"""
Export a trained checkpoint as one safetensors file (weights + model config in its metadata; no pickle to load), or
with --format=hf as a Hugging Face transformers directory (model, tokenizer, chat template; nanotrain.export.hf).

    python scripts/export.py                                   # newest sft run, newest checkpoint, fp32
    python scripts/export.py --source=base --run_name=d4 --step=400 --dtype=bfloat16 --out=/tmp/d4.safetensors
    python scripts/export.py --format=hf --out=/tmp/d4-hf       # needs transformers + tokenizers

Writes <run_dir>/export/model.safetensors (--format=hf: the directory <run_dir>/export/hf) unless --out is given.
Load the file with nanotrain.export.safetensors_file.load_safetensors; the directory with
AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) and AutoTokenizer.from_pretrained(dir).
With --verify=True (default) the export is loaded back and its logits on a fixed token row are compared with the
checkpoint model's: identical for a float32 safetensors export, within 1e-5 for a float32 hf export (another
implementation of the same maths), within bf16 rounding for bfloat16 (the difference is printed); an hf export also
checks that its tokenizer encodes a probe text to the project's ids. A checkpoint trained with smear, backout or
x0_lambdas has no hf export (one line naming the option); --format=safetensors exports it.
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import os

import torch

from nanotrain.checkpoint import load_model
from nanotrain.common import run_script
from nanotrain.configurator import configure
from nanotrain.errors import UserError
from nanotrain.export.hf import export_hf, require_transformers
from nanotrain.export.safetensors_file import export_safetensors, load_safetensors

format = "safetensors"  # safetensors (one file, this project's loader) | hf (a transformers directory)
source = "sft"  # which training stage's checkpoints: base | mid | sft | rl
run_name = ""  # run name; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
dtype = ""  # dtype of the stored weights: "" keeps the checkpoint's fp32 | float32 | bfloat16 (half the size)
out = ""  # output file (hf: directory); "" means <run_dir>/export/model.safetensors (hf: <run_dir>/export/hf)
verify = True  # reload the file and compare its logits on a few tokens with the checkpoint's (torch.equal for fp32)
config = configure(globals())

DTYPES = {"": None, "float32": torch.float32, "bfloat16": torch.bfloat16}
HF_TOLERANCE = 1e-5  # fp32 logits of the transformers model against the checkpoint's
PROBE_TEXT = "Hello, world! It's 2024.\n\n  naïve café 日本語 x=12345; ok?\r\n\tend  "


def export_hf_dir(model, tokenizer, run_dir, ckpt_path):
    """--format=hf: writes the transformers directory and, with --verify, loads it back through the Auto classes
    (offline: a local directory) and compares logits and the tokenizer's ids. Raises UserError on a mismatch."""
    path = out or os.path.join(run_dir, "export", "hf")
    export_hf(model, tokenizer, path, dtype=DTYPES[dtype])
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"exported {ckpt_path} -> {path} (transformers directory, {model.num_params():,} params, {dtype or 'float32'}, "
          f"{size / 2**20:.1f} MiB)")
    if not verify:
        return
    from transformers import AutoModelForCausalLM, AutoTokenizer
    reloaded = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
    idx = torch.arange(min(16, model.config.max_seq_len))[None] % model.config.vocab_size
    with torch.no_grad():
        a, b = model(idx), reloaded(idx).logits
    diff = (a - b).abs().max().item()
    if DTYPES[dtype] in (None, torch.float32) and not diff <= HF_TOLERANCE:
        raise UserError(f"{path}: the transformers model's logits differ from the checkpoint's by {diff:.3g} "
                        f"(> {HF_TOLERANCE})")
    ids = hf_tok(PROBE_TEXT, add_special_tokens=False)["input_ids"]
    if ids != tokenizer.encode(PROBE_TEXT):
        raise UserError(f"{path}: the exported tokenizer encodes a probe text differently from the project's")
    print(f"verified: transformers logits within {diff:.3g} on {idx.size(1)} tokens, tokenizer ids equal")


def main():

    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r}: expected '', 'float32' or 'bfloat16'")
    if format not in ("safetensors", "hf"):
        raise UserError(f"--format={format!r}: expected 'safetensors' or 'hf'")
    if format == "hf":
        require_transformers()  # before the checkpoint is loaded: one line saying what to install
    # a damaged checkpoint is one UserError line naming its file (or, without --step, an older one is used)
    model, tokenizer, ckpt_path, meta = load_model(source, run_name, step, "cpu")
    run_dir = os.path.dirname(os.path.dirname(ckpt_path))  # <run_dir>/checkpoints/step_XXXXXX
    if format == "hf":
        return export_hf_dir(model, tokenizer, run_dir, ckpt_path)
    path = out or os.path.join(run_dir, "export", "model.safetensors")
    extra = {"tokenizer_sha256": tokenizer.fingerprint(), "source_checkpoint": ckpt_path,
             "source_stage": source, "step": meta.get("step", ""), "git_commit": meta.get("git_commit") or ""}
    export_safetensors(model, model.config, path, dtype=DTYPES[dtype], metadata=extra)
    size = os.path.getsize(path)
    print(f"exported {ckpt_path} -> {path} ({model.num_params():,} params, {dtype or 'float32'}, "
          f"{size / 2**20:.1f} MiB)")
    if verify:
        reloaded, _ = load_safetensors(path)
        idx = torch.arange(min(16, model.config.max_seq_len))[None] % model.config.vocab_size
        with torch.no_grad():
            a, b = model(idx), reloaded(idx)
        diff = (a - b).abs().max().item()
        if DTYPES[dtype] in (None, torch.float32) and not torch.equal(a, b):
            raise UserError(f"{path}: the reloaded model's logits differ from the checkpoint's by {diff:.3g}")
        print(f"verified: reloaded logits {'equal' if diff == 0 else f'within {diff:.3g}'} on {idx.size(1)} tokens")


if __name__ == "__main__":
    run_script(main)
