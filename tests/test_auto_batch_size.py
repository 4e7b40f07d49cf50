"""
Tests for nanotrain/auto_batch_size/ on CPU: the search on a simulated device that raises
real torch.OutOfMemoryError, the candidate arithmetic, the byte margin, the OOM message table, the fake-tensor
measurement (affine in B, optimizer state counted, equal to a real CPU step), probe hygiene, the cache, the logging
contract, the brute-force acceptance check, the out-of-memory step-down of training (OOMStepDown), plan mode
(scripts/auto_batch_plan.py), and GPU-only checks (skipped without CUDA).
"""

import json
import math
import os
import random
import re
import subprocess
import sys
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import grads, rel, tiny_model

import nanotrain.auto_batch_size.builders as ab_builders
import nanotrain.auto_batch_size.cache as ab_cache
import nanotrain.auto_batch_size.probe as ab_probe
import nanotrain.auto_batch_size.search as ab_search
from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.cache import cache_key, cache_path, drop_cached
from nanotrain.auto_batch_size.probe import measure_fake_peak
from nanotrain.auto_batch_size.search import candidate_batch_sizes, discover_device_batch_size, search_batch_size
from nanotrain.auto_batch_size.stepdown import OOMStepDown, next_smaller_candidate
from nanotrain.common import compute_init
from nanotrain.errors import UserError
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers
from nanotrain.training import OOM_MESSAGES, forward_backward, is_oom_error, micro_batches

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(REPO, "scripts", "auto_batch_plan.py")
GiB = 2**30
TINY_GPT = GPTConfig(max_seq_len=32, vocab_size=256, n_layer=1, n_head=2, n_kv_head=2, model_dim=32)
SUMMARY = re.compile(r"^Auto-discovery found device_batch_size=(\d+) \| grad_accum_steps=(\d+) \| probes=(\d+) \| "
                     r"[\d.]+s \| cache (hit|miss)$")


# ----------------------------------------------------------------------------- helpers

class SimulatedDevice:
    """A device whose training step needs a + b * B bytes and raises a real torch.OutOfMemoryError (with the CUDA
    allocator's message) above `capacity` bytes. Counts the step calls."""

    def __init__(self, a, b, capacity):
        self.a, self.b, self.capacity, self.calls = a, b, capacity, []

    def step(self, batch_size):
        self.calls.append(batch_size)
        peak = self.a + self.b * batch_size
        if peak > self.capacity:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {self.b / 2**20:.2f} MiB. GPU 0 has a "
                                         f"total capacity of {self.capacity / GiB:.2f} GiB of which 0 bytes is free.")
        return peak


def fits_on(device, limit=None):
    """fits(B) for a simulated device: False on an OOM (classified by is_oom_error) or a peak above `limit` bytes."""
    def fits(batch_size):
        try:
            peak = device.step(batch_size)
        except Exception as exc:
            if not is_oom_error(exc):
                raise
            return False
        return limit is None or peak <= limit
    return fits


def bound(n):
    return math.ceil(math.log2(n)) + 2 if n > 1 else 1


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


class TinyLM(nn.Module):
    """A tiny language model (embedding, one MLP, head, fp32 cross-entropy) whose fake probes take ~0.1 s."""

    def __init__(self, vocab_size=64, dim=16):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, dim)
        self.fc = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx)
        x = x + F.relu(self.fc(x))
        logits = self.head(x).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def build_tiny(device):
    with torch.device(device):
        model = TinyLM()
    return model, [torch.optim.AdamW(model.parameters(), lr=1e-3)]


TINY_ARGS = dict(max_seq_len=16, vocab_size=64, total_batch_size=16 * 64, world_size=1, device="cpu", amp_dtype=None,
                 compile=False, key_fields={"model": "TinyLM"})


def tiny_peaks(sizes=(1, 2, 4, 8, 16, 32, 64)):
    return {b: measure_fake_peak(build_tiny, b, max_seq_len=16, vocab_size=64) for b in sizes}


def budget_between(peak_fit, peak_nofit, margin=ab_search.DEFAULT_MARGIN):
    """A device_memory_gb whose margin * budget lies between the two peaks."""
    return (peak_fit + peak_nofit) / 2 / margin / GiB


# ----------------------------------------------------------------------------- candidates

@pytest.mark.unit
def test_candidates_are_exactly_the_divisors_and_always_divide():
    """Catches: candidates that break total_batch_size divisibility (a crash at the first step), a missing divisor (e.g. only
    powers of two, which loses 3 * 2^k sizes on 6 GPUs), or a cap applied as '<' instead of '<='."""
    rng = random.Random(0)
    for _ in range(200):
        seq, world, n = rng.choice([16, 64, 256, 2048]), rng.choice([1, 2, 3, 6, 8]), rng.randint(1, 3000)
        total = n * seq * world
        cands = candidate_batch_sizes(total, seq, world)
        assert cands == divisors(n)
        for c in cands:
            assert total % (c * seq * world) == 0
        cap = rng.randint(1, n)
        assert candidate_batch_sizes(total, seq, world, max_batch_size=cap) == [d for d in divisors(n) if d <= cap]
    assert candidate_batch_sizes(3 * 2**19, 2048, 6) == divisors(128)  # 6 GPUs: every divisor of 128


@pytest.mark.unit
def test_candidates_user_error_shows_the_arithmetic():
    """Catches: a bare assert / ZeroDivisionError instead of a one-line UserError naming the flag and the numbers."""
    with pytest.raises(UserError, match=r"--total_batch_size=1000 is not a multiple of max_seq_len \* world_size = "
                                        r"64 \* 2 = 128 \(remainder 104\)"):
        candidate_batch_sizes(1000, 64, 2)
    with pytest.raises(UserError, match="--max_batch_size=0"):
        candidate_batch_sizes(1024, 64, 1, max_batch_size=0)


@pytest.mark.unit
@pytest.mark.parametrize("args", [(0, 64, 1), (1024, 0, 1), (1024, 64, 0), (-128, 64, 1)])
def test_candidates_refuse_non_positive_arguments_in_one_line(args):
    """Each of the three arguments alone at 0 (or a negative total): the whole one-line message. Catches a check that
    leaves one argument out (0 tokens give no candidates; a 0 row length or world size divides by zero)."""
    total, seq, world = args
    with pytest.raises(UserError) as info:
        candidate_batch_sizes(total, seq, world)
    assert str(info.value) == (f"--total_batch_size={total}, --max_seq_len={seq} and world_size={world} must be "
                               f"positive")


@pytest.mark.unit
def test_next_smaller_candidate():
    """Catches: stepping down by halving (16 -> 8 when 12 is valid) or returning a non-candidate."""
    cands = divisors(48)
    assert next_smaller_candidate(cands, 16) == 12
    assert next_smaller_candidate(cands, 1) is None
    assert next_smaller_candidate(cands, 48) == 24


# ----------------------------------------------------------------------------- search on a simulated device

def candidate_sets(rng):
    yield divisors(2 ** rng.randint(0, 12))  # powers of two
    yield divisors(3 * 2 ** rng.randint(0, 11))  # 6 GPUs: 3 * 2^k
    yield divisors(rng.randint(1, 100_000))  # random divisor sets


@pytest.mark.unit
def test_search_finds_exactly_the_largest_fitting_candidate_within_the_bound():
    """Catches: an off-by-one bisection, a search that stops at the first failure above a success without refining,
    one that probes a size twice, or one that needs more than ceil(log2(n)) + 2 probes; with and without a predicted
    start index. Each probe is a real torch.OutOfMemoryError on a simulated device."""
    rng = random.Random(1)
    for trial in range(600):
        for cands in candidate_sets(rng):
            a, b = rng.uniform(0, 10) * GiB, rng.uniform(0.01, 2) * GiB
            capacity = a + b * rng.uniform(0.5, cands[-1] * 1.2)
            truth = [c for c in cands if a + b * c <= capacity]
            start = rng.randrange(len(cands)) if trial % 2 else None
            device = SimulatedDevice(a, b, capacity)
            if not truth:
                with pytest.raises(UserError):
                    search_batch_size(fits_on(device), cands, start_index=start)
            else:
                assert search_batch_size(fits_on(device), cands, start_index=start) == truth[-1]
            assert len(device.calls) <= bound(len(cands)), (cands, device.calls)
            assert len(set(device.calls)) == len(device.calls), device.calls
            assert set(device.calls) <= set(cands)


@pytest.mark.unit
@pytest.mark.parametrize("start_index,largest_fit,calls", [
    (3, 8, [8, 16]),  # the prediction is right: it and the next size up, nothing else
    (4, 8, [16, 8]),  # one too high: it, then the size below
    (0, 1, [1, 2]),  # the smallest index as given, not moved up
    (99, 8, [64, 32, 4, 8, 16]),  # past the end: clamped to the largest, then its neighbour, then bisection
    (-5, 1, [1, 2]),  # below 0: clamped to the smallest
])
def test_search_from_a_predicted_index_probes_this_literal_sequence(start_index, largest_fit, calls):
    """The sizes probed, in order, on candidates [1, 2, 4, 8, 16, 32, 64] (worked by hand). Catches a neighbour on the
    wrong side (a right guess probing downwards wastes the bisection's first probes), a neighbour two away, a clamp
    to index 1 or past the end (IndexError)."""
    probed = []

    def fits(b):
        probed.append(b)
        return b <= largest_fit
    assert search_batch_size(fits, [1, 2, 4, 8, 16, 32, 64], start_index=start_index) == largest_fit
    assert probed == calls


def gallop_from_one(fits, candidates):
    """Lightning's 'binsearch' idea over the candidate list: try indices 0, 1, 3, 7, ... (sizes 1, 2,
    4, 8, ... for powers of two) until a failure, then bisect the bracket. Correct, but not within the bound."""
    lo, i = -1, 0
    while i < len(candidates) and fits(candidates[i]):
        lo, i = i, 2 * i + 1
    hi = min(i, len(candidates))
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            lo = mid
        else:
            hi = mid
    return candidates[lo]


