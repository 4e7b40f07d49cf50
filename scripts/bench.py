"""
Training-speed benchmark: steady-state tokens/s, step time, MFU and peak memory of base_train's optimizer step, plus
the token loader's and the tokenizer's throughput on the same data. Prints ONE JSON object on stdout.

    python scripts/bench.py --depth=12 --max_seq_len=2048 --device_batch_size=32    # 2^19 tokens per step, as training
    python scripts/bench.py --depth=4 --max_seq_len=256 --device_batch_size=8 --total_batch_size=4096
    python scripts/bench.py --depth=8 --max_seq_len=512 --device_batch_size=4 --total_batch_size=8192
    python scripts/bench.py --depth=4 --vs="--compile=True"          # A B B A A B ... interleaved; ratio per pair
    python scripts/bench.py --depth=4 --vs="--value_embeds=False"    # a model or optimizer option off and on
    python scripts/bench.py --depth=12 --max_seq_len=2048 --device_batch_size=16 --total_batch_size=524288 \
        --compile=True --vs="--fp8=True"                              # FP8 block Linears against bf16 (a GPU)
    python scripts/bench.py --depth=4 --profile=True                 # where the step's time goes (torch.profiler)

The model and optimizers are built as in scripts/base_train.py (meta device, to_empty, init_weights,
setup_optimizers) and every timed step is base_train's: the loader's next_batch, nanotrain.training.forward_backward
over grad_accum_steps micro-batches up to the run's total batch (--total_batch_size=-1, the default: base_train's
automatic size from the horizon, 2^19 tokens at depth 12), optimizer_step (clipping at --grad_clip), and the step's
one host read (training.step_stats, read_step_stats), so the per-step costs (optimizer, syncs) are counted as a
run pays them. grad_accum_steps goes to stderr and the JSON. Needs a tokenizer (python scripts/tok_train.py) and the data (--data, builtin default).

MFU = flops_per_token (GPT.estimate_flops) * tokens/s / peak. Peak on CUDA: the datasheet table
nanotrain.common.GPU_PEAK_FLOPS (bf16 dense, by exact card name; a card not in it: peak and mfu null); on CPU: the
(n=1024) matmul throughput in the run's dtype measured in this process before and after the timed steps, the larger
of the two (a busy machine lowers it, which would inflate MFU; "warnings" says when the samples disagree or the load
average exceeds the cores). Peak memory on CUDA: torch.cuda.max_memory_allocated; on CPU: the MemTracker estimate of the eager training step
(nanotrain.auto_batch_size.probe.measure_fake_peak, exact tensor bytes) and, separately, the growth of the process's peak
RSS (getrusage) over the run. --activation_checkpointing=selective (or full) measures the checkpointed step (both the
timing and the memory estimate), e.g. --vs="--activation_checkpointing=selective" for its cost in tokens/s.
--compile_optimizer=True compiles only the optimizer step (nanotrain.optim.compile_optimizer_step), e.g.
--vs="--compile_optimizer=True" for the compiled step against the eager one.

--vs="<overrides>" builds a second configuration B (A's settings with these --name=value overrides) in the same
process and times them interleaved, `pairs` rounds of `pair_steps` steps each, A first in even rounds and B first in
odd ones (drift cancels); "vs.ratios" is tokens/s of B / tokens/s of A per round and "vs.median_ratio" their median.
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import contextlib
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, record_function

from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.probe import measure_fake_peak
from nanotrain.common import compute_init, get_peak_flops, run_script, seed_everything, synchronize
from nanotrain.configurator import ConfigError, apply_overrides, configure, validate
from nanotrain.dataloader import TokenLoader
from nanotrain.dataset import iter_documents, resolve_data_files
from nanotrain.errors import UserError
from nanotrain.fp8 import check_fp8, convert_to_fp8, describe
from nanotrain.gpt import GPT, build_model, config_from_depth, policy_name
from nanotrain.muon import ns_dtype_for
from nanotrain.optim import compile_optimizer_step, setup_optimizers
from nanotrain.tokenizer import get_tokenizer
from nanotrain.training import (
    auto_total_batch_size,
    forward_backward,
    micro_batches,
    muon_momentum,
    muon_weight_decay_for,
    optimizer_step,
    precision,
    read_step_stats,
    step_stats,
)

# ----------------------------------------------------------------------------- settings
depth = 4  # n_layer; model_dim = depth * 64
max_seq_len = 256  # tokens per row
device_batch_size = 8  # rows per micro-batch
total_batch_size = -1  # >= 1: tokens per optimizer step (grad_accum_steps = total / (device_batch_size * max_seq_len)); -1: as base_train (from the horizon)
dtype = ""  # bfloat16 | float32; "" means bfloat16 autocast on CUDA and on CPUs with fast bf16 matmuls, else float32
compile = False  # torch.compile the model (the compile time shows in the first warm-up step)
activation_checkpointing = "none"  # none|selective|full, as base_train (nanotrain/gpt.py)
fp8 = False  # the blocks' Linears in float8, as base_train's --fp8 (CUDA capability >= 8.9), e.g. --vs="--fp8=True"
fp8_recipe = "tensorwise"  # --fp8's scaling: tensorwise | rowwise (nanotrain/fp8.py)
fp8_emulate = False  # --fp8=True with the float8 casts emulated in fp32 (any device; no speed-up)
compile_optimizer = None  # torch.compile the optimizer step (Muon's orthogonalisation, AdamW); None: as --compile
device_type = ""  # cuda | mps | cpu; "" autodetects
data = "builtin"  # training text, as in base_train
row_packing = "contiguous"  # how documents fill the rows, as base_train's --row_packing
warmup_steps = 3  # untimed optimizer steps first (compilation, allocator, lazy optimizer state)
steps = 10  # timed optimizer steps (without --vs)
threads = 0  # torch intra-op threads; 0 keeps torch's default
prefetch = -1  # batches the loader's thread makes ahead; 0: off; -1: the loader's default (1 on CUDA, else 0)
adamw = ""  # AdamW implementation: "" nanotrain's (setup_optimizers) | torch's foreach | fused | for (+ one host read a step)
ns_dtype = ""  # Muon's Newton-Schulz compute dtype: "" its default (nanotrain.muon.ns_dtype_for) | float32 | bfloat16
memory_estimate = True  # on CPU also run the MemTracker estimate of the step's peak memory (extra time)
loader_seconds = 1.0  # how long to time the token loader alone
tokenizer_chars = 1_000_000  # characters of documents for the tokenizer's encode throughput
seed = 42  # model init seed
vs = ""  # a second configuration as --name=value overrides of this one, timed interleaved with it
pairs = 6  # --vs: interleaved rounds
pair_steps = 2  # --vs: timed steps per configuration per round
profile = False  # time the steps under torch.profiler: the top ops go to stderr and a "profile" breakdown to the JSON
# the model and optimizer as base_train trains them (same names and defaults; a test keeps them equal), so that
# e.g. --vs="--value_embeds=False" times a technique on and off
value_embeds = True  # value embeddings: token-indexed tables added to V through a per-head gate, every other block
smear = False  # add a gated share of the previous token's embedding to each token's
backout = False  # subtract a learned share of the middle block's output before the head
x0_lambdas = False  # learned per-block scalars mixing the embedding back in: x <- a_i * x + b_i * x0
rotary_base = 10000.0  # base of the rotary position frequencies
qk_scale = 1.0  # scale of the attention logits on top of 1/sqrt(head_dim)
window_pattern = "L"  # attention windows tiled over the layers, the last always L: L full, S short (e.g. SSSL)
short_window = None  # an S layer's query at i attends keys i-short_window..i; None: max_seq_len/4 up to 128s
weight_decay = 0.01  # AdamW weight decay (embeddings, lm_head; decays with the lr)
embedding_beta2 = 0.995  # AdamW beta2 of the token and value embeddings
unembedding_beta2 = 0.96  # AdamW beta2 of the lm_head
muon_weight_decay = 0.28  # Muon's cautious weight decay (decays with the lr); None: training.muon_weight_decay_for
polar_express = True  # Muon orthogonalises with the Polar Express coefficients (else the fixed Newton-Schulz quintic)
muon_beta2 = 0.0  # NorMuon: EMA factor of the update's per-row variance (0 turns it off)
grad_clip = 0.0  # clip the global gradient norm to this; 0 turns clipping off
config = configure(globals(), none_types={"muon_weight_decay": (float,), "compile_optimizer": (bool,),
                                          "short_window": (int,)})
# -----------------------------------------------------------------------------



MODEL_OPTIONS = ("value_embeds", "smear", "backout", "x0_lambdas", "rotary_base", "qk_scale", "window_pattern",
                 "short_window")  # GPTConfig's


def percentile(xs, q):
    """The q-th percentile (0..100) of the numbers xs, linear interpolation between order statistics."""
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def time_stats(times):
    """Summary of step times in seconds: median, min, max, p10, p90, n."""
    return {"median": statistics.median(times), "min": min(times), "max": max(times),
            "p10": percentile(times, 10), "p90": percentile(times, 90), "n": len(times)}


def cpu_name():
    """The CPU model name from /proc/cpuinfo (Linux), else platform.processor()."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def peak_rss_bytes():
    """This process's peak resident set size so far, in bytes (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def resolve_total_batch_size(cfg, vocab_size):
    """cfg's total_batch_size, or for -1 base_train's automatic one: training.auto_total_batch_size of the horizons
    of this model and of depth 12 (their scaling parameters, counted on the meta device; the tokens-per-parameter
    ratio cancels). Returns an int (tokens per optimizer step)."""
    if cfg["total_batch_size"] != -1:
        return cfg["total_batch_size"]
    options = {k: cfg[k] for k in MODEL_OPTIONS if k not in ("window_pattern", "short_window")}
    with torch.device("meta"):
        horizon, ref = (GPT(config_from_depth(d, vocab_size, cfg["max_seq_len"], **options)).num_scaling_params()
                        for d in (cfg["depth"], 12))
    return auto_total_batch_size(horizon, ref)


def check_config(cfg):
    """Raises UserError for settings the benchmark cannot run (each setting's range: configure(), validate)."""
    per = cfg["device_batch_size"] * cfg["max_seq_len"]
    if cfg["total_batch_size"] != -1 and cfg["total_batch_size"] % per != 0:
        raise UserError(f"--total_batch_size={cfg['total_batch_size']} is not a multiple of device_batch_size * "
                        f"max_seq_len = {per}")
    if cfg["adamw"] not in ("", "foreach", "fused", "for"):
        raise UserError(f"--adamw={cfg['adamw']!r}: expected '', 'foreach', 'fused' or 'for'")
    if cfg["ns_dtype"] not in ("", "float32", "bfloat16"):
        raise UserError(f"--ns_dtype={cfg['ns_dtype']!r}: expected '', 'float32' or 'bfloat16'")


def rebuild_adamw(opt, kind):
    """A fresh torch AdamW over opt's parameter groups (lr, initial_lr kept) with the implementation `kind`."""
    groups = [dict(params=g["params"], lr=g["lr"], initial_lr=g["initial_lr"]) for g in opt.param_groups]
    d = opt.defaults
    return torch.optim.AdamW(groups, betas=d["betas"], eps=d["eps"], weight_decay=d["weight_decay"],
                             fused=kind == "fused", foreach=kind == "foreach")


class Setup:
    """
    One configuration ready to step: base_train's model, optimizers and TokenLoader. step() runs one timed optimizer
    step and returns its wall time in seconds; activate() applies the process-wide knob (the thread count) before
    this configuration's steps.
    """

    def __init__(self, cfg, tokenizer, train_files, device):
        self.cfg, self.device = cfg, device
        self.compute_dtype, self.autocast_ctx = precision(cfg["dtype"], device)
        self.model_config = config_from_depth(cfg["depth"], tokenizer.get_vocab_size(), cfg["max_seq_len"],
                                              **{k: cfg[k] for k in MODEL_OPTIONS})
        self.grad_accum_steps = cfg["total_batch_size"] // (cfg["device_batch_size"] * cfg["max_seq_len"])
        self.default_threads = torch.get_num_threads()
        self.activate()
        seed_everything(cfg["seed"])
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the JSON
            model = build_model(self.model_config, device)
            if cfg["fp8"]:  # as base_train: before the optimizers and compile
                check_fp8(cfg["fp8_recipe"], cfg["fp8_emulate"], device)
                print(describe(convert_to_fp8(model, cfg["fp8_recipe"], cfg["fp8_emulate"]), cfg["fp8_recipe"],
                               cfg["fp8_emulate"]))
            muon_wd = cfg["muon_weight_decay"]
            if muon_wd is None:
                muon_wd = muon_weight_decay_for(self.model_config.model_dim)
            self.optimizers = setup_optimizers(  # lrs: setup_optimizers' defaults (they change no work)
                model,
                ns_dtype=cfg["ns_dtype"], muon_weight_decay=muon_wd, weight_decay=cfg["weight_decay"],
                embedding_beta2=cfg["embedding_beta2"], unembedding_beta2=cfg["unembedding_beta2"],
                polar_express=cfg["polar_express"], muon_beta2=cfg["muon_beta2"])
        if cfg["adamw"]:
            self.optimizers[0] = rebuild_adamw(self.optimizers[0], cfg["adamw"])
        self.compile_optimizer = cfg["compile"] if cfg["compile_optimizer"] is None else cfg["compile_optimizer"]
        if self.compile_optimizer:  # a torch AdamW rebuilt by --adamw stays eager
            with contextlib.redirect_stdout(sys.stderr):
                self.compile_optimizer = compile_optimizer_step(self.optimizers, device)
        model.activation_checkpointing = policy_name(cfg["activation_checkpointing"])
        self.orig_model = model
        self.model = torch.compile(model, dynamic=False) if cfg["compile"] else model
        self.num_params, self.flops_per_token = model.num_params(), model.estimate_flops()
        self.loader = TokenLoader(tokenizer, train_files, cfg["device_batch_size"], cfg["max_seq_len"], device,
                                  prefetch=None if cfg["prefetch"] < 0 else cfg["prefetch"],
                                  row_packing=cfg["row_packing"])
        self.tokenizer, self.train_files = tokenizer, train_files
        self.step_count = 0

    def activate(self):
        torch.set_num_threads(self.cfg["threads"] or self.default_threads)

    def step(self):
        """One optimizer step exactly as base_train's loop runs it (loader, micro-steps, update, the step's one host
        read of its loss, gradient norm and stop flag), from an idle device to that read."""
        synchronize(self.device)
        t0 = time.perf_counter()
        with record_function("loader"):
            x, y = self.loader.next_batch(self.cfg["device_batch_size"] * self.grad_accum_steps)
        with record_function("forward_backward"):
            loss = forward_backward(self.model, micro_batches(x, y, self.cfg["device_batch_size"]), self.autocast_ctx)
        with record_function("optimizer_step"):
            grad_norm = optimizer_step(self.orig_model, self.optimizers, 1.0, muon_momentum(self.step_count),
                                       self.cfg["grad_clip"])
        with record_function("host_read"):
            read_step_stats(step_stats(loss, grad_norm, False, self.device), self.step_count, "bench")
        self.step_count += 1
        return time.perf_counter() - t0

    def loader_tokens_per_sec(self, seconds):
        """Input tokens/s of a fresh TokenLoader alone (same rows per step, same prefetch), after one warm batch."""
        rows = self.cfg["device_batch_size"] * self.grad_accum_steps
        loader = TokenLoader(self.tokenizer, self.train_files, rows, self.cfg["max_seq_len"], self.device,
                             prefetch=self.loader.prefetch, row_packing=self.cfg["row_packing"])
        loader.next_batch()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            loader.next_batch()
            n += 1
        dt = time.perf_counter() - t0
        loader.close()
        return n * rows * self.cfg["max_seq_len"] / dt

    def memory_estimate(self):
        """(peak bytes, how it was measured): CUDA max_memory_allocated, or the MemTracker estimate on CPU/MPS."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device), "torch.cuda.max_memory_allocated"
        if not self.cfg["memory_estimate"]:
            return None, "not measured (--memory_estimate=False)"
        build = gpt_builder(self.model_config, activation_checkpointing=self.cfg["activation_checkpointing"],
                            fp8_recipe=self.cfg["fp8_recipe"] if self.cfg["fp8"] else None,
                            fp8_emulate=self.cfg["fp8_emulate"])
        state = torch.get_rng_state()
        peak = measure_fake_peak(build, self.cfg["device_batch_size"], max_seq_len=self.cfg["max_seq_len"],
                                 vocab_size=self.model_config.vocab_size, device=self.device,
                                 amp_dtype=self.compute_dtype)
        torch.set_rng_state(state)
        return peak, "MemTracker estimate of the eager training step (nanotrain.auto_batch_size.probe.measure_fake_peak)"


def tokenizer_throughput(tokenizer, train_files, num_threads=4, max_chars=1_000_000, repeats=3):
    """
    Encode throughput of tokenizer.encode(list of documents, num_threads) on the first documents of the data
    (up to max_chars characters), best of `repeats`: {"chars_per_sec", "tokens_per_sec", "docs", "chars", ...}.
    """
    docs, chars = [], 0
    for _, text in iter_documents(train_files):
        docs.append(text)
        chars += len(text)
        if chars >= max_chars:
            break
    best, n_tokens = float("inf"), 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        ids = tokenizer.encode(docs, num_threads=num_threads)
        best = min(best, time.perf_counter() - t0)
        n_tokens = sum(len(x) for x in ids)
    return {"chars_per_sec": chars / best, "tokens_per_sec": n_tokens / best, "docs": len(docs), "chars": chars,
            "tokens": n_tokens, "num_threads": num_threads}


def profile_breakdown(prof, steps, top=20):
    """
    Where a profiled step's time goes, per optimizer step in seconds (host time: on CUDA the kernels' own time is in
    the stderr table): "phases" (loader, forward, backward, optimizer_step; backward is the autograd engine's
    evaluate_function events, forward the rest of forward_backward, which includes the head's gradients: the chunked
    head loss computes them in its forward, nanotrain.kernels) and the `top` ops by self time with their share
    of all ops' self time and calls per step.
    """
    events = prof.key_averages()
    by_key = {e.key: e for e in events}
    backward = sum(e.cpu_time_total for e in events if e.key.startswith("autograd::engine::evaluate_function"))
    phases = {k: by_key[k].cpu_time_total for k in ("loader", "forward_backward", "optimizer_step") if k in by_key}
    phases["forward"] = phases.pop("forward_backward", 0) - backward
    phases["backward"] = backward
    ops = [e for e in events if e.key not in ("loader", "forward_backward", "optimizer_step")
           and not e.key.startswith("autograd::engine::evaluate_function")]
    total = sum(e.self_cpu_time_total for e in ops) or 1
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return {"phases_s_per_step": {k: v / 1e6 / steps for k, v in phases.items()},
            "top_ops": [{"op": e.key, "self_s_per_step": e.self_cpu_time_total / 1e6 / steps,
                         "share": e.self_cpu_time_total / total, "calls_per_step": e.count / steps}
                        for e in ops[:top]]}


def measure_peaks(device, dtypes, peaks):
    """Appends one get_peak_flops(device, dtype) measurement per compute dtype in `dtypes` to peaks[dtype] (a list
    of (FLOP/s, source)). On CUDA the datasheet figure, measured once."""
    for dtype in dict.fromkeys(dtypes):
        if device.type != "cuda" or not peaks.get(dtype):
            peaks.setdefault(dtype, []).append(get_peak_flops(device, dtype))


def summarize(s, times, warmup_times, peak, peak_source, peak_samples, rss_delta):
    """The result object of one configuration (see the module docstring)."""
    st = time_stats(times)
    tokens_per_sec = s.cfg["total_batch_size"] / st["median"]
    achieved = s.flops_per_token * tokens_per_sec
    mem, mem_source = s.memory_estimate()
    loader_tps = s.loader_tokens_per_sec(s.cfg["loader_seconds"])
    c = s.model_config
    return {
        "config": dict({k: s.cfg[k] for k in ("depth", "max_seq_len", "device_batch_size", "total_batch_size",
                                              "dtype", "compile", "activation_checkpointing", "threads", "adamw",
                                              "ns_dtype", "data", "fp8", "fp8_recipe", "fp8_emulate")},
                       prefetch=s.loader.prefetch, compile_optimizer=s.compile_optimizer),
        "dtype": str(s.compute_dtype).removeprefix("torch."), "grad_accum_steps": s.grad_accum_steps,
        "ns_dtype": s.cfg["ns_dtype"] or str(ns_dtype_for(s.device)).replace("torch.", ""),
        "model": {"n_layer": c.n_layer, "model_dim": c.model_dim, "n_head": c.n_head, "vocab_size": c.vocab_size,
                  "num_params": s.num_params},
        "tokens_per_step": s.cfg["total_batch_size"],
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_p10_p90": [s.cfg["total_batch_size"] / st["p90"], s.cfg["total_batch_size"] / st["p10"]],
        "step_time_s": st,
        "warmup_step_times_s": warmup_times,
        "compile_s": (warmup_times[0] - st["median"]) if s.cfg["compile"] and warmup_times else None,
        "flops_per_token": s.flops_per_token,
        "achieved_flops": achieved,
        "peak_flops": peak, "peak_flops_source": peak_source, "peak_flops_samples": peak_samples,
        "mfu": None if peak is None else achieved / peak,
        "peak_memory_bytes": mem, "peak_memory_source": mem_source,
        "rss_peak_delta_bytes": rss_delta,
        "loader_tokens_per_sec": loader_tps,
        "loader_vs_trainer": loader_tps / tokens_per_sec,
        "threads": s.cfg["threads"] or s.default_threads,
    }


def busy_machine_warnings(results, system):
    """
    Signs that other work shared the machine (list of strings, empty when none): peak samples more than 15% apart,
    or a 1-minute load average above the core count. A busy machine lowers the measured CPU peak (inflating MFU) and
    spreads the step times; compare configurations with --vs then.
    """
    out = []
    for r in results:
        if None in r["peak_flops_samples"]:  # a GPU not in GPU_PEAK_FLOPS: no peak, MFU n/a
            continue
        lo, hi = min(r["peak_flops_samples"]), max(r["peak_flops_samples"])
        if hi > 1.15 * lo:
            out.append(f"matmul peak samples differ by {100 * (hi / lo - 1):.0f}% ({lo / 1e9:.0f} vs {hi / 1e9:.0f} "
                       f"GFLOP/s): the machine was busy; MFU and tokens/s are unreliable")
    load = max(system["load_avg_start"][0], system["load_avg_end"][0])
    if system["device"] == "cpu" and load > (system["cpu_count"] or 1):
        out.append(f"1-minute load average {load:.2f} > {system['cpu_count']} cores: other processes shared the CPU")
    return out


def main():

    is_ddp, _, _, _, device = compute_init(device_type)
    if is_ddp:
        raise UserError("scripts/bench.py runs as one process; start it with python, not torchrun")
    cfg_a = dict(config)
    check_config(cfg_a)  # the flags first: a bad one is one line before the tokenizer loads
    cfg_b = None
    if vs and profile:
        raise UserError("--profile=True profiles one configuration: leave out --vs")
    if vs:
        args = shlex.split(vs)
        try:
            cfg_b = apply_overrides(cfg_a, args)
            validate(cfg_b, cfg_a)  # the ranges configure() checked for cfg_a
        except ConfigError as e:
            raise UserError(f"--vs={vs!r}: {e}") from None
        if any(a.split("=", 1)[0] in ("--vs", "--device_type", "--data") for a in args):
            raise UserError(f"--vs={vs!r}: may not change vs, device_type or data")
        check_config(cfg_b)
    load_start = os.getloadavg()
    tokenizer = get_tokenizer()  # UserError naming tok_train.py when missing
    for cfg in filter(None, (cfg_a, cfg_b)):  # -1: base_train's automatic total batch for this model
        cfg["total_batch_size"] = resolve_total_batch_size(cfg, tokenizer.get_vocab_size())
        check_config(cfg)
    train_files = resolve_data_files(data, "train")
    rss0 = peak_rss_bytes()
    setups = [Setup(cfg_a, tokenizer, train_files, device)]
    if cfg_b is not None:
        setups.append(Setup(cfg_b, tokenizer, train_files, device))
    for st in setups:
        print(f"total batch {st.cfg['total_batch_size']:,} tokens => grad_accum_steps {st.grad_accum_steps} "
              f"(micro-batches of {st.cfg['device_batch_size']} x {st.cfg['max_seq_len']})", file=sys.stderr)
    peaks = {}
    measure_peaks(device, [st.compute_dtype for st in setups], peaks)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    warm = []
    for st in setups:
        st.activate()
        warm.append([st.step() for _ in range(st.cfg["warmup_steps"])])
    times, ratios = [[] for _ in setups], []
    prof = None
    if cfg_b is None and profile:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as prof:
            times[0] = [setups[0].step() for _ in range(steps)]
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25), file=sys.stderr)
    elif cfg_b is None:
        times[0] = [setups[0].step() for _ in range(steps)]
    else:
        for r in range(pairs):
            round_tps = {}
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                setups[i].activate()
                t = [setups[i].step() for _ in range(setups[i].cfg["pair_steps"])]
                times[i] += t
                round_tps[i] = setups[i].cfg["total_batch_size"] / statistics.median(t)
            ratios.append(round_tps[1] / round_tps[0])
    rss_delta = peak_rss_bytes() - rss0 if cfg_b is None and device.type == "cpu" else None
    measure_peaks(device, [st.compute_dtype for st in setups], peaks)  # again after the steps (CPU): the max is used

    results = []
    for st, t, w in zip(setups, times, warm):
        st.activate()
        samples = [f for f, _ in peaks[st.compute_dtype]]
        source = peaks[st.compute_dtype][0][1]
        if device.type != "cuda":
            source += f" (1024x1024), max of {len(samples)} measurements before/after the timed steps"
        results.append(summarize(st, t, w, max(samples), source, samples, rss_delta))
    system = {
        "torch": torch.__version__, "python": platform.python_version(), "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
        "load_avg_start": list(load_start), "load_avg_end": list(os.getloadavg()),
    }
    tok = tokenizer_throughput(tokenizer, train_files, setups[0].loader.num_threads, tokenizer_chars)
    warnings = busy_machine_warnings(results, system)
    if cfg_b is None:
        out = dict(results[0], tokenizer=tok, system=system, warnings=warnings)
        if prof is not None:
            out["profile"] = profile_breakdown(prof, steps)
    else:
        out = {"a": results[0], "b": results[1], "tokenizer": tok, "system": system, "warnings": warnings,
               "vs": {"overrides": vs, "ratios": ratios, "median_ratio": statistics.median(ratios),
                      "metric": "tokens/s of b / tokens/s of a, per round", "pairs": pairs,
                      "pair_steps": pair_steps, "order": "a b, b a, a b, ... (alternating)"}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    run_script(main)
