"""
Benchmark of automatic device batch size: tokens/s of the same training (same model, same total batch, same data)
at a manual small device_batch_size and at the one auto-discovery finds, on this machine. Prints one JSON object.

    python dev/bench_auto_batch.py --depth=4 --max_seq_len=128 --total_batch_size=4096 --device_memory_gb=2

Synthetic tokens (no tokenizer or dataset needed); each setting builds the model from the same seed, runs one
untimed warm-up step and `steps` timed optimizer steps with nanotrain.training's forward_backward / optimizer_step
(the code base_train runs). The first step's loss is reported for both settings: only grad_accum_steps changes, so
the losses agree to float rounding.
"""

import json
import sys
import time

import torch

from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.search import discover_device_batch_size
from nanotrain.common import autodetect_device_type, run_script, synchronize
from nanotrain.configurator import configure
from nanotrain.errors import UserError
from nanotrain.gpt import config_from_depth
from nanotrain.training import forward_backward, micro_batches, optimizer_step, precision

depth = 4  # model depth (model_dim = 64 * depth)
max_seq_len = 128  # tokens per row
vocab_size = 4096  # synthetic vocabulary size
total_batch_size = 4096  # tokens per optimizer step
manual_batch_size = 1  # the small manual device_batch_size to compare with
device_memory_gb = 2.0  # discovery budget in GiB (CPU/MPS; on CUDA an emulated smaller device)
batch_size_margin = 0.85  # fraction of the budget the step may use
steps = 2  # timed optimizer steps per setting
device_type = ""  # cuda | mps | cpu; "" autodetects
dtype = ""  # bfloat16 | float32; "" means bfloat16 autocast on CUDA and on CPUs with fast bf16 matmuls, else float32
seed = 0  # model init and data seed
config = configure(globals())


def run_setting(build_probe, device, batch_size, autocast_ctx):
    """Trains steps + 1 optimizer steps at device_batch_size=batch_size; returns (tokens/s, first step loss)."""
    torch.manual_seed(seed)
    model, optimizers = build_probe(device)
    rows = total_batch_size // max_seq_len
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(0, vocab_size, (2, rows, max_seq_len), generator=g).to(device) for _ in range(steps + 1)]
    losses, t0 = [], None
    for i, batch in enumerate(data):
        if i == 1:
            synchronize(device)
            t0 = time.perf_counter()
        loss = forward_backward(model, micro_batches(batch[0], batch[1], batch_size), autocast_ctx)
        optimizer_step(model, optimizers, lrm=1.0, momentum=0.95, grad_clip=1.0)
        losses.append(loss.item())
    synchronize(device)
    return steps * total_batch_size / (time.perf_counter() - t0), losses[0]


def main():
    device = torch.device(device_type or autodetect_device_type())
    amp, autocast_ctx = precision(dtype, device)
    model_config = config_from_depth(depth, vocab_size, max_seq_len)
    build_probe = gpt_builder(model_config)
    if total_batch_size % (manual_batch_size * max_seq_len) != 0:
        raise UserError(f"--total_batch_size={total_batch_size} is not a multiple of --manual_batch_size * "
                        f"--max_seq_len = {manual_batch_size * max_seq_len}")
    found, record = discover_device_batch_size(
        build_probe, max_seq_len=max_seq_len, vocab_size=vocab_size, total_batch_size=total_batch_size, world_size=1,
        device=device, amp_dtype=torch.bfloat16 if amp == "bfloat16" else None, compile=False,
        margin=batch_size_margin, device_memory_gb=device_memory_gb, use_cache=False,
        key_fields={"model_config": vars(model_config)}, log=lambda *a: print(*a, file=sys.stderr))
    result = {"device": str(device), "dtype": amp, "depth": depth, "max_seq_len": max_seq_len,
              "vocab_size": vocab_size, "total_batch_size": total_batch_size, "device_memory_gb": device_memory_gb,
              "margin": batch_size_margin, "steps": steps, "threads": torch.get_num_threads(),
              "discovery_seconds": record["seconds"], "discovery_probes": len(record["probes"])}
    for name, batch_size in (("manual", manual_batch_size), ("discovered", found)):
        tok_per_s, loss = run_setting(build_probe, device, batch_size, autocast_ctx)
        result[name] = {"device_batch_size": batch_size,
                        "grad_accum_steps": total_batch_size // (batch_size * max_seq_len),
                        "tokens_per_s": round(tok_per_s, 1), "first_step_loss": loss}
    result["speedup"] = round(result["discovered"]["tokens_per_s"] / result["manual"]["tokens_per_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    run_script(main)
