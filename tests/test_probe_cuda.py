"""
The CUDA-only branches that run without a card, against tests/cuda_standin.py (torch.cuda stood in for, with torch's
contracts: the memory-fraction API refuses a CUDA device without an index): the real probe's entry, measurement,
clean-up and exit (nanotrain/auto_batch_size/probe.py), the discovery on CUDA, the memory budget, the out-of-memory
step-down on the allocator's OOM, compute_init's device; and the budget's CPU fallbacks and MPS cap. The environment
report's CUDA branch is in tests/test_gpu_check_inprocess.py (this file runs under the mutation tool, whose copy has
no scripts/).
"""

import os
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cuda_standin import GiB, MiB, cuda_standin_fixture, device_of, install  # noqa: F401 - the fixture

import nanotrain.auto_batch_size.probe as ab_probe
from nanotrain.auto_batch_size.search import discover_device_batch_size
from nanotrain.auto_batch_size.stepdown import OOMStepDown
from nanotrain.common import compute_init
from nanotrain.errors import UserError
from nanotrain.training import forward_backward, micro_batches

pytestmark = pytest.mark.unit

PARAM_BYTES, STATE_BYTES, ROW_BYTES = 1 * GiB, 2 * GiB, 256 * MiB  # the stand-in device's bytes of the tiny model


class BlockLM(nn.Module):
    """A tiny language model whose device memory lives in the stand-in's allocator: its parameters hold a block of
    PARAM_BYTES, each forward allocates ROW_BYTES per row of activations (alive until the graph goes, after backward)
    or the next size of `sizes` when given; `leak` (a list) keeps the activations of the first forward; `error` raises a non-OOM
    error in forward."""

    def __init__(self, standin, sizes=None):
        super().__init__()
        self.standin, self.sizes, self.leak, self.error, self.calls = standin, sizes, None, None, []
        self.wte = nn.Embedding(64, 8)
        self.head = nn.Linear(8, 64, bias=False)
        self.param_block = standin.alloc(PARAM_BYTES)

    def forward(self, idx, targets):
        self.calls.append(idx.size(0))
        if self.error:
            raise RuntimeError(self.error)
        nbytes = self.sizes[(len(self.calls) - 1) % len(self.sizes)] if self.sizes else ROW_BYTES * idx.size(0)
        act = self.standin.alloc(nbytes)
        if self.leak == []:
            self.leak.append(act)
        loss = F.cross_entropy(self.head(self.wte(idx)).view(-1, 64), targets.view(-1))
        loss.grad_fn.register_prehook(lambda grad, act=act: None)  # the activations live as long as the graph
        return loss


class BlockAdamW(torch.optim.AdamW):
    """AdamW whose lazy state holds STATE_BYTES of the stand-in's memory from its first step until state.clear()."""

    def __init__(self, params, standin):
        super().__init__(params, lr=1e-2)
        self.standin = standin

    def step(self, closure=None):
        super().step(closure)
        if "device_block" not in self.state:
            self.state["device_block"] = self.standin.alloc(STATE_BYTES)


def block_builder(standin, sizes=None, built=None):
    """build_probe for the stand-in: the model's tensors on the CPU under a CUDA device."""
    def build(device):
        assert device.type == "cuda", device
        torch.manual_seed(0)
        with torch.device(device_of(device)):
            model = BlockLM(standin, sizes)
        if built is not None:
            built.append(model)
        return model, [BlockAdamW(model.parameters(), standin)]
    return build


def probe_on(standin, device, fraction=0.5, world_size=1, sizes=None, built=None, logs=None):
    return ab_probe.RealProbe(block_builder(standin, sizes, built), device, 16, 64, None, world_size, fraction,
                              log=(logs.append if logs is not None else lambda *a: None))


def script_device():
    """The device a script gets: compute_init's, outside torchrun."""
    return compute_init("cuda")[4]


def all_indexed(standin):
    """The device arguments of every recorded torch.cuda call that takes one, and of torch.randint: each is CUDA with
    its index."""
    devices = [d for name, d in standin.calls if name != "empty_cache"]
    return bool(devices) and all(isinstance(d, int) or (d is not None and torch.device(d).type == "cuda"
                                                        and torch.device(d).index is not None) for d in devices)


