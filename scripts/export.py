"""
Export a trained checkpoint as one safetensors file (weights + model config in its metadata; no pickle to load).

    python scripts/export.py                                   # newest sft run, newest checkpoint, fp32
    python scripts/export.py --source=base --run_name=d4 --step=400 --dtype=bfloat16 --out=/tmp/d4.safetensors

Writes <run_dir>/export/model.safetensors unless --out is given. Load it with nanotrain.export.load_safetensors.
With --verify=True (default) the written file is loaded back and its logits on a fixed token row are compared with
the checkpoint model's: identical for a float32 export, within bf16 rounding for bfloat16 (the difference is printed).
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import os

import torch

from nanotrain.checkpoint import load_model
from nanotrain.common import run_script
from nanotrain.configurator import configure
from nanotrain.errors import UserError
from nanotrain.export import export_safetensors, load_safetensors

source = "sft"  # which training stage's checkpoints: base | mid | sft | rl
run_name = ""  # run name; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
dtype = ""  # dtype of the stored weights: "" keeps the checkpoint's fp32 | float32 | bfloat16 (half the size)
out = ""  # output file; "" means <run_dir>/export/model.safetensors
verify = True  # reload the file and compare its logits on a few tokens with the checkpoint's (torch.equal for fp32)
config = configure(globals())

DTYPES = {"": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def main():

    if dtype not in DTYPES:
        raise UserError(f"--dtype={dtype!r}: expected '', 'float32' or 'bfloat16'")
    # a damaged checkpoint is one UserError line naming its file (or, without --step, an older one is used)
    model, tokenizer, ckpt_path, meta = load_model(source, run_name, step, "cpu")
    run_dir = os.path.dirname(os.path.dirname(ckpt_path))  # <run_dir>/checkpoints/step_XXXXXX
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