@pytest.mark.unit
def test_counter_example_galloping_from_one_exceeds_the_bound():
    """The wrong variant (gallop from 1, then bisect) finds the right answer but needs more than
    ceil(log2(n)) + 2 probes on a long list; our search stays within the bound on the same device."""
    cands = divisors(2**20 * 15)  # 84 candidates
    a, b = 1 * GiB, 1024
    capacity = a + b * cands[-2]
    gallop_device, our_device = SimulatedDevice(a, b, capacity), SimulatedDevice(a, b, capacity)
    assert gallop_from_one(fits_on(gallop_device), cands) == cands[-2]
    assert search_batch_size(fits_on(our_device), cands) == cands[-2]
    assert len(gallop_device.calls) > bound(len(cands))
    assert len(our_device.calls) <= bound(len(cands))


@pytest.mark.unit
def test_margin_is_in_bytes_not_in_batch_units():
    """Counter-example: Lightning 2.6 applies its margin in batch units (B * (1 - margin), then snapped to a candidate),
    which halves a power-of-two answer whose peak fits under the byte margin (32 -> 27 -> 16). Also catches a margin
    that is ignored (returning the raw no-OOM limit)."""
    cands = divisors(256)
    a, b, margin = 10 * GiB, 1 * GiB, 0.85  # peak(B) = 10 GiB + B GiB
    # device of 50 GiB: 32 rows peak at 42 GiB <= 0.85 * 50 = 42.5 GiB, 64 rows OOM
    raw = search_batch_size(fits_on(SimulatedDevice(a, b, 50 * GiB)), cands)
    ours = search_batch_size(fits_on(SimulatedDevice(a, b, 50 * GiB), limit=margin * 50 * GiB), cands)
    batch_units = max(c for c in cands if c <= int(raw * margin))
    assert (raw, ours, batch_units) == (32, 32, 16)
    # device of 80 GiB: 64 rows run without an OOM (74 GiB) but exceed 0.85 * 80 = 68 GiB, so the answer is 32
    raw = search_batch_size(fits_on(SimulatedDevice(a, b, 80 * GiB)), cands)
    ours = search_batch_size(fits_on(SimulatedDevice(a, b, 80 * GiB), limit=margin * 80 * GiB), cands)
    assert (raw, ours) == (64, 32)


@pytest.mark.unit
def test_nothing_fits_is_a_clear_user_error():
    """Catches: returning 0 / the smallest candidate / raising IndexError when even B=1 does not fit."""
    with pytest.raises(UserError, match=r"not even the smallest candidate, 1; use a larger --device_memory_gb"):
        search_batch_size(fits_on(SimulatedDevice(100 * GiB, GiB, 80 * GiB)), divisors(64))


@pytest.mark.unit
def test_non_oom_errors_propagate_from_the_search():
    """Catches: a fits wrapper that treats every exception as 'too big' (hiding real bugs)."""
    class BrokenDevice(SimulatedDevice):
        def step(self, batch_size):
            if batch_size > 8:
                raise RuntimeError("CUDA error: device-side assert triggered")
            return super().step(batch_size)
    with pytest.raises(RuntimeError, match="device-side assert"):
        search_batch_size(fits_on(BrokenDevice(0, 1, 10**12)), divisors(64))


@pytest.mark.unit
def test_search_rejects_bad_candidates():
    """Descending, empty, repeated (a size twice would be probed twice) and non-positive candidates: the whole
    message. Catches a check that lets equal neighbours through and a message without the list."""
    for cands in ([4, 2], [], [1, 2, 2, 4], [0, 1]):
        with pytest.raises(ValueError) as info:
            search_batch_size(lambda b: True, cands)
        assert str(info.value) == f"candidates must be ascending distinct positive ints, got {cands}"


# ----------------------------------------------------------------------------- OOM classification

REAL_OOM_MESSAGES = [
    (torch.OutOfMemoryError, "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
                             "of which 1.06 GiB is free. Of the allocated memory 75.1 GiB is allocated by PyTorch"),
    (torch.AcceleratorError, "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some "
                             "other API call, so the stacktrace below might be incorrect."),
    (torch.OutOfMemoryError, "HIP out of memory. Tried to allocate 978.00 MiB. GPU 0 has a total capacity of 15.98 GiB "
                             "of which 630.00 MiB is free."),
    (RuntimeError, "HIP error: out of memory\nHIP kernel errors might be asynchronously reported"),
    (torch.OutOfMemoryError, "XPU out of memory. Tried to allocate 59.61 GiB. GPU 0 has a total capacity of 28.55 GiB "
                             "of which 12.01 GiB is free."),
    (RuntimeError, "Allocation is out of device memory on current platform."),
    (RuntimeError, "MPS backend out of memory (MPS allocated: 17.21 GiB, other allocations: 1.02 GiB, max allowed: "
                   "20.13 GiB). Tried to allocate 2.00 GiB on private pool."),
    (RuntimeError, "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                   "tried to allocate 1125899906842624 bytes. Error code 12 (Cannot allocate memory)"),
]


@pytest.mark.unit
@pytest.mark.parametrize("cls,message", REAL_OOM_MESSAGES)
def test_real_oom_messages_are_classified(cls, message):
    """Catches: Lightning's 'CUDA' + 'out of memory' rule, which misses HIP, XPU and MPS OOMs."""
    assert is_oom_error(cls(message))


@pytest.mark.unit
def test_every_table_marker_has_a_real_message_and_a_source():
    assert all(any(marker in msg for _, msg in REAL_OOM_MESSAGES) for marker, _ in OOM_MESSAGES)
    assert all(len(source) > 20 for _, source in OOM_MESSAGES)


@pytest.mark.unit
@pytest.mark.parametrize("exc", [
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous "
                 "input."),
    RuntimeError("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!"),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"),
    ValueError("CUDA out of memory."),  # not a RuntimeError: not from torch's allocator
    MemoryError(),
    KeyError("out of memory"),
])
def test_other_errors_are_not_oom(exc):
    """Catches: a classifier that matches 'out of memory' anywhere or any RuntimeError, hiding real bugs."""
    assert not is_oom_error(exc)


@pytest.mark.unit
def test_torch_out_of_memory_error_is_oom_whatever_its_message():
    assert is_oom_error(torch.OutOfMemoryError("anything"))
    assert is_oom_error(torch.cuda.OutOfMemoryError("anything"))


# ----------------------------------------------------------------------------- fake-tensor measurement

@pytest.mark.unit
def test_fake_peak_is_affine_in_batch_size_and_counts_the_optimizer_state():
    """Catches: a measurement that ignores activations (flat in B) or double counts them (superlinear), and - the
    counter-example - a probe without the optimizer step, which misses the lazily created AdamW/Muon state: its peak
    is lower by (optimizer state - gradients - the first micro-batch's tokens), the difference between the 3rd
    micro-step's peak (state alive) and the 2nd's (gradients and both micro-batches' tokens alive). From 2 rows: at 1
    row this tiny model's peak is in the optimizer step (Muon's stacks of same-shape matrices), not in a micro-step."""
    build = gpt_builder(TINY_GPT)
    peaks = {b: measure_fake_peak(build, b, max_seq_len=32, vocab_size=256) for b in (2, 4, 8)}
    slope = peaks[4] - peaks[2]
    assert slope > 0
    assert abs(peaks[8] - (peaks[2] + slope * 3)) <= 0.01 * peaks[8]
    no_step = measure_fake_peak(build, 4, max_seq_len=32, vocab_size=256, optimizer_step=False)
    model, optimizers = build("cpu")
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ab_probe.probe_step(model, optimizers, 1, 32, 256, device="cpu", generator=torch.Generator().manual_seed(0))
    state_bytes = sum(t.numel() * t.element_size() for opt in optimizers for s in opt.state.values()
                      for t in s.values() if torch.is_tensor(t))
    assert state_bytes > grad_bytes  # AdamW keeps 2 moments, Muon 1 buffer
    assert no_step < peaks[4]
    # the step-less probe peaks in its 2nd micro-step, where the step's 1st micro-batch of tokens (inputs and
    # targets, 4 x 32 int64 each: 2,048 bytes) is still held, as a training step holds all of its rows
    token_bytes = 2 * 4 * 32 * 8
    assert abs((peaks[4] - no_step) - (state_bytes - grad_bytes - token_bytes)) <= 1024  # AdamW's scalar step tensors


@pytest.mark.unit
def test_fake_peak_equals_a_real_cpu_step_and_is_plausible():
    """The fake measurement is the same accounting as MemTracker on a real CPU run of the same step (catches a fake
    path that builds a different model or skips part of the recipe). Plausibility: at least parameters + optimizer
    state + one fp32 logits tensor (B, T, V). The process RSS comparison is test_rss_of_a_real_step (slow)."""
    build = gpt_builder(TINY_GPT)
    fake = measure_fake_peak(build, 4, max_seq_len=32, vocab_size=256)
    probe = ab_probe.RealProbe(build, "cpu", 32, 256, None, 1, log=lambda *a: None)
    with probe:
        real, oom, thrash = probe.measure(4)
        param_bytes = sum(p.numel() * 4 for p in probe.model.parameters())
    assert (real, oom, thrash) == (fake, False, False)
    state_bytes = 2 * 256 * 32 * 4 * 2 + (param_bytes - 2 * 256 * 32 * 4)  # AdamW: wte + lm_head x2, Muon: blocks
    assert fake >= param_bytes + state_bytes + 4 * 32 * 256 * 4


@pytest.mark.unit
def test_meta_to_empty_factory_gets_a_clear_error():
    """A factory written like base_train (meta device + to_empty) cannot run under FakeTensorMode; catches a cryptic
    '_apply(): Couldn't swap Embedding.weight' reaching the user."""
    def meta_build(device):
        with torch.device("meta"):
            model = TinyLM()
        model.to_empty(device=device)
        return model, [torch.optim.AdamW(model.parameters())]
    with pytest.raises(ValueError, match="directly on the device"):
        measure_fake_peak(meta_build, 2, max_seq_len=16, vocab_size=64)


