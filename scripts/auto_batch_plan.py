"""
Plan mode of the automatic device batch size: ESTIMATES, without a GPU, the largest device_batch_size of nanotrain's
GPT at each depth for a CUDA device with device_memory_gb GiB (bf16 autocast, eager step), by measuring the training
step with fake tensors (nanotrain.autobatch.probe.measure_fake_peak) in the search of nanotrain.autobatch.search.

    python scripts/auto_batch_plan.py --depths=12,20,26,32 --max_seq_len=2048 --device_memory_gb=80

Prints a table (depth, params, probed device_batch_size, estimated peak GiB, fits) and the size found per depth.
Uses fake CUDA tensors when torch can run a CUDA device here. A CPU-only torch build cannot record fake CUDA tensors
for autograd (InputMetadata asks for a CUDA device guard, which such a build lacks, and the process aborts with
"PyTorch is not linked with support for cuda devices"), so there it measures fake CPU tensors in bf16 (CPU autocast;
the CPU flash-attention kernel, whose memory matches CUDA's flash attention) and says so.
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import time

import torch

from nanotrain.autobatch.builders import gpt_builder
from nanotrain.autobatch.probe import GiB, measure_fake_peak
from nanotrain.autobatch.search import candidate_batch_sizes, search_batch_size
from nanotrain.common import rng_state, run_script, set_rng_state
from nanotrain.configurator import configure
from nanotrain.errors import UserError
from nanotrain.gpt import GPT, config_from_depth

depth = None  # one depth (int); None: the depths below
depths = "12,20,26,32"  # comma-separated depths
max_seq_len = 2048  # tokens per row (context length)
vocab_size = 65536  # vocabulary size (nanochat's default tokenizer)
total_batch_size = 524288  # tokens per optimizer step, all ranks and micro-batches together
device_memory_gb = 80.0  # memory of the CUDA device to plan for, in GiB
margin = 0.85  # fraction of the device memory the training step may use
world_size = 1  # number of ranks (adds DDP's gradient buckets when > 1)
activation_checkpointing = False  # True: measure the step with per-block activation checkpointing
config = configure(globals(), none_types={"depth": (int,)})


def main():
    try:
        plan_depths = [depth] if depth is not None else [int(d) for d in depths.split(",") if d.strip()]
    except ValueError:
        raise UserError(f"--depths={depths!r}: expected comma-separated integers, e.g. 12,20,26,32") from None
    fake_device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = device_memory_gb * GiB
    limit = margin * budget
    candidates = candidate_batch_sizes(total_batch_size, max_seq_len, world_size)
    print(f"Plan mode: an ESTIMATE (not a measurement on a GPU) of the largest device_batch_size for a CUDA device with "
          f"{device_memory_gb:g} GiB; a size fits if its peak <= {margin:g} x {device_memory_gb:g} = "
          f"{limit / GiB:.4g} GiB. max_seq_len={max_seq_len}, vocab_size={vocab_size}, total_batch_size="
          f"{total_batch_size}, world_size={world_size}, bf16 autocast, uncompiled step "
          f"(2 micro-steps + optimizer step + 1 micro-step), activation checkpointing "
          f"{'on' if activation_checkpointing else 'off'}.")
    if fake_device == "cpu":
        print("Measured with fake CPU tensors in bf16: this torch is CPU-only and cannot record fake CUDA tensors for "
              "autograd. Live tensor bytes only: the CUDA caching allocator, the CUDA context (~0.5 GiB), NCCL buffers "
              "and cuBLAS workspaces come on top (the margin is for them); torch.compile usually needs less.")
    else:
        print("Measured with fake CUDA tensors (live tensor bytes, rounded to 512 B like the caching allocator).")
    print(f"{'depth':>5} | {'params':>14} | {'device_batch_size':>17} | {'est. peak GiB':>13} | fits")
    t0 = time.perf_counter()
    for d in plan_depths:
        model_config = config_from_depth(d, vocab_size, max_seq_len)
        with torch.device("meta"):
            num_params = GPT(model_config).num_params()
        build_probe = gpt_builder(model_config, activation_checkpointing=activation_checkpointing)
        peaks = {}

        def fits(batch_size):
            peaks[batch_size] = measure_fake_peak(build_probe, batch_size, max_seq_len=max_seq_len,
                                                  vocab_size=vocab_size, device=fake_device,
                                                  amp_dtype=torch.bfloat16, world_size=world_size)
            return peaks[batch_size] <= limit

        saved_rng = rng_state(fake_device)  # gpt_builder draws from the global RNG
        try:
            found = search_batch_size(fits, candidates)
        except UserError:
            found = None
        finally:
            set_rng_state(saved_rng, fake_device)
        for b in sorted(peaks):
            print(f"{d:>5} | {num_params:>14,} | {b:>17} | {peaks[b] / GiB:>13.2f} | "
                  f"{'yes' if peaks[b] <= limit else 'no'}")
        if found is None:
            print(f"{d:>5} | => nothing fits, not even device_batch_size={candidates[0]}")
        else:
            accum = total_batch_size // (found * max_seq_len * world_size)
            print(f"{d:>5} | => device_batch_size={found} (grad_accum_steps={accum})")
    print(f"Estimated in {time.perf_counter() - t0:.1f}s.")


if __name__ == "__main__":
    run_script(main)
