"""
Benchmark of Muon's optimizer step by shape (nanotrain.muon.Muon: one stacked orthogonalisation per shape) against
a per-parameter loop (per_matrix_step below, the step as nanotrain ran it before: one matrix at a time, its
Newton-Schulz compiled alone when compiled), eager and compiled, at the block matrices of `depth` (and one step of
each at `depth_one`, one variant alive at a time: ~5 GB each at depth 20). At `depth` the variants are interleaved,
`reps` times after a warm-up round; medians and min..max in seconds. Polar Express, NorMuon (beta2) and cautious
weight decay on, as the GPU recipe runs them. One process (the sharing across ranks divides the orthogonalisation by
the world size on top of this). Prints one JSON object.

    python dev/bench_muon_step.py                                    # depth 12, then one step at depth 20
    python dev/bench_muon_step.py --depth=2 --depth_one=0 --reps=1 --compile=False   # a quick check that it runs
"""

import json
import statistics
import time

import torch

from nanotrain.common import autodetect_device_type, run_script, synchronize
from nanotrain.configurator import configure
from nanotrain.gpt import GPT, config_from_depth
from nanotrain.muon import Muon, normalize_variance, ns_dtype_for, zeropower_via_newtonschulz5
from nanotrain.optim import CompiledOrEager, compile_optimizer_step

depth = 12  # the model depth whose block matrices are stepped (model_dim = 64 * depth)
depth_one = 20  # a second depth stepped once per variant after the warm-up (0: none)
reps = 5  # interleaved repetitions of every variant at `depth`
compile = True  # also time the compiled variants (torch.compile, inductor)
ns_dtype = ""  # Newton-Schulz dtype: "" as Muon's default (nanotrain.muon.ns_dtype_for) | float32 | bfloat16
beta2 = 0.95  # NorMuon's EMA factor (0: off)
weight_decay = 0.2  # Muon's cautious weight decay
seed = 0
config = configure(globals())


def spread(xs):
    return {"median": round(statistics.median(xs), 5), "min": round(min(xs), 5), "max": round(max(xs), 5)}


def matrix_shapes(d):
    """The shapes of the Muon parameters (the blocks' matrices) of the depth-d GPT, built on the meta device."""
    with torch.device("meta"):
        model = GPT(config_from_depth(d, 32768, 2048))
    return [tuple(p.shape) for p in model.blocks.parameters()]


@torch.no_grad()
def per_matrix_step(params, state, lr, momentum, zeropower, dtype):
    """The reference: Muon one matrix at a time (EMA momentum, Nesterov, Polar Express, NorMuon, cautious weight
    decay), `zeropower` the orthogonalisation of one matrix (eager or compiled)."""
    for p in params:
        st = state.setdefault(p, {})
        buf = st.setdefault("momentum_buffer", torch.zeros_like(p))
        buf.lerp_(p.grad, 1 - momentum)
        u = zeropower(p.grad.lerp(buf, momentum), 5, dtype, True)
        if beta2 > 0:
            u = normalize_variance(u, st, beta2)
        u = u.to(p.dtype)
        s = lr * max(1.0, p.size(0) / p.size(1)) ** 0.5
        p.sub_(p * (u * p > 0) * (s * weight_decay))
        p.add_(u, alpha=-s)


class Variant:
    """One way to step the same matrices: "stacked" (nanotrain.muon.Muon) or "per_matrix", eager or compiled."""

    def __init__(self, kind, compiled, shapes, device):
        g = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]
        for p in self.params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        self.kind, self.device = kind, device
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(ns_dtype) or ns_dtype_for(device)
        if kind == "stacked":
            self.opt = Muon(self.params, lr=0.02, momentum=0.95, ns_dtype=ns_dtype, polar_express=True, beta2=beta2,
                            weight_decay=weight_decay)
            if compiled:
                assert compile_optimizer_step([self.opt], device), "torch.compile is unavailable here"
        else:
            self.state = {}
            self.zeropower = CompiledOrEager(zeropower_via_newtonschulz5) if compiled else zeropower_via_newtonschulz5

    def step(self):
        synchronize(self.device)
        t = time.perf_counter()
        if self.kind == "stacked":
            self.opt.step()
        else:
            per_matrix_step(self.params, self.state, 0.02, 0.95, self.zeropower, self.dtype)
        synchronize(self.device)
        return time.perf_counter() - t


def main():
    device = torch.device(autodetect_device_type())
    names = [(k, c) for c in ([False, True] if compile else [False]) for k in ("per_matrix", "stacked")]
    result = {"device": str(device), "threads": torch.get_num_threads(), "ns_dtype": str(Variant(
        "per_matrix", False, [(2, 2)], device).dtype), "beta2": beta2, "weight_decay": weight_decay}
    for d, n in ((depth, reps), (depth_one, 1)):
        if d <= 0:
            continue
        shapes = matrix_shapes(d)
        times = {f"{k}_{'compiled' if c else 'eager'}": [] for k, c in names}
        if d == depth:  # all variants alive, interleaved
            variants = {name: Variant(k, c, shapes, device) for name, (k, c) in zip(times, names)}
            for rep in range(n + 1):  # round 0 warms up (and compiles)
                for name, v in variants.items():
                    t = v.step()
                    if rep > 0:
                        times[name].append(t)
            del variants
        else:  # one variant at a time (at depth 20 each holds ~5 GB), a warm-up step then the timed one
            for name, (k, c) in zip(times, names):
                v = Variant(k, c, shapes, device)
                v.step()
                times[name].append(v.step())
                del v
        res = {"matrices": len(shapes), "shapes": {str(s): shapes.count(s) for s in sorted(set(shapes))},
               "reps": n, "step_s": {name: spread(ts) for name, ts in times.items()}}
        for mode in ("eager", "compiled"):
            if f"stacked_{mode}" in times:
                res[f"speedup_{mode}"] = round(statistics.median(times[f"per_matrix_{mode}"])
                                               / statistics.median(times[f"stacked_{mode}"]), 3)
        result[f"depth_{d}"] = res
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    run_script(main)