@pytest.mark.unit
def test_peak_tracker_matches_stock_memtracker():
    """Pins our MemTracker override (global peak only) to the stock tracker's peak: catches a torch upgrade that
    changes MemTracker internals under us."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    build = gpt_builder(TINY_GPT)
    results = []
    for make in (MemTracker, ab_probe._peak_tracker):
        with FakeTensorMode():
            model, optimizers = build("cpu")
            tracker = make()
            tracker.track_external(model, *optimizers)
            with tracker:
                ab_probe.probe_step(model, optimizers, 4, 32, 256, device="cpu", generator=torch.Generator().manual_seed(0),
                              on_micro_step=tracker.reset_mod_stats)
        results.append(ab_probe._tracker_peak_bytes(tracker))
    assert results[0] == results[1] > 0


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="known gap: since the chunked head, glibc keeps the per-chunk buffers it "
                   "frees, so the real RSS of this head-dominated step is 1.5x the fake estimate (1.11x before); "
                   "MALLOC_TRIM_THRESHOLD_=0 brings it to 1.13x but makes the step 1.58x slower")
def test_rss_of_a_real_step_is_within_the_margin_of_the_fake_estimate():
    """Independent check of the fake measurement: the RSS high-water mark of a real CPU step, in a fresh process,
    exceeds the fake estimate by less than 1/0.85 (measured: +8-14 % with full logits), and is not below it."""
    code = """
import os, torch
from nanotrain.gpt import GPTConfig
from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.probe import measure_fake_peak, probe_step
torch.set_num_threads(1)
build = gpt_builder(GPTConfig(max_seq_len=128, vocab_size=8192, n_layer=2, n_head=1, n_kv_head=1, model_dim=128))
fake = measure_fake_peak(build, 16, max_seq_len=128, vocab_size=8192)
model, opts = build("cpu")
params = sum(p.numel() * 4 for p in model.parameters())
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
base = rss()
open("/proc/self/clear_refs", "w").write("5")
probe_step(model, opts, 16, 128, 8192, device="cpu", generator=torch.Generator().manual_seed(0))
hwm = int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1]) * 1024
print(fake, hwm - base + params)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    fake, real = map(int, out.stdout.split()[-2:])
    assert fake <= real < fake / 0.85


# ----------------------------------------------------------------------------- discovery: acceptance, logging, hygiene

@pytest.mark.unit
def test_found_size_equals_a_brute_force_sweep_with_the_same_measurement(monkeypatch, tmp_path):
    """Acceptance 1: N is the largest candidate whose measured peak fits margin * budget. Catches an off-by-one in
    the search, a margin applied twice, or a different measurement in discovery than in the sweep."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    build = gpt_builder(TINY_GPT)
    args = dict(max_seq_len=32, vocab_size=256, total_batch_size=32 * 64, world_size=1, device="cpu",
                amp_dtype=None, compile=False, key_fields={})
    sweep = {b: measure_fake_peak(build, b, max_seq_len=32, vocab_size=256) for b in candidate_batch_sizes(32 * 64, 32, 1)}
    gb = budget_between(sweep[16], sweep[32])
    batch_size, record = discover_device_batch_size(build, device_memory_gb=gb, use_cache=False, log=lambda *a: None,
                                                    **args)
    expected = max(b for b, peak in sweep.items() if peak <= 0.85 * gb * GiB)
    assert batch_size == expected == 16
    for p in record["probes"]:
        assert p["peak_bytes"] == sweep[p["batch_size"]]


@pytest.mark.unit
def test_logging_contract_and_json_record(monkeypatch, tmp_path):
    """One line per probe (size, result, peak, % of budget, seconds) then exactly the summary line; the record is
    JSON-serialisable and consistent (catches a missing summary, a grad_accum_steps that does not keep the total)."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    peaks = tiny_peaks((4, 8))
    lines = []
    batch_size, record = discover_device_batch_size(build_tiny, device_memory_gb=budget_between(peaks[4], peaks[8]),
                                                    log=lines.append, **TINY_ARGS)
    probe_lines = [ln for ln in lines if ln.startswith("auto_batch_size: probe ")]
    assert len(probe_lines) == len(record["probes"]) >= 2
    for ln, p in zip(probe_lines, record["probes"]):
        assert re.match(rf"auto_batch_size: probe device_batch_size={p['batch_size']} \(search\) \| "
                        rf"(fits|over budget) \| peak [\d.]+ GiB = [\d.]+% of budget \| [\d.]+s$", ln), ln
    m = SUMMARY.match(lines[-1])
    assert m and int(m.group(1)) == batch_size == 4 and m.group(4) == "miss"
    assert int(m.group(2)) * batch_size * 16 == 16 * 64
    assert int(m.group(3)) == len(record["probes"])
    again = json.loads(json.dumps(record))
    assert again["device_batch_size"] == 4 and again["grad_accum_steps"] == 16 and again["cache_hit"] is False
    assert {"batch_size", "peak_bytes", "result", "seconds", "phase"} <= set(again["probes"][0])
    assert again["limit_bytes"] == int(0.85 * again["budget_bytes"])
    # seconds are elapsed times in milliseconds' resolution; the probes are part of the discovery's own time
    times = [p["seconds"] for p in again["probes"]] + [again["seconds"]]
    assert all(0 <= t == round(t, 3) for t in times) and sum(times[:-1]) <= times[-1] < 60
    assert again["cache_key"]["compile"] is False  # TINY_ARGS says compile=False; the default is False too


class SimulatedOOM:
    """Mixin for a real model on a simulated device: the 3rd forward of a probe (after the optimizer step has changed
    the weights and created state) raises torch.OutOfMemoryError when the batch has more than `capacity_rows` rows,
    or, with other_error, a non-OOM RuntimeError."""

    capacity_rows = 4
    other_error = False

    def forward(self, idx, targets=None, **kwargs):
        loss = super().forward(idx, targets, **kwargs)
        self.calls = getattr(self, "calls", 0) + 1
        if idx.size(0) > self.capacity_rows and self.calls % 3 == 0:
            if self.other_error:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return loss


class SimulatedOOMGPT(SimulatedOOM, GPT):
    pass


class SimulatedOOMTinyLM(SimulatedOOM, TinyLM):
    pass


def passed_model():
    torch.manual_seed(0)
    model = SimulatedOOMGPT(TINY_GPT)
    model.init_weights()
    return model, setup_optimizers(model)


def passed_tiny():
    torch.manual_seed(0)
    model = SimulatedOOMTinyLM()
    return model, [torch.optim.AdamW(model.parameters(), lr=1e-3)]


REAL_TINY_ARGS = dict(probe="real", device_memory_gb=64, max_seq_len=16, vocab_size=64, total_batch_size=16 * 16,
                      world_size=1, device="cpu", amp_dtype=None, compile=False, key_fields={"model": "TinyLM"},
                      log=lambda *a: None)


@pytest.mark.unit
def test_hygiene_after_real_probes_with_ooms(monkeypatch, tmp_path):
    """A model passed in (build_probe returns the training model) comes back bitwise unchanged, its optimizers have no
    state, no gradients, the Python/torch RNG states are restored, and the OOM probes count as 'does not fit'.
    Catches: no weight restore after the probes' optimizer steps, leftover optimizer state (lazy state would then be
    counted twice in training), gradients left behind, RNG drift (a different data order/init than without
    discovery)."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    model, optimizers = passed_model()
    before = [p.detach().clone() for p in model.parameters()]
    random.seed(123)
    torch.manual_seed(123)
    py_state, torch_state = random.getstate(), torch.get_rng_state()
    batch_size, record = discover_device_batch_size(lambda device: (model, optimizers), probe="real",
                                                    device_memory_gb=64, max_seq_len=32, vocab_size=256,
                                                    total_batch_size=32 * 16, world_size=1, device="cpu",
                                                    amp_dtype=None, compile=False, key_fields={},
                                                    log=lambda *a: None)
    assert batch_size == 4
    assert "OOM" in [p["result"] for p in record["probes"]]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(len(opt.state) == 0 for opt in optimizers)
    assert all(p.grad is None for p in model.parameters())
    assert random.getstate() == py_state and torch.equal(torch.get_rng_state(), torch_state)


@pytest.mark.unit
def test_rng_is_restored_when_build_model_draws_from_it(monkeypatch, tmp_path):
    """gpt_builder's init_weights draws from torch's global RNG on every probe; discovery must restore it (catches a
    discovery that changes the training run's initialisation and data order)."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    discover_device_batch_size(gpt_builder(TINY_GPT), probe="real", device_memory_gb=64, max_seq_len=32,
                               vocab_size=256, total_batch_size=32 * 2, world_size=1, device="cpu", use_cache=False,
                               key_fields={}, log=lambda *a: None)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.unit