# ----------------------------------------------------------------------------- the stand-in keeps torch's contracts

def test_standin_refuses_an_index_less_device_where_torch_does(cuda_standin):
    """The stand-in keeps torch's device contract (torch.cuda._utils._get_device_index): the memory-fraction API
    raises ValueError for torch.device("cuda"), the memory queries accept it. Catches a stand-in that accepts
    everything (then no test here could catch the index-less device a script used to get)."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_per_process_memory_fraction(0.5, torch.device("cuda"))
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.get_per_process_memory_fraction("cuda")
    with pytest.raises(ValueError, match="cuda device"):
        torch.cuda.memory_allocated("cpu")
    assert torch.cuda.memory_allocated(torch.device("cuda")) == 0 and torch.cuda.mem_get_info("cuda")[1] == 8 * GiB
    torch.cuda.set_per_process_memory_fraction(0.5, torch.device("cuda", 0))
    assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
    with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory"):
        cuda_standin.alloc(4 * GiB + 1)
    block = cuda_standin.alloc(GiB)
    assert torch.cuda.memory_allocated(0) == GiB
    del block
    assert torch.cuda.memory_allocated(0) == 0 and torch.cuda.memory_reserved(0) == GiB
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved(0) == 0 and torch.cuda.max_memory_reserved(0) == GiB


def test_compute_init_gives_a_script_an_indexed_cuda_device(cuda_standin):
    """Outside torchrun compute_init("cuda") returns cuda:<current device>, which the memory-fraction API accepts.
    Catches compute_init returning torch.device("cuda"): every --auto_batch_size=True run on one GPU then died in
    the probe's get_per_process_memory_fraction (ValueError)."""
    device = script_device()
    assert device == torch.device("cuda", 0)
    torch.cuda.set_per_process_memory_fraction(0.25, device)
    assert torch.cuda.get_per_process_memory_fraction(device) == 0.25


# ----------------------------------------------------------------------------- the real probe on CUDA

@pytest.mark.parametrize("given", ["script", "cuda"])
def test_real_probe_enters_measures_and_exits_on_cuda(cuda_standin, given):
    """
    A probe on the device a script gets (and on a bare "cuda", which the probe indexes itself): entry caps the
    allocator at the fraction and takes the baseline; the peak of a step is the reserved peak, parameters (1 GiB) +
    optimizer state (2 GiB) + the activations of one micro-batch (256 MiB a row), at B=1 and B=4 alike; exit restores
    the fraction, the weights bitwise and empties the cache; every torch.cuda call and the synthetic tokens got the
    indexed device; the global RNG is not drawn from.
    Catches: the entry reading the baseline before it is set (AttributeError on every CUDA probe), an index-less device
    reaching the memory-fraction API (ValueError), a peak from memory_allocated or without a reset between probes
    (B=1 would report B=4's peak), a fraction not restored, tokens made on the host or from the global RNG.
    """
    device = script_device() if given == "script" else "cuda"
    cuda_standin.fraction = 0.9
    built = []
    probe = probe_on(cuda_standin, device, fraction=0.5, built=built)
    assert probe.kind == "real step on CUDA, peak = max_memory_reserved"
    with probe:
        assert cuda_standin.fraction == 0.5 and probe.baseline == PARAM_BYTES
        weights = [p.detach().clone() for p in built[0].parameters()]
        rng = torch.get_rng_state()
        assert probe.measure(4) == (PARAM_BYTES + STATE_BYTES + 4 * ROW_BYTES, False, False)
        assert torch.equal(torch.get_rng_state(), rng)  # the probe's tokens come from its own generator
        assert probe.measure(1) == (PARAM_BYTES + STATE_BYTES + ROW_BYTES, False, False)
        assert built[0].calls == [4, 4, 4, 1, 1, 1]  # two micro-steps, the optimizer step, one more: each probe
        assert torch.cuda.memory_allocated(0) == PARAM_BYTES  # optimizer state and activations dropped
        assert all(p.grad is None for p in built[0].parameters())  # gradients freed, not zeroed
    assert cuda_standin.fraction == 0.9
    assert all(torch.equal(a, b) for a, b in zip(weights, built[0].parameters()))
    assert cuda_standin.reserved == cuda_standin.allocated == PARAM_BYTES
    assert all_indexed(cuda_standin), cuda_standin.calls
    assert sum(name == "randint" for name, _ in cuda_standin.calls) == 12  # inputs and targets, 3 micro-steps, 2 probes


