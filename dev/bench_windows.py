"""
Benchmark of sliding-window attention's backends (nanotrain/attention.py) on one attention call of a training step's
shape: flex_attention with the window's block mask against SDPA with the explicit window mask, and full causal SDPA
(what an L layer runs) as the baseline, and on CUDA flash-attn 2's window_size=(W, 0) when flash-attn is
installed (uncompiled flex_attention, which materialises the scores, only on the CPU). Every backend is timed `reps`
times, interleaved (one call of each per round, in a rotating order), after `warmup` rounds (flex_attention's
compile happens there); medians and min..max in ms per call; plus each backend's largest |difference| to SDPA with
the mask (the same maths). Prints one JSON object.

On CUDA (bf16) a call is forward + backward. On the CPU torch (2.13) has no backward for flex_attention, so there a
call is the forward only, under torch.no_grad(), for every backend, and flex_attention runs compiled (its C++
kernel; the first call compiles for about a minute) and uncompiled (the unfused reference).

    python dev/bench_windows.py                           # T = 2048, window 512 (the SSSL short window at 2048)
    python dev/bench_windows.py --seq_len=256 --window=128 --heads=2 --batch_size=8   # the CPU recipe's shape
"""

import json
import statistics
import time

import torch
import torch.nn.functional as F

from nanotrain.attention import _window_mod, flash_attn_func, window_mask
from nanotrain.common import autodetect_device_type, run_script, synchronize
from nanotrain.configurator import configure

batch_size = 4  # rows
seq_len = 2048  # T
window = 512  # keys i-window..i
heads = 12  # query heads (depth 24 at head_dim 128: 12)
kv_heads = 12  # key/value heads
head_dim = 128
reps = 9  # timed rounds
warmup = 2  # untimed rounds first
device_type = ""  # cuda | cpu; "" autodetects
seed = 0
config = configure(globals())


def spread(xs):
    return {"median_ms": round(1e3 * statistics.median(xs), 3), "min_ms": round(1e3 * min(xs), 3),
            "max_ms": round(1e3 * max(xs), 3)}


def main():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    device = torch.device(device_type or autodetect_device_type())
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = [(batch_size, h, seq_len, head_dim) for h in (heads, kv_heads, kv_heads)]
    q, k, v = (torch.randn(s, generator=g, device=device, dtype=dtype).requires_grad_(cuda) for s in shapes)
    gqa = heads != kv_heads
    mask = window_mask(torch.arange(seq_len, device=device), seq_len, window)
    block_mask = create_block_mask(_window_mod(window), None, None, seq_len, seq_len, device=device)
    compiled_flex = torch.compile(flex_attention, dynamic=False)
    backends = {
        "sdpa_window_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
        "flex_window_compiled": lambda: compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=gqa),
        "sdpa_full_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa),
    }
    if not cuda:
        backends["flex_window_eager"] = lambda: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if cuda and flash_attn_func is not None:
        backends["flash_attn2_window"] = lambda: flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
            window_size=(window, 0)).transpose(1, 2)

    def call(fn):
        if cuda:
            y = fn()
            y.backward(torch.ones_like(y))
            q.grad = k.grad = v.grad = None
            return y.detach()
        with torch.no_grad():
            return fn()

    names = list(backends)
    times = {n: [] for n in names}
    outputs = {}
    for r in range(warmup + reps):
        for n in names[r % len(names):] + names[:r % len(names)]:  # rotate the order every round
            synchronize(device)
            t0 = time.perf_counter()
            out = call(backends[n])
            synchronize(device)
            if r >= warmup:
                times[n].append(time.perf_counter() - t0)
            outputs[n] = out
    ref = outputs["sdpa_window_mask"].float()
    result = {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "call": "forward + backward" if cuda
              else "forward (no grad: torch has no CPU backward for flex_attention)", "config": config,
              "ms": {n: spread(times[n]) for n in names},
              "max_abs_diff_to_sdpa_window_mask": {n: (outputs[n].float() - ref).abs().max().item() for n in names
                                                   if n != "sdpa_full_causal"}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_script(main)