def test_non_oom_errors_in_a_probe_propagate_and_weights_are_still_restored(monkeypatch, tmp_path):
    """Catches: an except clause that swallows any error as 'too big', or a restore that is skipped on errors."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    model, optimizers = passed_tiny()
    model.other_error = True
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="illegal memory access"):
        discover_device_batch_size(lambda device: (model, optimizers), use_cache=False, **REAL_TINY_ARGS)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(len(opt.state) == 0 for opt in optimizers)


@pytest.mark.unit
def test_discovery_nothing_fits_names_the_peak_and_the_flags(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    with pytest.raises(UserError, match=r"the smallest candidate, 1, peaks at [\d.]+ GiB \(over budget\) but the limit "
                                        r"is 0.85 x 0.00 GiB.*--device_memory_gb.*--max_seq_len"):
        discover_device_batch_size(build_tiny, device_memory_gb=1e-6, log=lambda *a: None, **TINY_ARGS)


def build_wide_tiny(device):
    """TinyLM with a 16,384-token vocabulary: its full fp32 logits make each row of 256 tokens cost ~48 MiB, so peaks
    differ in the second decimal of a GiB."""
    with torch.device(device):
        model = TinyLM(vocab_size=16384, dim=16)
    return model, [torch.optim.AdamW(model.parameters(), lr=1e-3)]


@pytest.mark.unit
def test_discovery_nothing_fits_message_pinned_whole(monkeypatch, tmp_path):
    """The whole message when nothing fits, for candidates [1, 2, 4] (probes 2 then 1) under a 0.01 GiB budget: it
    quotes the smallest candidate's own peak (0.05 GiB; 2 rows peak at 0.10) and the limit in GiB. Catches quoting
    the last probe that is not the smallest (2's peak), bytes multiplied by 2**30 instead of divided."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    peaks = {b: measure_fake_peak(build_wide_tiny, b, max_seq_len=256, vocab_size=16384) for b in (1, 2)}
    assert (f"{peaks[1] / GiB:.2f}", f"{peaks[2] / GiB:.2f}") == ("0.05", "0.10")  # the premise: distinguishable
    with pytest.raises(UserError) as info:
        discover_device_batch_size(build_wide_tiny, max_seq_len=256, vocab_size=16384, total_batch_size=256 * 4,
                                   world_size=1, device="cpu", device_memory_gb=0.01, use_cache=False, key_fields={},
                                   log=lambda *a: None)
    assert str(info.value) == (
        "no device_batch_size fits in memory: the smallest candidate, 1, peaks at 0.05 GiB (over budget) but the limit "
        "is 0.85 x 0.01 GiB = 0.01 GiB; use a larger --device_memory_gb (CPU/MPS budget), a smaller --max_seq_len, "
        "a smaller model or activation checkpointing")


@pytest.mark.unit
def test_a_peak_exactly_at_the_limit_fits(monkeypatch, tmp_path):
    """The contract is 'peaks at most margin * budget': with margin 1 and a budget of exactly the 8-row peak (a whole
    number of bytes), 8 fits and 16 does not. Catches `>=` for `>` in the over-budget test (answer 4)."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    peaks = tiny_peaks((8, 16))
    assert peaks[8] < peaks[16]
    batch_size, record = discover_device_batch_size(build_tiny, device_memory_gb=peaks[8] / GiB, margin=1.0,
                                                    use_cache=False, log=lambda *a: None, **TINY_ARGS)
    assert record["limit_bytes"] == peaks[8]
    assert batch_size == 8
    assert {p["batch_size"]: p["result"] for p in record["probes"]}[8] == "fits"


def masked(lines):
    """Log lines with their elapsed seconds (the only timing in them) replaced by 'Ts'."""
    return [re.sub(r"\| [\d.]+s( \||$)", r"| Ts\1", ln) for ln in lines]


@pytest.mark.unit
def test_log_lines_and_records_pinned_whole_on_miss_hit_and_no_cache(monkeypatch, tmp_path):
    """Every log line written out (seconds masked) for a budget at which the largest candidate, 64, peaks at exactly
    80.0% (under the 0.85 margin, so the search probes 8, 32, 64); then the same call again (a hit: no probe, the
    record names the cache file); then with use_cache=False (no read, no write). Catches: GiB multiplied instead of
    divided, the device's source missing from the header, a percentage that is not 100 x peak / budget, the hit
    logged as None or as a miss, a hit's record without its cache file, probe seconds rounded to whole seconds, and
    use_cache=False still reading the cache."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    peaks = tiny_peaks((8, 32, 64))
    gb = peaks[64] / 0.8 / GiB

    def run(**kwargs):
        lines = []
        batch_size, record = discover_device_batch_size(build_tiny, device_memory_gb=gb, log=lines.append,
                                                        **{**TINY_ARGS, **kwargs})
        return batch_size, record, masked(lines)

    header = ("auto_batch_size: candidates [1, 2, 4, 8, 16, 32, 64] | budget 0.00 GiB (--device_memory_gb) | "
              "limit 0.85 x budget = 0.00 GiB | measurement: fake tensors + MemTracker (no memory allocated)")
    probes = [f"auto_batch_size: probe device_batch_size={b} (search) | fits | peak {peaks[b] / GiB:.3f} GiB = "
              f"{pct} of budget | Ts" for b, pct in ((8, f"{100 * peaks[8] / peaks[64] * 0.8:.1f}%"),
                                                     (32, f"{100 * peaks[32] / peaks[64] * 0.8:.1f}%"),
                                                     (64, "80.0%"))]
    b1, r1, lines1 = run()
    assert lines1 == [header, *probes,
                      "Auto-discovery found device_batch_size=64 | grad_accum_steps=1 | probes=3 | Ts | cache miss"]
    assert b1 == 64 and all(type(p["seconds"]) is float for p in r1["probes"])
    path = str(tmp_path / "auto_batch_cache" / os.path.basename(r1["cache_path"]))
    assert r1["cache_path"] == path and os.path.exists(path)

    b2, r2, lines2 = run()
    assert lines2 == [header, "auto_batch_size: cache hit device_batch_size=64, verified by the code fingerprint and "
                              "its probes",
                      "Auto-discovery found device_batch_size=64 | grad_accum_steps=1 | probes=0 | Ts | cache hit"]
    assert (b2, r2["cache_hit"], r2["probes"], r2["cache_path"]) == (64, True, [], path)

    written = os.stat(path).st_mtime_ns
    b3, r3, lines3 = run(use_cache=False)
    assert lines3 == [header, *probes,
                      "Auto-discovery found device_batch_size=64 | grad_accum_steps=1 | probes=3 | Ts | cache miss"]
    assert (b3, r3["cache_hit"], r3["cache_path"]) == (64, False, None)
    assert os.stat(path).st_mtime_ns == written


# ----------------------------------------------------------------------------- cache

KEY_ARGS = dict(key_fields={"model_config": {"n_layer": 4, "model_dim": 256}, "activation_checkpointing": False},
                max_seq_len=256, vocab_size=32768, amp_dtype=torch.bfloat16, compile=True,
                devices=[{"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "total_memory": 85045231616,
                          "budget_bytes": 85045231616}] * 8,
                world_size=8, margin=0.85, candidates=[1, 2, 4, 8], code="abc")


@pytest.mark.unit
@pytest.mark.parametrize("field,value", [
    ("key_fields", {"model_config": {"n_layer": 5, "model_dim": 256}, "activation_checkpointing": False}),
    ("key_fields", {"model_config": {"n_layer": 4, "model_dim": 256}, "activation_checkpointing": "full"}),
    ("max_seq_len", 512), ("vocab_size", 65536), ("amp_dtype", None), ("compile", False),
    ("devices", [{"type": "cuda", "name": "NVIDIA H200", "total_memory": 85045231616,
                  "budget_bytes": 85045231616}] * 8),
    ("devices", [{"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "total_memory": 42522615808,
                  "budget_bytes": 42522615808}] * 8),
    ("devices", [{"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "total_memory": 85045231616,
                  "budget_bytes": 85045231616}] * 7 + [{"type": "cuda", "name": "NVIDIA A100-SXM4-40GB",
                                                        "total_memory": 42505273344, "budget_bytes": 42505273344}]),
    ("devices", [{"type": "cpu", "budget_bytes": 2 * GiB, "source": "--device_memory_gb"}] * 8),
    ("world_size", 4), ("margin", 0.8), ("candidates", [1, 2, 4]), ("code", "abd"),
])
def test_any_key_field_change_is_a_cache_miss(field, value, monkeypatch, tmp_path):
    """Catches a key that forgets a field that changes memory (a stale size would then be reused)."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    assert cache_path(cache_key(**{**KEY_ARGS, field: value})) != cache_path(cache_key(**KEY_ARGS))


@pytest.mark.unit
def test_torch_version_algorithm_version_and_allocator_config_are_in_the_key(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    base = cache_path(cache_key(**KEY_ARGS))
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    assert cache_path(cache_key(**KEY_ARGS)) != base
    monkeypatch.undo()
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    monkeypatch.setattr(ab_cache, "ALGORITHM_VERSION", ab_cache.ALGORITHM_VERSION + 1)
    assert cache_path(cache_key(**KEY_ARGS)) != base
    monkeypatch.setattr(ab_cache, "ALGORITHM_VERSION", ab_cache.ALGORITHM_VERSION - 1)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert cache_path(cache_key(**KEY_ARGS)) != base
    assert cache_path(cache_key(**KEY_ARGS)).startswith(os.path.join(str(tmp_path), "auto_batch_cache", ""))


@pytest.mark.unit
def test_code_fingerprint_follows_the_model_source(tmp_path, monkeypatch):
    """The fake-path cache hit is verified by the code fingerprint, so an edit of the file that builds the model must
    change it (catches reusing a size measured with old model code); and a gpt_builder factory puts its GPT config in
    the key (catches two depths sharing one entry when the caller forgets key_fields)."""
    import importlib
    mod = tmp_path / "ab_fingerprint_model.py"
    mod.write_text("def build(device):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    build = importlib.import_module("ab_fingerprint_model").build
    before = ab_cache.code_fingerprint(build)
    assert ab_cache.code_fingerprint(build) == before
    mod.write_text("def build(device):\n    return None  # edited\n")
    assert ab_cache.code_fingerprint(build) != before
    assert gpt_builder(TINY_GPT).key_fields["gpt_config"]["n_layer"] == 1


@pytest.mark.unit
def test_code_fingerprint_covers_the_whole_top_level_package_of_a_nested_builder(tmp_path, monkeypatch):
    """A builder defined in pkg/sub/builder.py: an edit anywhere in its top-level package `pkg` (here pkg/layers.py,
    which the builder could import) changes the fingerprint. Catches taking the builder's own subpackage (`pkg.sub`)
    for its top-level package, which leaves pkg/layers.py out."""
    import importlib
    (tmp_path / "ab_fp_nested" / "sub").mkdir(parents=True)
    (tmp_path / "ab_fp_nested" / "__init__.py").write_text("")
    (tmp_path / "ab_fp_nested" / "sub" / "__init__.py").write_text("")
    (tmp_path / "ab_fp_nested" / "sub" / "builder.py").write_text("def build(device):\n    return None\n")
    layers = tmp_path / "ab_fp_nested" / "layers.py"
    layers.write_text("WIDTH = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    build = importlib.import_module("ab_fp_nested.sub.builder").build
    before = ab_cache.code_fingerprint(build)
    layers.write_text("WIDTH = 2\n")
    assert ab_cache.code_fingerprint(build) != before


@pytest.mark.unit
def test_cache_hit_miss_corrupt_foreign_and_atomic(monkeypatch, tmp_path):
    """Second identical call: a hit (no probe: the fake measurement is a pure function of the key, the code
    fingerprint included), same size. A changed budget: a miss. A corrupt file and a foreign file (valid JSON, other
    key) are ignored with a warning and replaced. Writes leave no temp files. drop_cached removes the entry.
    Catches: trusting a file without checking its key, crashing on a corrupt file, torn/temporary files."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    peaks = tiny_peaks((4, 8, 16))
    gb = budget_between(peaks[4], peaks[8])

    def run(gb=gb, log=None):
        return discover_device_batch_size(build_tiny, device_memory_gb=gb, log=log or (lambda *a: None), **TINY_ARGS)
    b1, r1 = run()
    b2, r2 = run()
    assert (b1, r1["cache_hit"], b2, r2["cache_hit"], r2["probes"]) == (4, False, 4, True, [])
    assert r2["seconds"] < 0.25 * r1["seconds"]
    cache_dir = tmp_path / "auto_batch_cache"
    assert sorted(os.listdir(cache_dir)) == [os.path.basename(r1["cache_path"])]
    b3, r3 = run(gb=budget_between(peaks[8], peaks[16]))
    assert (b3, r3["cache_hit"]) == (8, False)
    path = r1["cache_path"]
    for bad in ("{not json", json.dumps({"key": {**r1["cache_key"], "margin": 0.5}, "device_batch_size": 4})):
        with open(path, "w") as f:
            f.write(bad)
        lines = []
        b, r = run(log=lines.append)
        assert (b, r["cache_hit"]) == (4, False)
        assert any("warning: ignoring the cache file" in ln for ln in lines)
        assert json.load(open(path))["key"] == r1["cache_key"]  # replaced by a valid entry
    assert not [n for n in os.listdir(cache_dir) if not n.endswith(".json")]
    assert drop_cached(r1["cache_key"]) and not os.path.exists(path) and not drop_cached(r1["cache_key"])


def edit_entry(path, edit):
    """Rewrites the cache file at `path` after edit(entry) changed the loaded dict in place."""
    with open(path) as f:
        entry = json.load(f)
    edit(entry)
    with open(path, "w") as f:
        json.dump(entry, f)


def claim(batch_size, fits=False):
    """An edit: device_batch_size=batch_size and, with fits, its search probe's result set to "fits"."""
    def edit(entry):
        entry["device_batch_size"] = batch_size
        for p in entry["probes"]:
            if fits and p["batch_size"] == batch_size:
                p["result"] = "fits"
    return edit


def rerun_after_edit(tmp_path, edit):
    """Discovery on the fake path with a budget that fits 4 but not 8, then again after edit(entry) of the cache file.
    Returns (first record, second batch size, second record, second run's log lines)."""
    peaks = tiny_peaks((4, 8))
    gb = budget_between(peaks[4], peaks[8])
    b1, r1 = discover_device_batch_size(build_tiny, device_memory_gb=gb, log=lambda *a: None, **TINY_ARGS)
    assert (b1, r1["cache_hit"]) == (4, False)
    edit_entry(r1["cache_path"], edit)
    lines = []
    b2, r2 = discover_device_batch_size(build_tiny, device_memory_gb=gb, log=lines.append, **TINY_ARGS)
    return r1, b2, r2, lines


def assert_ignored_and_replaced(r1, b2, r2, lines, why):
    """The edited entry was ignored with one warning naming its file and `why`, measured again and rewritten."""
    warnings = [ln for ln in lines if "warning: ignoring the cache file" in ln]
    assert len(warnings) == 1 and r1["cache_path"] in warnings[0] and re.search(why, warnings[0]), lines
    assert (b2, r2["cache_hit"]) == (4, False) and r2["probes"]
    assert json.load(open(r1["cache_path"]))["device_batch_size"] == 4


@pytest.mark.unit
@pytest.mark.parametrize("claimed", [8, 64])
def test_fake_path_cache_entry_claiming_a_larger_candidate_is_ignored(claimed, monkeypatch, tmp_path):
    """A cache entry whose device_batch_size was edited to a larger candidate (8: measured over budget; 64: never
    probed) is ignored with a warning naming the file, and discovery measures 4 again. Catches the old fake path,
    which trusted any candidate in a file with the right key ("verified by the code fingerprint") without a probe, so
    training's first step ran at the claimed size until the out-of-memory step-down caught it."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    r1, b2, r2, lines = rerun_after_edit(tmp_path, claim(claimed))
    assert_ignored_and_replaced(r1, b2, r2, lines, rf"device_batch_size={claimed} has no search probe that fits")


@pytest.mark.unit
def test_fake_path_cache_entry_whose_probe_peak_exceeds_the_limit_is_ignored(monkeypatch, tmp_path):
    """An entry claiming 8 whose probe at 8 was edited to say "fits" while its peak_bytes stays above this run's
    margin * budget is ignored. The budget and the margin are in the key, so a stale entry of another budget cannot
    reach this check; an edited probe record can. Catches a check that trusts a probe's result without comparing its
    peak with the limit (and the old code, which checked no probe at all)."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    r1, b2, r2, lines = rerun_after_edit(tmp_path, claim(8, fits=True))
    assert_ignored_and_replaced(r1, b2, r2, lines, r"search probe at device_batch_size=8 peaks at \d+ bytes, over "
                                                   rf"this run's limit of {r1['limit_bytes']} bytes")


def set_result(batch_size, result):
    def edit(entry):
        for p in entry["probes"]:
            if p["batch_size"] == batch_size:
                p["result"] = result
    return edit


@pytest.mark.unit
@pytest.mark.parametrize("edit,why", [
    (set_result(2, "over budget"), r"not the answer of its search probes \(fits: \[4\]; does not fit: \[2, 8\]\)"),
    (lambda e: e.update(probes=[]), r"device_batch_size=4 has no search probe that fits"),
    (lambda e: e.pop("probes"), r"KeyError: 'probes'"),
])
def test_fake_path_cache_entry_whose_probes_contradict_its_size_is_ignored(edit, why, monkeypatch, tmp_path):
    """An entry whose probes do not give its size (a smaller size that does not fit, no probes, no probe list) is
    ignored although its size is the true answer. Catches a check of the size alone (the old code's candidate check),
    which cannot tell a record the search wrote from one edited by hand."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    r1, b2, r2, lines = rerun_after_edit(tmp_path, edit)
    assert_ignored_and_replaced(r1, b2, r2, lines, why)


@pytest.mark.unit
def test_check_probes_judges_by_the_deciding_phase():
    """With compiled probes the compiled phase decides (the eager search's size may differ either way, and a failed
    cache check precedes a new search): an entry is its deciding phase's answer. Catches a check over all phases,
    which would reject every genuine compiled CUDA entry whose compiled size differs from the eager one."""
    def probe(b, result, phase, peak=100):
        return {"batch_size": b, "peak_bytes": peak, "result": result, "seconds": 0.1, "phase": phase}
    compiled_up = [probe(8, "OOM", "cache check"), probe(8, "fits", "search"), probe(16, "over budget", "search"),
                   probe(16, "fits", "compiled"), probe(32, "over budget", "compiled")]
    compiled_down = [probe(8, "fits", "search"), probe(16, "over budget", "search"), probe(8, "OOM", "compiled"),
                     probe(4, "fits", "compiled")]
    ab_cache.check_probes(16, compiled_up, limit_bytes=100)
    ab_cache.check_probes(4, compiled_down, limit_bytes=100)
    for batch_size, probes, limit, why in [
        (8, compiled_up, 100, "device_batch_size=8 has no compiled probe that fits"),
        (8, compiled_down, 100, "device_batch_size=8 has no compiled probe that fits"),
        (16, compiled_up, 99, "compiled probe at device_batch_size=16 peaks at 100 bytes, over this run's limit"),
        (4, [probe(4, "fits", "search"), probe(8, "fits", "search")], 100, r"not the answer of its search probes"),
        (8, [probe(4, "fits", "search"), probe(8, "fits", "cache check")], 100, "8 has no search probe that fits"),
    ]:
        with pytest.raises(ValueError, match=why):
            ab_cache.check_probes(batch_size, probes, limit_bytes=limit)


@pytest.mark.unit
def test_stale_real_cache_entry_is_verified_dropped_and_searched_again(monkeypatch, tmp_path):
    """On real probes a hit is verified by one probe at the cached size; a size that no longer fits is dropped and a
    search runs (catches reusing a cached size that now OOMs, e.g. after another process took memory)."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    model, optimizers = passed_tiny()
    b1, r1 = discover_device_batch_size(lambda device: (model, optimizers), **REAL_TINY_ARGS)
    b2, r2 = discover_device_batch_size(lambda device: (model, optimizers), **REAL_TINY_ARGS)
    assert (b1, b2, r2["cache_hit"], [p["phase"] for p in r2["probes"]]) == (4, 4, True, ["cache check"])
    model.capacity_rows = 2  # the device got smaller
    b3, r3 = discover_device_batch_size(lambda device: (model, optimizers), **REAL_TINY_ARGS)
    assert (b3, r3["cache_hit"], r3["probes"][0]["phase"], r3["probes"][0]["result"]) == (2, False, "cache check", "OOM")
    assert json.load(open(r3["cache_path"]))["device_batch_size"] == 2


@pytest.mark.unit
def test_stale_real_entry_is_dropped_even_when_nothing_fits_any_more(monkeypatch, tmp_path):
    """A cached size whose check probe now runs out of memory is logged, its file removed, and the search that follows
    finds nothing: the stale file must be gone (no later run may trust it) and the UserError raised. Eager probes
    only: with compile=False, torch.compile is never called (a compiled probe measures another step than training
    runs). Catches: the entry dropped on the wrong rank or by the wrong key, the warning logged as None, search
    probes compiled by default."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))

    def no_compile(*args, **kwargs):
        raise AssertionError("torch.compile called during an eager discovery")

    monkeypatch.setattr(torch, "compile", no_compile)
    model, optimizers = passed_tiny()
    b1, r1 = discover_device_batch_size(lambda device: (model, optimizers), **REAL_TINY_ARGS)
    assert b1 == 4 and os.path.exists(r1["cache_path"])
    model.capacity_rows = 0  # now not even one row fits
    lines = []
    with pytest.raises(UserError, match=r"^no device_batch_size fits in memory: the smallest candidate, 1, "):
        discover_device_batch_size(lambda device: (model, optimizers), **{**REAL_TINY_ARGS, "log": lines.append})
    assert "auto_batch_size: the cached device_batch_size=4 no longer fits; dropping the entry" in lines
    assert not os.path.exists(r1["cache_path"])


@pytest.mark.unit
def test_interrupted_cache_write_keeps_the_old_entry(monkeypatch, tmp_path):
    """Atomic write: if the process dies between writing the temp file and os.replace, the old entry is intact."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    key = cache_key(**KEY_ARGS)
    probes = [{"batch_size": 4, "peak_bytes": GiB, "result": "fits", "seconds": 1.0, "phase": "search"}]
    path = ab_cache.write_cached(key, 4, probes)

    def crash(src, dst):
        raise OSError("simulated crash before the rename")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        ab_cache.write_cached(key, 8, [])
    monkeypatch.undo()
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    assert ab_cache.read_cached(key, limit_bytes=2 * GiB) == 4 and json.load(open(path))["device_batch_size"] == 4


# ----------------------------------------------------------------------------- compiled verification (pure logic)

@pytest.mark.unit
@pytest.mark.parametrize("limit,expected,calls", [
    (16, 16, [8, 16, 32]),  # compiled needs less memory: verified, then raised twice (3 probes max)
    (8, 8, [8, 16]),  # verified, next one fails
    (4, 4, [8, 4]),  # compiled needs more: step down
    (1, None, [8, 4, 2]),  # nothing fits within 3 compiled probes
])
def test_compiled_verification_steps_down_or_up_within_three_probes(limit, expected, calls):
    """Catches: trusting the eager size for the compiled model (which can need more memory), re-probing a size that failed, or
    more compiled probes (recompiles) than MAX_COMPILED_PROBES."""
    seen = []

    def fits_compiled(b):
        seen.append(b)
        return b <= limit
    cands = divisors(64)
    if expected is None:
        with pytest.raises(UserError, match="--compile=False"):
            ab_search._refine_compiled(fits_compiled, cands, 8)
    else:
        assert ab_search._refine_compiled(fits_compiled, cands, 8) == expected
    assert seen == calls and len(set(seen)) == len(seen)


# ----------------------------------------------------------------------------- out of memory after discovery

class OOMAbove(torch.nn.Module):
    """A simulated device: the wrapped model raises a real torch.OutOfMemoryError for micro-batches above `limit`."""

    def __init__(self, model, limit):
        super().__init__()
        self.model, self.limit, self.calls = model, limit, []

    def forward(self, x, y):
        self.calls.append(x.size(0))
        if x.size(0) > self.limit:
            raise torch.OutOfMemoryError(f"simulated: micro-batch {x.size(0)} > {self.limit}")
        return self.model(x, y)


@pytest.mark.unit
def test_oom_step_down_keeps_tokens_and_loss(monkeypatch, tmp_path):
    """
    An OOM at the discovered size steps down to the next candidate and redoes the step on the same rows: loss and
    gradient equal a run that used the smaller size from the start (1e-6, fp32). Catches a step-down that skips the
    step (other rows), applies a partial gradient twice (grads not zeroed), or keeps grad_accum_steps (fewer tokens).
    """
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    torch.manual_seed(2)
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    ref_model = tiny_model()
    ref_loss = forward_backward(ref_model, micro_batches(x, y, 2), nullcontext())
    model = OOMAbove(tiny_model(), limit=2)
    logs = []
    step_down = OOMStepDown({"candidates": [1, 2, 4, 8], "cache_key": {}}, None, 8, log=logs.append)
    loss = step_down.forward_backward(model, x, y, nullcontext(), step=0)
    assert step_down.device_batch_size == 2 and model.calls == [8, 4, 2, 2, 2, 2]
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    assert rel(grads(model.model), grads(ref_model)) < 1e-6
    assert "stepping down to 4" in logs[0] and "stepping down to 2" in logs[1]
    # counter-example: without zeroing the gradients of the failed attempt the result differs
    bad = OOMAbove(tiny_model(), limit=4)
    bad.model(x[:4], y[:4]).backward()  # a partial micro-step's gradient left behind
    forward_backward(bad.model, micro_batches(x, y, 4), nullcontext())
    assert rel(grads(bad.model), grads(ref_model)) > 1e-3


@pytest.mark.unit
def test_oom_at_smallest_candidate_is_a_clear_error():
    """Catches: a step-down past the smallest candidate (an IndexError, or a size of 0 and a ZeroDivisionError)
    instead of a one-line UserError."""
    model = OOMAbove(tiny_model(), limit=0)
    x = torch.zeros(4, 16, dtype=torch.long)
    step_down = OOMStepDown({"candidates": [1, 2, 4], "cache_key": {}}, None, 2, log=lambda *a: None)
    with pytest.raises(UserError, match="smallest candidate"):
        step_down.forward_backward(model, x, x, nullcontext(), step=0)


@pytest.mark.unit
def test_step_down_propagates_other_errors():
    """Catches: an except clause that treats every error as out of memory (a real bug hidden behind step-downs)."""
    class Broken(torch.nn.Module):
        def forward(self, x, y):
            raise RuntimeError("shape mismatch, not an OOM")
    x = torch.zeros(4, 16, dtype=torch.long)
    step_down = OOMStepDown({"candidates": [1, 2, 4], "cache_key": {}}, None, 2, log=lambda *a: None)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        step_down.forward_backward(Broken(), x, x, nullcontext(), step=0)


@pytest.mark.unit
def test_step_down_is_recorded_rewritten_and_drops_the_cache_entry(monkeypatch, tmp_path):
    """
    A discovery with record_path writes its record there; a training step that then runs out of memory steps down,
    appends [step, old, new] to record["step_downs"] (a second step-down appends another), rewrites record_path and
    drops the cache entry, and device_batch_size is the new size; a step without OOM changes nothing. Catches: a
    step-down whose cache entry survives (the next run reuses a size that ran out of memory), a record file that does
    not show it, a list that is replaced instead of extended, or a size left at the old value (every later step would
    run out of memory again).
    """
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    path = str(tmp_path / "auto_batch_size.json")
    build = gpt_builder(TINY_GPT)
    batch_size, record = discover_device_batch_size(build, max_seq_len=32, vocab_size=256, total_batch_size=32 * 8,
                                                    world_size=1, device="cpu", device_memory_gb=1, key_fields={},
                                                    log=lambda *a: None, record_path=path)
    assert batch_size == 8 and record["candidates"] == [1, 2, 4, 8] and os.path.exists(record["cache_path"])
    assert json.load(open(path)) == json.loads(json.dumps(record))
    model, _ = build("cpu")
    sim = OOMAbove(model, limit=4)
    step_down = OOMStepDown(record, path, batch_size, log=lambda *a: None)
    x, y = torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))
    step_down.forward_backward(sim, x, y, nullcontext(), step=3)
    assert step_down.device_batch_size == 4 and record["step_downs"] == [[3, 8, 4]]
    assert json.load(open(path))["step_downs"] == [[3, 8, 4]]
    assert not os.path.exists(record["cache_path"])
    model.zero_grad(set_to_none=True)
    step_down.forward_backward(sim, x, y, nullcontext(), step=4)  # fits at 4: nothing recorded
    assert step_down.device_batch_size == 4 and json.load(open(path))["step_downs"] == [[3, 8, 4]]
    sim.limit = 1
    model.zero_grad(set_to_none=True)
    step_down.forward_backward(sim, x, y, nullcontext(), step=5)
    assert step_down.device_batch_size == 1 and record["step_downs"] == [[3, 8, 4], [5, 4, 1]]
    assert json.load(open(path)) == json.loads(json.dumps(record))