def test_a_probe_that_runs_out_of_memory_is_cleaned_up_and_the_next_one_measures_alone(cuda_standin):
    """B=8 needs 1 + 2 + 2 GiB against a cap of 0.5 x 8 GiB: an OOM (caught, oom=True); memory is back at the
    baseline afterwards, and the next probe's peak is its own. Catches an OOM that escapes, and a clean-up inside
    the except block or without gc (the failed step's blocks would stay allocated and shrink every later probe)."""
    probe = probe_on(cuda_standin, script_device())
    with probe:
        peak, oom, thrash = probe.measure(8)
        assert oom and not thrash and cuda_standin.ooms == 1
        assert torch.cuda.memory_allocated(0) == PARAM_BYTES
        assert probe.measure(2) == (PARAM_BYTES + STATE_BYTES + 2 * ROW_BYTES, False, False)


def test_an_allocator_retry_is_reported_as_thrash(cuda_standin):
    """Activations of 1.5, 0.5, 0.5 GiB under a 4 GiB cap: the optimizer state (2 GiB) does not fit next to the
    cached 1.5 GiB block, the allocator frees its cache and retries; the step fits, but measure reports thrash.
    Catches a thrash flag read from the wrong counter or compared with the count after the probe."""
    with probe_on(cuda_standin, script_device(), sizes=[3 * GiB // 2, GiB // 2, GiB // 2]) as probe:
        peak, oom, thrash = probe.measure(1)
        assert (oom, thrash) == (False, True) and cuda_standin.retries == 1
        assert peak == PARAM_BYTES + STATE_BYTES + GiB // 2  # after the retry the cache holds live blocks only
    with probe_on(cuda_standin, script_device(), sizes=[GiB // 2]) as probe:
        assert probe.measure(1) == (PARAM_BYTES + STATE_BYTES + GiB // 2, False, False)


def test_more_than_one_rank_adds_ddps_gradient_buckets(cuda_standin):
    """world_size 2: the peak adds one flat copy of every gradient (the DDP buckets the probe does not allocate).
    Catches buckets counted for one process or left out for two."""
    with probe_on(cuda_standin, script_device(), world_size=2, built=(built := [])) as probe:
        buckets = sum(p.numel() * 4 for p in built[0].parameters())
        assert buckets == (64 * 8 + 64 * 8) * 4
        assert probe.measure(1)[0] == PARAM_BYTES + STATE_BYTES + ROW_BYTES + buckets


def test_no_fraction_leaves_the_allocator_cap_alone(cuda_standin):
    """fraction=None: the probe neither sets nor restores the cap. Catches a set_per_process_memory_fraction(None)."""
    cuda_standin.fraction = 0.75
    with probe_on(cuda_standin, script_device(), fraction=None):
        assert cuda_standin.fraction == 0.75
    assert cuda_standin.fraction == 0.75


def test_a_non_oom_error_propagates_and_exit_still_restores(cuda_standin):
    """A probe step failing with another error propagates it; the exit still restores the fraction, the weights
    and empties the cache. Catches an except that swallows every error as 'too big', a restore skipped on error."""
    built = []
    cuda_standin.fraction = 0.9
    with pytest.raises(RuntimeError, match="illegal memory access"):
        with probe_on(cuda_standin, script_device(), built=built) as probe:
            weights = [p.detach().clone() for p in built[0].parameters()]
            probe.measure(1)
            built[0].error = "CUDA error: an illegal memory access was encountered"
            probe.measure(1)
    assert cuda_standin.fraction == 0.9 and cuda_standin.reserved == cuda_standin.allocated
    assert all(torch.equal(a, b) for a, b in zip(weights, built[0].parameters()))


@pytest.mark.parametrize("total_gib, leaked_mib, warns", [
    (4, 64, False), (4, 64 + 1 / MiB, True),  # 1% of 4 GiB is below 64 MiB: the 64 MiB floor decides
    (16, 163.84, False), (16, 163.85, True),  # 1% of 16 GiB (163.84 MiB) is above the floor
])
def test_memory_left_allocated_after_a_probe_is_reported_past_the_threshold(monkeypatch, total_gib, leaked_mib,
                                                                            warns):
    """A probe that leaves memory allocated (kept activations) is reported once it exceeds max(64 MiB, 1% of the
    device), in this exact line; at the threshold it is not. Catches a leak check that is never made, one with
    another threshold, and one that compares against an unset or moved baseline."""
    standin = install(monkeypatch, total_memory=total_gib * GiB)
    logs, built = [], []
    leak = int(leaked_mib * MiB)
    with probe_on(standin, script_device(), sizes=[leak], built=built, logs=logs, fraction=None) as probe:
        built[0].leak = []  # one forward's activations stay allocated
        probe.measure(1)
    expected = (f"auto_batch_size: warning: {leak / MiB:.0f} MiB still allocated after a probe (later probes see "
                f"less memory, so the result errs on the small side)")
    assert logs == ([expected] if warns else [])


@pytest.mark.parametrize("foreign, warns", [(512 * MiB, False), (512 * MiB + 1, True)])
def test_memory_used_outside_the_allocator_is_reported_on_entry(monkeypatch, foreign, warns):
    """Device memory used by others (CUDA context, other processes) above 5% of the device (512 MiB of 10 GiB) is
    reported on entry, in this exact line; exactly 5% is not. Catches a foreign estimate that counts this process's
    reserved memory, another threshold, or >= for >."""
    standin = install(monkeypatch, total_memory=10 * GiB)
    standin.foreign = foreign
    logs = []
    with probe_on(standin, script_device(), logs=logs):
        pass
    expected = (f"auto_batch_size: warning: {foreign / GiB:.2f} GiB of cuda:0 is used outside this process's "
                f"allocator (CUDA context, other processes, NCCL); probes cannot see it")
    assert logs == ([expected] if warns else [])


def test_empty_cache_ooms_are_ignored_and_other_errors_raised(monkeypatch, cuda_standin):
    """torch.cuda.empty_cache raising an OOM is ignored by the guarded call (as Lightning's garbage collection does);
    any other error propagates. Catches a guard that hides every error, or none."""
    def failing(message):
        def empty_cache():
            raise RuntimeError(message)
        return empty_cache
    monkeypatch.setattr(torch.cuda, "empty_cache", failing("CUDA error: out of memory"))
    ab_probe._empty_cache_guarded()
    monkeypatch.setattr(torch.cuda, "empty_cache", failing("CUDA error: device-side assert triggered"))
    with pytest.raises(RuntimeError, match="device-side assert"):
        ab_probe._empty_cache_guarded()


# ----------------------------------------------------------------------------- discovery and budget on CUDA

def test_discovery_on_cuda_finds_the_largest_size_under_the_margin(cuda_standin, monkeypatch, tmp_path):
    """Discovery on the script's CUDA device probes for real (the default on CUDA) under a cap of margin x budget:
    with 8 GiB and margin 0.85 (6.8 GiB), 1 + 2 + 0.25 x B GiB fits up to B=15, so among the divisors of 64 the size
    is 8 (16 runs out of memory); the allocator's cap is back afterwards. Catches a probe kind other than real on
    CUDA, a fraction computed from another total, a cap not restored."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    batch_size, record = discover_device_batch_size(block_builder(cuda_standin), max_seq_len=16, vocab_size=64,
                                                    total_batch_size=64 * 16, world_size=1, device=script_device(),
                                                    margin=0.85, use_cache=False, key_fields={},
                                                    log=lambda *a: None)
    assert batch_size == 8 and record["measurement"] == "real step on CUDA, peak = max_memory_reserved"
    assert {p["batch_size"]: p["result"] for p in record["probes"]}[16] == "OOM"
    assert record["device"] == {"type": "cuda", "name": "NVIDIA H100 80GB HBM3", "total_memory": 8 * GiB,
                                "budget_bytes": 8 * GiB}
    assert cuda_standin.fraction == 1.0 and all_indexed(cuda_standin)


@pytest.mark.parametrize("gb, budget", [(None, 8 * GiB), (0.5, GiB // 2), (2.5, int(2.5 * GiB)), (100, 8 * GiB)])
def test_cuda_budget_is_the_device_memory_or_a_smaller_emulated_one(cuda_standin, gb, budget):
    """The CUDA budget is total_memory, or --device_memory_gb when smaller (an emulated smaller device, never a
    larger one). Catches max instead of min, GB instead of GiB, the CPU path on CUDA."""
    assert ab_probe.device_memory_budget("cuda", gb) == (budget, {"type": "cuda", "name": "NVIDIA H100 80GB HBM3",
                                                                  "total_memory": 8 * GiB, "budget_bytes": budget})
    with pytest.raises(UserError, match="--device_memory_gb=0: expected a positive number of GiB"):
        ab_probe.device_memory_budget(script_device(), 0)


# ----------------------------------------------------------------------------- the step-down on the allocator's OOM

def test_step_down_on_the_allocators_oom_keeps_the_rows_and_frees_the_failed_step(cuda_standin):
    """Training at device_batch_size=8 where the allocator (cap 0.45 x 8 GiB) refuses 8 rows of activations next to
    the parameters: the step-down redoes the step in micro-batches of 4 (same rows: the loss equals a plain
    4-row-micro-batch step) and the failed micro-step's memory is freed. Catches a step-down that loses the rows or
    keeps the failed step's blocks."""
    cuda_standin.fraction = 0.45  # 3.6 GiB: two models' parameters (2 GiB) and 4 rows (1 GiB) fit, 8 rows do not
    model = BlockLM(cuda_standin)
    ref = BlockLM(cuda_standin)
    ref.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    x, y = torch.randint(0, 64, (16, 16)), torch.randint(0, 64, (16, 16))
    step_down = OOMStepDown({"candidates": [1, 2, 4, 8, 16], "cache_key": {}}, None, 8, log=lambda *a: None)
    loss = step_down.forward_backward(model, x, y, nullcontext(), step=0)
    assert step_down.device_batch_size == 4 and model.calls == [8, 4, 4, 4, 4]
    assert torch.equal(loss, forward_backward(ref, micro_batches(x, y, 4), nullcontext()))
    assert cuda_standin.allocated == 2 * PARAM_BYTES and cuda_standin.ooms == 1


# ----------------------------------------------------------------------------- the budget where /proc or CUDA is missing

MEMINFO = "MemTotal:       33554432 kB\nMemFree:          524288 kB\n{}Cached:          1048576 kB\n"


def fake_meminfo(monkeypatch, text):
    """/proc/meminfo, as the probe module reads it, holds `text` (None: the file cannot be read)."""
    import io

    def fake_open(path, *args, **kwargs):
        if path != "/proc/meminfo":
            return open(path, *args, **kwargs)
        if text is None:
            raise FileNotFoundError(path)
        return io.StringIO(text)
    monkeypatch.setattr(ab_probe, "open", fake_open, raising=False)


@pytest.mark.parametrize("meminfo", [None, MEMINFO.format("")])
def test_budget_falls_back_to_the_physical_memory_without_memavailable(monkeypatch, meminfo):
    """Without /proc/meminfo, or without its MemAvailable line (old kernels), the CPU budget is half of the physical
    memory from sysconf: 2,097,152 pages of 4096 B = 8 GiB, so 4 GiB; without sysconf either, a one-line UserError
    naming --device_memory_gb. Catches a reader that returns 0 or None where sysconf answers, or a crash."""
    fake_meminfo(monkeypatch, meminfo)
    table = {"SC_PHYS_PAGES": 2_097_152, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(os, "sysconf", lambda name: table[name])
    assert ab_probe.device_memory_budget("cpu")[0] == 4 * GiB

    def no_sysconf(name):
        raise ValueError(f"unrecognized configuration name {name}")
    monkeypatch.setattr(os, "sysconf", no_sysconf)
    with pytest.raises(UserError, match=r"^cannot read this machine's memory size \(/proc/meminfo, sysconf\); pass "
                                        r"--device_memory_gb$"):
        ab_probe.device_memory_budget("cpu")


@pytest.mark.parametrize("ranks, want", [(1, 3 * GiB), (2, 1 * GiB)])
def test_mps_budget_is_capped_at_metals_recommended_memory(monkeypatch, ranks, want):
    """On MPS the budget is also capped at torch.mps.recommended_max_memory() (3 GiB here) per local rank: with
    16 GiB available, half is 8 GiB, the cap 3 GiB; two ranks get min(4, 1.5) GiB, rounded down to 1 GiB. Catches
    the cap left out, not divided among the ranks, or applied on the CPU."""
    fake_meminfo(monkeypatch, MEMINFO.format("MemAvailable:   16777216 kB\n"))
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 3 * GiB, raising=False)
    budget, desc = ab_probe.device_memory_budget("mps", None, local_world_size=ranks)
    assert (budget, desc["type"]) == (want, "mps")
    assert desc["source"] == f"0.5 x MemAvailable / {ranks} local rank(s)"
    assert ab_probe.device_memory_budget("cpu", None, local_world_size=ranks)[0] == 8 * GiB // ranks


# ----------------------------------------------------------------------------- the real probe on the CPU

def test_compiled_probes_compile_the_model_once_and_run_it(monkeypatch):
    """measure(compiled=True) probes torch.compile(model, dynamic=False), compiled once for every compiled probe, and
    measures the same step as the eager probe (the CPU's MemTracker sees the same tensors). torch.compile is stood
    in for by a recording wrapper (inductor takes minutes on the CPU). Catches a compiled probe that runs the eager
    model, recompiles per probe, or compiles with dynamic shapes (not what training runs)."""
    compiled_calls, forwards = [], []

    class Recorded(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, idx, targets):
            forwards.append(idx.size(0))
            return self.model(idx, targets)

    def fake_compile(model, **kwargs):
        compiled_calls.append((model, kwargs))
        return Recorded(model)
    monkeypatch.setattr(torch, "compile", fake_compile)
    built = []

    def build(device):
        model, optimizers = cpu_build(device)
        built.append(model)
        return model, optimizers
    with ab_probe.RealProbe(build, "cpu", 16, 64, None, 1, log=lambda *a: None) as probe:
        eager = probe.measure(2)
        assert forwards == []
        assert probe.measure(2, compiled=True) == eager and probe.measure(1, compiled=True)[0] < eager[0]
    assert compiled_calls == [(built[0], {"dynamic": False})] and forwards == [2, 2, 2, 1, 1, 1]


class CpuLM(nn.Module):
    """A tiny language model on the CPU (embedding, head, fp32 cross-entropy)."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64, bias=False)

    def forward(self, idx, targets):
        logits = self.head(self.wte(idx)).float()
        return F.cross_entropy(logits.view(-1, 64), targets.view(-1))


def cpu_build(device):
    torch.manual_seed(0)
    with torch.device(device):
        model = CpuLM()
    return model, [torch.optim.AdamW(model.parameters(), lr=1e-3)]


@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16])
def test_a_real_cpu_probe_measures_in_the_training_dtype_without_the_global_rng(amp_dtype):
    """A real CPU probe under bf16 autocast equals the fake measurement of the same step in bf16 (and is below the
    fp32 one at 32 rows: bf16 activations); neither draws from the global RNG. Catches a real probe that drops the training
    dtype (measures fp32 for a bf16 run) or makes its tokens from the global RNG (shifting training's data and init)."""
    with ab_probe.RealProbe(cpu_build, "cpu", 16, 64, amp_dtype, 1, log=lambda *a: None) as probe:
        rng = torch.get_rng_state()  # after the build, which seeds
        real = probe.measure(32)
        assert torch.equal(torch.get_rng_state(), rng)
    fake = ab_probe.measure_fake_peak(cpu_build, 32, max_seq_len=16, vocab_size=64, amp_dtype=amp_dtype)
    assert real == (fake, False, False)
    if amp_dtype is not None:  # 444,440 against 458,776 bytes (torch 2.13)
        assert fake < ab_probe.measure_fake_peak(cpu_build, 32, max_seq_len=16, vocab_size=64)


def test_a_meta_factory_gets_the_whole_message():
    """The one-line error for a build_probe that creates its model on the meta device and moves it with to_empty
    (which FakeTensorMode cannot run), pinned whole. Catches a cryptic "Couldn't swap" error reaching the user, or a
    message that no longer says what to do."""
    def meta_build(device):
        with torch.device("meta"):
            model = CpuLM()
        model.to_empty(device=device)
        return model, [torch.optim.AdamW(model.parameters())]
    with pytest.raises(ValueError) as info:
        ab_probe.measure_fake_peak(meta_build, 2, max_seq_len=16, vocab_size=64)
    assert str(info.value) == ("build_probe must create the model directly on the device it is given (e.g. with "
                               "torch.device(device): GPT(config)); meta + to_empty() cannot run under "
                               "FakeTensorMode; see gpt_builder")


def test_a_failing_build_reaches_the_user_as_itself(cuda_standin, monkeypatch, tmp_path):
    """build_probe raising on the CUDA path (before the probe set anything up): discovery raises that error, and the
    allocator's cap is untouched. Catches an exit that then trips over its own unset state (restoring a fraction it
    never read, restoring weights of a model never built) and hides the user's error behind its own."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))

    def failing_build(device):
        raise RuntimeError("no such checkpoint: model.pt")
    cuda_standin.fraction = 0.9
    with pytest.raises(RuntimeError, match="^no such checkpoint: model.pt$"):
        discover_device_batch_size(failing_build, max_seq_len=16, vocab_size=64, total_batch_size=64 * 16,
                                   world_size=1, device=script_device(), use_cache=False, key_fields={},
                                   log=lambda *a: None)
    assert cuda_standin.fraction == 0.9


def test_fake_probes_measure_with_every_setting_they_are_given():
    """FakeProbe(...).measure(B) is measure_fake_peak with the probe's settings: the training dtype and the world
    size (DDP's buckets for 2 ranks). Catches a probe that drops a setting (measures fp32 or one rank)."""
    probe = ab_probe.FakeProbe(cpu_build, "cpu", 16, 64, torch.bfloat16, 2)
    with probe:
        got = probe.measure(32)
    want = ab_probe.measure_fake_peak(cpu_build, 32, max_seq_len=16, vocab_size=64, amp_dtype=torch.bfloat16,
                                      world_size=2)
    assert got == (want, False, False)
    assert want == ab_probe.measure_fake_peak(cpu_build, 32, max_seq_len=16, vocab_size=64,
                                              amp_dtype=torch.bfloat16) + (64 * 16 + 16 * 64) * 4


@pytest.mark.parametrize("avail_kb, want", [
    (2_097_151, 805_306_368),  # 1 kB short of 2 GiB: half is 512 B short of 1 GiB, so 256 MiB steps: 3 x 256 MiB
    (2_097_152, GiB),  # exactly 2 GiB: half is 1 GiB, a whole GiB
])
def test_cpu_budget_at_the_gib_boundary(monkeypatch, avail_kb, want):
    """At the boundary between 256 MiB and whole-GiB rounding the kB unit of /proc/meminfo decides (1 kB = 1024 B):
    2,097,151 kB is 2,147,482,624 B, half 1,073,741,312 B < 1 GiB, so 768 MiB; 2,097,152 kB gives exactly 1 GiB. The
    description names the source. Catches a kB of 1000 or 1025 bytes."""
    fake_meminfo(monkeypatch, MEMINFO.format(f"MemAvailable:   {avail_kb} kB\n"))
    assert ab_probe.device_memory_budget("cpu") == (want, {"type": "cpu", "budget_bytes": want,
                                                          "source": "0.5 x MemAvailable / 1 local rank(s)"})
    assert ab_probe.device_memory_budget("cpu", 0.5) == (GiB // 2, {"type": "cpu", "budget_bytes": GiB // 2,
                                                                    "source": "--device_memory_gb"})
