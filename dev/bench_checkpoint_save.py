"""
Benchmark of a checkpoint save's durability cost: the wall time of save_checkpoint as the training scripts call it
(every file and directory fsynced before the commit rename) against the same save with fsync made a no-op, and the
time of one optimizer step of the same model, so the save's share of the training time can be stated. Interleaved
(step, save, save without fsync) `reps` times; prints one JSON object with the medians and the min..max spread.

    python dev/bench_checkpoint_save.py                     # the CPU recipe's base model: depth 4, 4096 tokens/step

The checkpoints go to a temporary directory under $NANOTRAIN_BASE_DIR (the disk the runs write to), removed at the
end. Synthetic tokens: no tokenizer or dataset needed.
"""

import json
import os
import shutil
import statistics
import tempfile
import time
from unittest import mock

import torch

from nanotrain.checkpoint import save_checkpoint
from nanotrain.common import autodetect_device_type, get_base_dir, rng_state, run_script, synchronize
from nanotrain.configurator import configure
from nanotrain.gpt import GPT, config_from_depth
from nanotrain.optim import setup_optimizers
from nanotrain.training import forward_backward, micro_batches, optimizer_step, precision

depth = 4  # model depth (model_dim = 64 * depth), as in runs/cpu.sh
max_seq_len = 256  # tokens per row
vocab_size = 4096  # vocabulary size
device_batch_size = 8  # rows per micro-batch
total_batch_size = 4096  # tokens per optimizer step
reps = 7  # interleaved repetitions of (step, save, save without fsync)
dtype = ""  # bfloat16 | float32; "" as the training scripts choose
seed = 0
config = configure(globals())


def spread(xs):
    """{"median", "min", "max"} of a list of seconds, rounded to 0.1 ms."""
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def main():
    device = torch.device(autodetect_device_type())
    _, autocast_ctx = precision(dtype, device)
    torch.manual_seed(seed)
    model = GPT(config_from_depth(depth, vocab_size, max_seq_len)).to(device)
    model.init_weights()
    optimizers = setup_optimizers(model)
    rows = total_batch_size // max_seq_len
    g = torch.Generator().manual_seed(seed)
    out = tempfile.mkdtemp(prefix="bench_save_", dir=get_base_dir())
    times = {"step": [], "save_fsync": [], "save_no_fsync": []}
    try:
        for rep in range(reps + 1):  # the first round warms up and is not counted
            x, y = torch.randint(0, vocab_size, (2, rows, max_seq_len), generator=g).to(device)
            synchronize(device)
            t0 = time.perf_counter()
            forward_backward(model, micro_batches(x, y, device_batch_size), autocast_ctx)
            optimizer_step(model, optimizers, lrm=1.0, momentum=0.95, grad_clip=1.0)
            synchronize(device)
            t = {"step": time.perf_counter() - t0}
            for name in ("save_fsync", "save_no_fsync"):
                run_dir = os.path.join(out, name)
                t0 = time.perf_counter()
                with mock.patch("os.fsync", (lambda fd: None) if name == "save_no_fsync" else os.fsync):
                    save_checkpoint(run_dir, rep, model, optimizers, {"config": {}}, {"rng": rng_state(device)},
                                    keep_last=2)
                t[name] = time.perf_counter() - t0
            if rep > 0:
                for k, v in t.items():
                    times[k].append(v)
        ckpt = os.path.join(out, "save_fsync", "checkpoints", f"step_{reps:06d}")
        size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    result = {"device": str(device), "depth": depth, "total_batch_size": total_batch_size, "reps": reps,
              "threads": torch.get_num_threads(), "checkpoint_mib": round(size / 2**20, 2),
              **{k: spread(v) for k, v in times.items()}}
    result["fsync_cost_s"] = round(result["save_fsync"]["median"] - result["save_no_fsync"]["median"], 4)
    result["save_over_step"] = round(result["save_fsync"]["median"] / result["step"]["median"], 3)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_script(main)