# ----------------------------------------------------------------------------- budget and plan mode

MEMINFO = "MemTotal:       16384000 kB\nMemFree:          524288 kB\nMemAvailable:    {} kB\nBuffers:   1 kB\n"


@pytest.mark.unit
@pytest.mark.parametrize("avail_kb, ranks, want", [
    (8_388_608, 1, 4 * GiB),  # MemAvailable 8,388,608 kB = 8 GiB; half of it on one rank: 4 GiB = 4,294,967,296
    (8_388_608, 2, 2 * GiB),  # 8 GiB / 2 / 2 = 2 GiB = 2,147,483,648
    (8_388_608, 3, 1 * GiB),  # 8 GiB / 2 / 3 = 1.33 GiB, down to whole GiB: 1,073,741,824
    (3_000_000, 2, 536_870_912),  # 3,072,000,000 B / 2 / 2 = 768,000,000 B < 1 GiB: 2 x 256 MiB = 536,870,912
    (1_000_000, 4, 268_435_456),  # 1,024,000,000 B / 2 / 4 = 128,000,000 B: below 256 MiB, raised to 268,435,456
])
def test_default_cpu_budget_is_half_of_memavailable_per_local_rank(monkeypatch, avail_kb, ranks, want):
    """
    The default CPU budget read from a literal /proc/meminfo (the expected bytes worked out by hand in the table, not
    from nanotrain.auto_batch_size.probe's own MemAvailable reader): half of MemAvailable per local rank, rounded down to whole GiB
    (256 MiB steps below 1 GiB, at least 256 MiB). Fails on a reader that takes MemFree (512 MiB here: every budget
    becomes 256 MiB) or forgets that /proc/meminfo counts kB, a fraction other than 1/2, a share not divided by the
    local ranks, and rounding up. On the real machine: a positive multiple of 256 MiB and at most a quarter of the
    physical memory (sysconf, not MemAvailable) with 2 local ranks.
    """
    import io
    monkeypatch.setattr(ab_probe, "open", lambda path, *a, **k: io.StringIO(MEMINFO.format(avail_kb))
                        if path == "/proc/meminfo" else open(path, *a, **k), raising=False)
    budget, desc = ab_probe.device_memory_budget("cpu", None, local_world_size=ranks)
    assert budget == want
    assert desc["type"] == "cpu" and "MemAvailable" in desc["source"]
    monkeypatch.undo()
    budget, _ = ab_probe.device_memory_budget("cpu", None, local_world_size=2)
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert 0 < budget <= 0.25 * physical and budget % (256 * 2**20) == 0
    assert ab_probe.device_memory_budget("cpu", 1.5)[0] == 1_610_612_736  # 1.5 x 1,073,741,824
    with pytest.raises(UserError, match="--device_memory_gb=0"):
        ab_probe.device_memory_budget("cpu", 0)


