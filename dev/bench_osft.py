"""
Benchmark of orthogonal subspace fine-tuning's cost: the SVDs at the start of a stage, and one optimizer step with
and without the projections (interleaved, `reps` times; medians and min..max), on the same model and data; plus the
bytes of the bases, and the FLOPs and bytes per step estimated for `estimate_depth` (the formulas of nanotrain.osft:
bases k (m + n) fp32 numbers per matrix, 16 m n k FLOPs per step, k = floor(r * min(m, n))). Prints one JSON object.

    python dev/bench_osft.py                         # the CPU recipe's model: depth 4, 4096 tokens per step
"""

import json
import statistics
import time

import torch

from nanotrain.common import autodetect_device_type, run_script, synchronize
from nanotrain.configurator import configure
from nanotrain.gpt import GPT, config_from_depth
from nanotrain.optim import setup_optimizers
from nanotrain.osft import MATRIX_PATTERNS, OSFT, parse_matrices
from nanotrain.training import forward_backward, micro_batches, optimizer_step, precision

depth = 4  # model depth (model_dim = 64 * depth), as in runs/cpu.sh
max_seq_len = 256  # tokens per row
vocab_size = 4096  # vocabulary size
device_batch_size = 8  # rows per micro-batch
total_batch_size = 4096  # tokens per optimizer step
osft_rank_ratio = 0.5  # fraction of singular directions frozen
osft_matrices = "attn,mlp"  # matrices constrained
reps = 7  # interleaved repetitions of (plain step, OSFT step)
estimate_depth = 20  # the depth whose per-step cost is estimated from the formulas
estimate_tokens_per_rank = 65536  # tokens per optimizer step per rank at that depth (524288 over 8 GPUs)
dtype = ""
seed = 0
config = configure(globals())


def spread(xs):
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4), "max": round(max(xs), 4)}


def build(device, with_osft):
    torch.manual_seed(seed)
    model = GPT(config_from_depth(depth, vocab_size, max_seq_len)).to(device)
    model.init_weights()
    optimizers = setup_optimizers(model)
    osft = None
    if with_osft:
        osft = OSFT(model, osft_rank_ratio, osft_matrices)
        osft.attach(optimizers)
    return model, optimizers, osft


def estimate(d):
    """Bytes of the bases and OSFT FLOPs per step at depth d, and the training FLOPs of its block matrices per step
    per rank (6 x matrix params x tokens), for the chosen matrices."""
    import re
    with torch.device("meta"):
        model = GPT(config_from_depth(d, 32768, 2048))
    pattern = re.compile("|".join(f"(?:{MATRIX_PATTERNS[n]})" for n in parse_matrices(osft_matrices)))
    bases = flops = params = 0
    for name, p in model.named_parameters():
        if pattern.fullmatch(name):
            m, n = p.shape
            k = int(osft_rank_ratio * min(m, n))
            bases += 4 * k * (m + n)
            flops += 16 * m * n * k
            params += m * n
    train = 6 * params * estimate_tokens_per_rank
    return {"depth": d, "bases_gib": round(bases / 2**30, 3), "weight_copy_gib": round(4 * params / 2**30, 3),
            "osft_flops_per_step": f"{flops:.3e}", "matrix_train_flops_per_step_per_rank": f"{train:.3e}",
            "osft_share_of_matrix_flops": round(flops / train, 4)}


def main():
    device = torch.device(autodetect_device_type())
    _, autocast_ctx = precision(dtype, device)
    t0 = time.perf_counter()
    _, _, osft = build(device, True)
    svd_seconds = time.perf_counter() - t0
    runs = {"plain": build(device, False), "osft": build(device, True)}
    rows = total_batch_size // max_seq_len
    g = torch.Generator().manual_seed(seed)
    times = {"plain": [], "osft": []}
    for rep in range(reps + 1):  # round 0 warms up
        x, y = torch.randint(0, vocab_size, (2, rows, max_seq_len), generator=g).to(device)
        for name, (model, optimizers, _) in runs.items():
            synchronize(device)
            t = time.perf_counter()
            forward_backward(model, micro_batches(x, y, device_batch_size), autocast_ctx)
            optimizer_step(model, optimizers, 1.0, 0.95, 1.0)
            synchronize(device)
            if rep > 0:
                times[name].append(time.perf_counter() - t)
    result = {"device": str(device), "depth": depth, "osft_rank_ratio": osft_rank_ratio, "matrices": osft_matrices,
              "threads": torch.get_num_threads(), "n_matrices": len(osft.bases),
              "bases_mib": round(osft.nbytes() / 2**20, 2), "svd_and_setup_s": round(svd_seconds, 3),
              "step_plain_s": spread(times["plain"]), "step_osft_s": spread(times["osft"]),
              "estimate": estimate(estimate_depth)}
    result["osft_step_overhead"] = round(result["step_osft_s"]["median"] / result["step_plain_s"]["median"] - 1, 4)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_script(main)
