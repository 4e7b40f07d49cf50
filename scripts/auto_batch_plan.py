"""
Plan mode of the automatic device batch size: ESTIMATES, without a GPU, the largest device_batch_size of nanotrain's
GPT at each depth for a CUDA device with device_memory_gb GiB (bf16 autocast), by measuring the training step with
fake tensors (nanotrain.auto_batch_size.probe.measure_fake_peak) in the search of nanotrain.auto_batch_size.search.
Fake tensors measure the eager step; --compile=True (the default, as base_train compiles on CUDA) plans the compiled
step as that estimate times nanotrain.auto_batch_size.probe.COMPILED_OVER_EAGER (the compiled step's peak over the
eager one's, measured on one H200); --compile=False plans the eager step.

    python scripts/auto_batch_plan.py --depths=12,20,26,32 --max_seq_len=2048 --device_memory_gb=80

Prints a table (depth, activation checkpointing policy, params, probed device_batch_size, estimated peak GiB, fits)
and the size found per depth and policy, with the share of the step's FLOPs the policy recomputes (counted with
torch.utils.flop_counter on fake tensors). --activation_checkpointing=auto plans every policy (none, selective, full)
and names the one base_train's auto would take (nanotrain.auto_batch_size.policy.choose_policy):

    python scripts/auto_batch_plan.py --depths=20,26,32 --max_seq_len=2048 --device_memory_gb=80 \
        --activation_checkpointing=auto
Uses fake CUDA tensors when torch can run a CUDA device here. A CPU-only torch build cannot record fake CUDA tensors
for autograd (InputMetadata asks for a CUDA device guard, which such a build lacks, and the process aborts with
"PyTorch is not linked with support for cuda devices"), so there it measures fake CPU tensors in bf16 (CPU autocast;
the CPU flash-attention kernel, whose memory matches CUDA's flash attention) and says so. Sliding windows
(--window_pattern=SSSL) are measured on the backend training takes: with fake CUDA tensors flex_attention (its saved
tensors: q, k, v, the output and the logsumexp, as the fused kernel keeps); with fake CPU tensors SDPA with the
explicit window mask on the same CPU flash kernel, which also keeps one T x T additive mask per windowed layer
(bf16 at T = 2048: 8 MiB each, 72 MiB at depth 12): a little more than flex_attention keeps.
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import time

import torch

from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.policy import AUTO_MAX_RECOMPUTE, choose_policy, measure_recompute
from nanotrain.auto_batch_size.probe import COMPILED_OVER_EAGER, GiB, measure_fake_peak
from nanotrain.auto_batch_size.search import candidate_batch_sizes, search_batch_size
from nanotrain.common import rng_state, run_script, set_rng_state
from nanotrain.configurator import configure
from nanotrain.errors import UserError
from nanotrain.fp8 import check_fp8
from nanotrain.gpt import GPT, POLICIES, config_from_depth, policy_name

depth = None  # one depth (int); None: the depths below
depths = "12,20,26,32"  # comma-separated depths
max_seq_len = 2048  # tokens per row (context length)
vocab_size = 65536  # vocabulary size (nanochat's default tokenizer)
total_batch_size = 524288  # tokens per optimizer step, all ranks and micro-batches together
device_memory_gb = 80.0  # memory of the CUDA device to plan for, in GiB
margin = 0.85  # fraction of the device memory the training step may use
world_size = 1  # number of ranks (adds DDP's gradient buckets when > 1)
activation_checkpointing = "none"  # none|selective|full|auto; auto: every policy and its pick
compile = True  # plan the compiled step (base_train's CUDA default): the eager estimate x COMPILED_OVER_EAGER
window_pattern = "L"  # attention windows tiled over the layers, the last always L: L full, S short (e.g. SSSL)
short_window = None  # an S layer's query at i attends keys i-short_window..i; None: max_seq_len/4 up to 128s
fp8 = False  # plan base_train's --fp8=True step: the blocks' Linears in float8 (nanotrain/fp8.py)
fp8_recipe = "tensorwise"  # --fp8's scaling: tensorwise | rowwise
config = configure(globals(), none_types={"depth": (int,), "short_window": (int,)})


def main():
    try:
        plan_depths = [depth] if depth is not None else [int(d) for d in depths.split(",") if d.strip()]
    except ValueError:
        raise UserError(f"--depths={depths!r}: expected comma-separated integers, e.g. 12,20,26,32") from None
    policy = policy_name(activation_checkpointing, allow_auto=True)
    policies = POLICIES if policy == "auto" else (policy,)
    fake_device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = device_memory_gb * GiB
    limit = margin * budget
    step_factor = COMPILED_OVER_EAGER if compile else 1.0  # the compiled step's peak over the eager one's (measured)
    candidates = candidate_batch_sizes(total_batch_size, max_seq_len, world_size)
    needed = total_batch_size // (max_seq_len * world_size)  # one micro-batch per step
    print(f"Plan mode: an ESTIMATE (not a measurement on a GPU) of the largest device_batch_size for a CUDA device with "
          f"{device_memory_gb:g} GiB; a size fits if its peak <= {margin:g} x {device_memory_gb:g} = "
          f"{limit / GiB:.4g} GiB. max_seq_len={max_seq_len}, vocab_size={vocab_size}, total_batch_size="
          f"{total_batch_size}, world_size={world_size}, bf16 autocast, "
          f"{'compiled' if compile else 'uncompiled'} step (2 micro-steps + optimizer step + 1 micro-step), "
          f"activation checkpointing {policy}"
          f"{f', attention windows {window_pattern}' if window_pattern != 'L' else ''}"
          f"{f', fp8 {fp8_recipe}' if fp8 else ''}.")
    if fp8:  # fake CPU tensors have no _scaled_mm: the casts emulated (their fp32 dequantised copies count too)
        check_fp8(fp8_recipe, emulate=fake_device == "cpu", device=torch.device(fake_device))
        if fake_device == "cpu":
            print("--fp8=True on fake CPU tensors: the float8 casts emulated, whose dequantised fp32 operands are "
                  "transient copies _scaled_mm does not make: an upper bound of the fp8 step's peak.")
    if fake_device == "cpu":
        print("Measured with fake CPU tensors in bf16: this torch is CPU-only and cannot record fake CUDA tensors for "
              "autograd. Live tensor bytes only: the CUDA caching allocator, the CUDA context (~0.5 GiB), NCCL buffers "
              "and cuBLAS workspaces come on top (the margin is for them).")
    else:
        print("Measured with fake CUDA tensors (live tensor bytes, rounded to 512 B like the caching allocator).")
    if compile:
        print(f"Compiled step: the eager step's estimate x {COMPILED_OVER_EAGER:.3f}, the compiled step's reserved "
              f"peak over the eager one's as measured on one H200 (depth 20, T = 2048, 32 rows, no checkpointing: 72.89 "
              f"against 64.86 GiB); --compile=False plans the eager step. On CUDA the finder probes the compiled step "
              f"itself.")
    print("recompute: the share of extra FLOPs of a training step under the policy (torch.utils.flop_counter: matmuls "
          "and attention; the elementwise ops selective recomputes count 0).")
    print(f"{'depth':>5} | {'policy':>9} | {'params':>14} | {'device_batch_size':>17} | {'est. peak GiB':>13} | fits")
    t0 = time.perf_counter()
    for d in plan_depths:
        model_config = config_from_depth(d, vocab_size, max_seq_len, window_pattern=window_pattern,
                                         short_window=short_window)
        with torch.device("meta"):
            num_params = GPT(model_config).num_params()
        found = {}
        for p in policies:
            build_probe = gpt_builder(model_config, activation_checkpointing=p, fp8_recipe=fp8_recipe if fp8 else None,
                                      fp8_emulate=fake_device == "cpu")
            peaks = {}

            def fits(batch_size):
                peaks[batch_size] = step_factor * measure_fake_peak(
                    build_probe, batch_size, max_seq_len=max_seq_len, vocab_size=vocab_size, device=fake_device,
                    amp_dtype=torch.bfloat16, world_size=world_size)
                return peaks[batch_size] <= limit

            saved_rng = rng_state(fake_device)  # gpt_builder draws from the global RNG
            try:
                size = search_batch_size(fits, candidates)
            except UserError:
                size = None
            finally:
                set_rng_state(saved_rng, fake_device)
            extra = 0.0 if p == "none" else measure_recompute(build_probe, max_seq_len)
            found[p] = (size, extra)
            for b in sorted(peaks):
                print(f"{d:>5} | {p:>9} | {num_params:>14,} | {b:>17} | {peaks[b] / GiB:>13.2f} | "
                      f"{'yes' if peaks[b] <= limit else 'no'}")
            if size is None:
                print(f"{d:>5} | {p:>9} | => nothing fits, not even device_batch_size={candidates[0]} | recompute "
                      f"{100 * extra:.1f}%")
            else:
                accum = total_batch_size // (size * max_seq_len * world_size)
                print(f"{d:>5} | {p:>9} | => device_batch_size={size} (grad_accum_steps={accum}) | recompute "
                      f"{100 * extra:.1f}%")
        if policy == "auto":
            chosen = choose_policy(found, needed)
            if chosen is None:
                print(f"{d:>5} | auto: nothing fits under any policy")
            else:
                print(f"{d:>5} | auto: {chosen}, device_batch_size={found[chosen][0]}, recompute "
                      f"{100 * found[chosen][1]:.1f}% (among the policies recomputing <= "
                      f"{100 * AUTO_MAX_RECOMPUTE:g}%: the first reaching {needed} rows, else the largest size)")
    print(f"Estimated in {time.perf_counter() - t0:.1f}s.")


if __name__ == "__main__":
    run_script(main)