@pytest.mark.smoke
@pytest.mark.slow  # plan mode's flags are checked in the default run (test_plan_mode_flags_are_checked)
def test_plan_mode_prints_an_estimate_table():
    """Plan mode's table: a row per probe and the size found per depth and policy with its counted recompute share
    (none: 0.0%); with --activation_checkpointing=auto every policy's rows and the choice per depth."""
    out = subprocess.run([sys.executable, PLAN, "--depths=1,2", "--max_seq_len=32", "--vocab_size=256",
                          "--total_batch_size=1024", "--device_memory_gb=0.02"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "ESTIMATE" in text and "fake CPU tensors" in text
    assert re.search(r"^\s+1 \|\s+none \|\s+[\d,]+ \|\s+\d+ \|\s+[\d.]+ \| (yes|no)$", text, re.M)
    found = re.findall(r"^\s+(\d) \|\s+none \| => device_batch_size=(\d+) \(grad_accum_steps=(\d+)\) \| "
                       r"recompute 0\.0%$", text, re.M)
    assert [d for d, _, _ in found] == ["1", "2"]
    assert all(int(b) * int(g) * 32 == 1024 for _, b, g in found)
    out = subprocess.run([sys.executable, PLAN, "--depths=2", "--max_seq_len=32", "--vocab_size=256",
                          "--total_batch_size=1024", "--device_memory_gb=0.02", "--activation_checkpointing=auto"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    policies = re.findall(r"^\s+2 \|\s+(\w+) \| => device_batch_size=\d+ \(grad_accum_steps=\d+\) \| recompute "
                          r"([\d.]+)%$", out.stdout, re.M)
    assert [p for p, _ in policies] == ["none", "selective", "full"]
    assert float(policies[1][1]) == 0.0 and float(policies[2][1]) > 15
    assert re.search(r"^\s+2 \| auto: (none|selective), device_batch_size=\d+, recompute 0\.0%", out.stdout, re.M)


@pytest.mark.slow
def test_plan_mode_plans_the_compiled_step():
    """
    Plan mode at depth 2 (T = 32, 1,024 tokens per step) on a 0.02 GiB budget: --compile=False (the eager step) finds
    32 rows; the default --compile=True plans the compiled step, whose peak is larger (nanotrain.auto_batch_size.probe.
    COMPILED_OVER_EAGER, measured on an H200), and finds 16 there, reporting the larger peak at 32 rows as not
    fitting. Catches plan mode reporting the eager step's size for base_train's compiled CUDA step (a size the
    compiled step cannot run: the 80 GB case at depth 20, 32 rows without checkpointing) and a --compile flag that
    changes nothing. ~1 min on a loaded 2-core CPU (two plan runs).
    """
    args = [sys.executable, PLAN, "--depths=2", "--max_seq_len=32", "--vocab_size=256", "--total_batch_size=1024",
            "--device_memory_gb=0.02"]
    found, peak32 = {}, {}
    for flag in ("--compile=False", "--compile=True"):
        out = subprocess.run(args + [flag], capture_output=True, text=True, timeout=600, cwd=REPO)
        assert out.returncode == 0, out.stderr
        found[flag] = int(re.search(r"=> device_batch_size=(\d+)", out.stdout).group(1))
        peak32[flag] = re.search(r"^\s+2 \|\s+none \|\s+[\d,]+ \|\s+32 \|\s+([\d.]+) \| (yes|no)$", out.stdout,
                                 re.M).groups()
    assert found == {"--compile=False": 32, "--compile=True": 16}
    assert peak32["--compile=False"][1] == "yes" and peak32["--compile=True"][1] == "no"
    assert "compiled step" in out.stdout and "x 1.124" in out.stdout


@pytest.mark.smoke
def test_plan_mode_flags_are_checked():
    """Catches: bad --depths or --margin reaching the measurement (a traceback, or a plan for a margin above 1)
    instead of one `error:` line naming the flag and exit code 2."""
    for arg, message in (("--depths=a,b", "--depths='a,b'"), ("--margin=1.5", "--margin=1.5")):
        out = subprocess.run([sys.executable, PLAN, arg], capture_output=True, text=True, timeout=300, cwd=REPO)
        assert out.returncode == 2, out.stderr
        assert re.search(f"^error: {re.escape(message)}", out.stderr, re.M), out.stderr


# ----------------------------------------------------------------------------- GPU (skipped without CUDA)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
def test_real_cuda_oom_under_the_memory_fraction_is_caught_and_cleaned_up():
    """A real allocator OOM: under set_per_process_memory_fraction(0.25) an allocation of half the device raises
    torch.OutOfMemoryError, is_oom_error says so, and memory is back to its baseline after clean-up."""
    dev = compute_init("cuda")[4]  # cuda:<index>, as a script gets it (the memory-fraction API needs the index)
    total = torch.cuda.get_device_properties(dev).total_memory
    prev = torch.cuda.get_per_process_memory_fraction(dev)
    baseline = torch.cuda.memory_allocated(dev)
    torch.cuda.set_per_process_memory_fraction(0.25, dev)
    try:
        caught = False
        try:
            x = torch.empty(total // 2, dtype=torch.uint8, device=dev)
            del x
        except Exception as exc:
            caught = is_oom_error(exc) and isinstance(exc, torch.OutOfMemoryError)
        assert caught
        torch.cuda.empty_cache()
        assert torch.cuda.memory_allocated(dev) == baseline
    finally:
        torch.cuda.set_per_process_memory_fraction(prev, dev)


@pytest.mark.gpu
@needs_cuda
def test_found_size_runs_20_steps_under_the_margin(monkeypatch, tmp_path):
    """Discovery on an emulated small device (device_memory_gb), then 20 real training steps at the found size with
    the allocator capped at margin * budget: no OOM and the reserved peak stays under the margin."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    dev = compute_init("cuda")[4]  # cuda:<index>, as a script gets it (the memory-fraction API needs the index)
    config = GPTConfig(max_seq_len=512, vocab_size=8192, n_layer=4, n_head=2, n_kv_head=2, model_dim=256)
    build = gpt_builder(config)
    gb, margin = 2.0, 0.85
    batch_size, record = discover_device_batch_size(build, max_seq_len=512, vocab_size=8192,
                                                    total_batch_size=512 * 256, world_size=1, device=dev,
                                                    amp_dtype=torch.bfloat16, compile=False, margin=margin,
                                                    device_memory_gb=gb, use_cache=False, key_fields={})
    assert batch_size >= 1 and record["measurement"].startswith("real step on CUDA")
    total = torch.cuda.get_device_properties(dev).total_memory
    prev = torch.cuda.get_per_process_memory_fraction(dev)
    torch.cuda.set_per_process_memory_fraction(margin * gb * GiB / total, dev)
    try:
        model, optimizers = build(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        g = torch.Generator(device=dev).manual_seed(0)
        for _ in range(20):
            ab_probe.probe_step(model, optimizers, batch_size, 512, 8192, device=dev, amp_dtype=torch.bfloat16, generator=g)
        torch.cuda.synchronize(dev)
        assert torch.cuda.max_memory_reserved(dev) <= margin * gb * GiB
    finally:
        torch.cuda.set_per_process_memory_fraction(prev, dev)


@pytest.mark.unit
def test_discovery_checks_its_arguments_and_keys_the_cache_on_every_setting(monkeypatch):
    """
    discover_device_batch_size refuses a margin outside (0, 1] (1 itself is allowed) and an unknown probe kind, each with
    its own message; its cache key is the same for the same call and for fp32 given as None, and changes with each
    setting that changes memory: max_seq_len, vocab_size, bf16, compile, world size (plan mode: no process group),
    margin, the caller's key_fields and the builder's own key_fields. The CPU budget is half of MemAvailable per local
    rank (LOCAL_WORLD_SIZE): 8 GiB available over 2 local ranks is 2 GiB. The record has exactly its documented
    fields, the candidates respect max_batch_size and the key carries the code's fingerprint. Catches a field left out
    of the key (a
    stale size reused for another config), key_fields read from the wrong attribute, fp32 keyed apart from None,
    the local ranks ignored, and bounds or messages mixed up.
    """
    def build(device):  # one function whose key_fields the test changes: the code fingerprint stays the same
        return build_tiny(device)
    build.key_fields = {"width": 1}
    base = dict(TINY_ARGS, device_memory_gb=1.0, use_cache=False, log=lambda *a: None, max_batch_size=2)

    def key(**changes):
        return json.dumps(discover_device_batch_size(build, **{**base, **changes})[1]["cache_key"], sort_keys=True)

    for bad in (0.0, 1.5):
        with pytest.raises(UserError, match=rf"--batch_size_margin={bad}: expected a fraction in \(0, 1\]"):
            key(margin=bad)
    with pytest.raises(ValueError, match="probe='gpu': expected 'fake', 'real' or None"):
        key(probe="gpu")
    k0 = key()
    assert key() == k0 and key(amp_dtype=torch.float32) == k0
    record = discover_device_batch_size(build, **base)[1]
    assert record["candidates"] == [1, 2]  # max_batch_size=2 caps the divisors of 64 rows
    assert set(record) == {"device_batch_size", "grad_accum_steps", "candidates", "budget_bytes", "limit_bytes",
                           "margin", "device", "measurement", "probes", "cache_hit", "cache_key", "cache_path",
                           "seconds", "algorithm_version"}  # the documented record, nothing else
    assert record["cache_key"]["code"] == ab_cache.code_fingerprint(build) and record["cache_key"]["code"]
    others = [key(max_seq_len=32), key(vocab_size=128), key(amp_dtype=torch.bfloat16), key(compile=True),
              key(world_size=2), key(margin=1.0), key(key_fields={"model": "other"})]
    build.key_fields = {"width": 2}
    others.append(key())
    assert len({k0, *others}) == len(others) + 1, others
    monkeypatch.setattr(ab_probe, "_mem_available_bytes", lambda: 8 * GiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    record = discover_device_batch_size(build, **{**base, "device_memory_gb": None})[1]
    assert record["budget_bytes"] == 2 * GiB


@pytest.mark.unit
def test_step_down_under_a_process_group(one_rank_mesh, monkeypatch, tmp_path):
    """
    Under torch.distributed (one gloo rank, in-process): an FSDP2-sharded model is refused with one UserError naming
    --fsdp; a DDP model's micro-steps all skip DDP's own sync (require_backward_grad_sync is False at every forward,
    seen by a hook) and the gradients are all-reduced and averaged at the end, equal to the plain model's stepped-down
    step (1e-6); rank 0 rewrites the record and drops the cache entry. Catches the FSDP check skipped, DDP's sync left
    on (a second all-reduce of every gradient), a final average divided by anything but the world size (with one rank a
    missing average is not visible: the two-process test covers it), and the rank-0 writes skipped under a process
    group.
    """
    import copy

    from nanotrain.fsdp import shard_model

    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    path = str(tmp_path / "auto_batch_size.json")
    build = gpt_builder(TINY_GPT)
    batch_size, record = discover_device_batch_size(build, max_seq_len=32, vocab_size=256, total_batch_size=32 * 8,
                                                    world_size=1, device="cpu", device_memory_gb=1, key_fields={},
                                                    log=lambda *a: None, record_path=path)
    assert batch_size == 8 and os.path.exists(record["cache_path"])
    x, y = torch.randint(0, 256, (8, 32)), torch.randint(0, 256, (8, 32))
    with pytest.raises(UserError, match=r"^--fsdp=True: the out-of-memory step-down of --auto_batch_size is not "
                                         r"available under FSDP \(collectives inside forward/backward\); use "
                                         r"forward_backward$"):  # the whole line a user reads
        OOMStepDown(record, path, 8, log=lambda *a: None).forward_backward(
            shard_model(build("cpu")[0], torch.device("cpu"), torch.float32), x, y, nullcontext(), step=0)
    model, _ = build("cpu")
    plain = copy.deepcopy(model)
    ddp = torch.nn.parallel.DistributedDataParallel(OOMAbove(model, limit=4))
    syncs = []
    ddp.module.register_forward_pre_hook(lambda m, a: syncs.append(ddp.require_backward_grad_sync))
    step_down = OOMStepDown(record, path, 8, log=lambda *a: None)
    loss = step_down.forward_backward(ddp, x, y, nullcontext(), step=2)
    assert ddp.module.calls == [8, 4, 4] and syncs == [False, False, False]
    ref = forward_backward(plain, micro_batches(x, y, 4), nullcontext())
    assert abs(loss.item() - ref.item()) < 1e-6 and rel(grads(model), grads(plain)) < 1e-6
    assert step_down.device_batch_size == 4 and json.load(open(path))["step_downs"] == [[2, 8, 4]]
    assert not os.path.exists(record["cache_path"])


@pytest.mark.unit
def test_sft_probe_model_trains_the_packed_or_the_padded_layout():
    """sft_builder's probe model runs what chat_sft trains. With packing, the B rows go in as one row of B*T tokens
    in B segments that do not see each other, so its loss equals the mean of each row's loss on its own, and the GPT
    receives a (1, B*T) row with doc_ids; without packing, the (B, T) rows as they are, without doc_ids. Catches: the
    packing flag inverted or not passed on, segments of another length than T (attention would cross rows and the loss
    would change), the rows or targets reshaped to another shape, packing missing from the cache key."""
    for packing in (True, False):
        torch.manual_seed(0)
        build = ab_builders.sft_builder(TINY_GPT, packing)
        assert build.key_fields["packing"] is packing
        model, optimizers = build("cpu")
        assert isinstance(model, ab_builders.PackedRows) and len(optimizers) == 2
        with torch.no_grad():  # the head starts at zero (every row's loss would be log V): give the weights values
            for p in model.parameters():
                p.normal_(0, 0.3)
        seen = []
        hook = model.model.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((tuple(args[0].shape), tuple(args[1].shape), kwargs.get("doc_ids"))),
            with_kwargs=True)
        x, y = torch.randint(0, 256, (3, 8)), torch.randint(0, 256, (3, 8))
        with torch.no_grad():
            loss = model(x, y)
            hook.remove()
            rows = torch.stack([model.model(x[i:i + 1], y[i:i + 1]) for i in range(3)])
        assert torch.allclose(loss, rows.mean(), rtol=1e-5), (packing, loss, rows)
        assert rows.std() > 0.05  # the rows differ, so a loss mixing them would be seen
        shapes, doc_ids = seen[0][:2], seen[0][2]
        if packing:
            assert shapes == ((1, 24), (1, 24))
            assert doc_ids.tolist() == [[0] * 8 + [1] * 8 + [2] * 8]
        else:
            assert shapes == ((3, 8), (3, 8)) and doc_ids is None


@pytest.mark.unit
def test_cache_key_has_its_documented_fields_and_names_one_file_in_any_order(monkeypatch, tmp_path):
    """The key stored in every cache entry has exactly these fields (a user reads them to see why a run missed the
    cache); a key field that JSON cannot hold (a path, a dtype) is stored as its str instead of crashing; the file name
    is the hash of the canonical (sorted) JSON, so the same key built in another order names the same file; an unset
    allocator variable is the same key as an empty one, and each of the two variables changes the key. Catches: a
    field dropped or renamed, json.dumps without default=str, the digest over unsorted JSON, None for an unset
    variable, PYTORCH_ALLOC_CONF left out."""
    import pathlib
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    key = cache_key(**KEY_ARGS)
    assert sorted(key) == ["algorithm_version", "alloc_conf", "amp_dtype", "candidates", "code", "compile", "devices",
                           "key_fields", "margin", "max_seq_len", "torch", "vocab_size", "world_size"]
    assert key["alloc_conf"] == ["", ""] and key["amp_dtype"] == "torch.bfloat16"
    assert key["max_seq_len"] == 256 and key["vocab_size"] == 32768 and key["world_size"] == 8
    odd = cache_key(**{**KEY_ARGS, "key_fields": {"data": pathlib.Path("/data/x"), "dtype": torch.float16}})
    assert odd["key_fields"] == {"data": "/data/x", "dtype": "torch.float16"}
    path = cache_path(key)
    assert cache_path(dict(reversed(list(key.items())))) == path
    reordered = {**KEY_ARGS, "key_fields": dict(reversed(list(KEY_ARGS["key_fields"].items())))}
    assert cache_path(cache_key(**reordered)) == path
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(var, "")
        assert cache_path(cache_key(**KEY_ARGS)) == path
        monkeypatch.setenv(var, "expandable_segments:True")
        assert cache_path(cache_key(**KEY_ARGS)) != path
        monkeypatch.delenv(var)


@pytest.mark.unit
def test_code_fingerprint_covers_the_builders_package_and_not_where_it_runs(tmp_path, monkeypatch):
    """A build_probe from another package is fingerprinted with that whole package: editing a sibling module it
    imports (the model file) changes the fingerprint. The fingerprint does not depend on the working directory (it
    hashes paths relative to the package's parent). A callable without source (a functools.partial) still gets one.
    Catches: only build_probe's own file hashed (a model edit would hit a stale entry), the package looked up
    wrongly, absolute or cwd-relative paths in the hash (every directory a different key), a crash without source."""
    import functools
    import importlib
    pkg = tmp_path / "ab_fp_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text("WIDTH = 4\n")
    (pkg / "builders.py").write_text("from .model import WIDTH\n\ndef build(device):\n    return WIDTH\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    build = importlib.import_module("ab_fp_pkg.builders").build
    before = ab_cache.code_fingerprint(build)
    monkeypatch.chdir(pkg)
    assert ab_cache.code_fingerprint(build) == before
    monkeypatch.chdir(REPO)
    assert ab_cache.code_fingerprint(functools.partial(build)) == ab_cache.code_fingerprint(functools.partial(len))
    (pkg / "model.py").write_text("WIDTH = 8\n")
    assert ab_cache.code_fingerprint(build) != before


@pytest.mark.unit
def test_discovery_measures_in_the_training_dtype_and_defaults_to_eager(monkeypatch, tmp_path):
    """
    The fake probes of a discovery measure the step in the training dtype: with amp_dtype=torch.bfloat16 each probe's
    recorded peak equals measure_fake_peak of the same step under bf16 autocast, and differs from the fp32 step's
    (the activations are half as large). Without a compile argument the key records an eager step (compile False).
    Catches the probe built without the dtype (it would measure fp32 and over-estimate a bf16 run's memory, choosing
    too small a batch) and a compiled default.
    """
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    build = gpt_builder(TINY_GPT)
    records = {}
    for amp in (torch.bfloat16, None):
        _, records[amp] = discover_device_batch_size(build, max_seq_len=32, vocab_size=256,
                                                     total_batch_size=32 * 8, world_size=1, device="cpu",
                                                     amp_dtype=amp, device_memory_gb=1, key_fields={},
                                                     log=lambda *a: None)
    assert records[torch.bfloat16]["cache_key"]["compile"] is False
    probe = records[torch.bfloat16]["probes"][0]
    direct = {amp: measure_fake_peak(build, probe["batch_size"], max_seq_len=32, vocab_size=256, amp_dtype=amp)
              for amp in (torch.bfloat16, None)}
    assert probe["peak_bytes"] == direct[torch.bfloat16] != direct[None]
    fp32_probe = next(p for p in records[None]["probes"] if p["batch_size"] == probe["batch_size"])
    assert fp32_probe["peak_bytes"] == direct[None]
