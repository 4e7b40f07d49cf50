"""nanotrain.common pieces that are not covered elsewhere."""

import pytest
import torch
from helpers import free_port

from nanotrain.common import check_compile_toolchain
from nanotrain.errors import UserError

pytestmark = pytest.mark.unit


def test_compile_on_cpu_without_a_compiler_is_one_clear_error(monkeypatch, tmp_path):
    """
    torch.compile on CPU builds C++: with no compiler on the PATH the scripts stop with one line naming --compile
    (not an inductor traceback at the first step); with one (this machine has g++) it passes; other devices never
    need one. Catches: a check that looks only at $CXX, or one that fails on every machine.
    """
    check_compile_toolchain(torch.device("cpu"))  # g++ is installed here
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(UserError, match="--compile=True on CPU needs a C\\+\\+ compiler"):
        check_compile_toolchain(torch.device("cpu"))
    check_compile_toolchain(torch.device("meta"))  # not CPU: nothing to build


def test_expandable_segments_set_before_cuda_unless_the_user_chose(tmp_path):
    """
    Importing nanotrain.common (every script does, before touching CUDA) sets PYTORCH_ALLOC_CONF to
    expandable_segments:True, and leaves a value the user set in PYTORCH_ALLOC_CONF or the older PYTORCH_CUDA_ALLOC_CONF
    alone. Catches: setting it too late (after torch.cuda starts: here checked as "set at import"), or overriding the
    user's allocator settings.
    """
    import os
    import subprocess
    import sys

    code = "import nanotrain.common, os; print(os.environ.get('PYTORCH_ALLOC_CONF'))"
    base = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    for extra, expected in (({}, "expandable_segments:True"),
                            ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}, "max_split_size_mb:64"),
                            ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, "None")):
        out = subprocess.run([sys.executable, "-c", code], env={**base, **extra}, capture_output=True, text=True,
                             timeout=60, check=True)
        assert out.stdout.strip() == expected


# ----------------------------------------------------------------------------- exit under torch.distributed

EXIT_SCRIPT = """
import atexit, sys, torch, torch.distributed as dist
from nanotrain.common import compute_cleanup, compute_init, die, exit_process
how = sys.argv[1]
is_ddp, rank, _, world, device = compute_init("cpu")
atexit.register(lambda: print(f"atexit ran on rank {rank}"))  # unflushed too: exit_process must flush after atexit
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
model(torch.randn(4, 16)).sum().backward()
sums = [torch.zeros(()) for _ in range(world)]
dist.all_gather(sums, torch.tensor(float(rank)))  # as check_replicas at the end of a run: all_gather, then barrier
dist.barrier()
print(f"buffered line from rank {rank}")  # stdout is a pipe: block-buffered, lost unless flushed
if how == "die":
    die("--flag=x: expected y")
if how == "sys.exit":  # the plain ending, for comparison
    compute_cleanup()
    sys.exit(0)
exit_process(int(how))
"""


def _exit_env():
    """The environment without PYTHONUNBUFFERED (any non-empty value, "0" too, makes stdout unbuffered)."""
    import os
    return {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, "OMP_NUM_THREADS": "1"}


@pytest.mark.dist
def test_exit_process_under_distributed_keeps_code_atexit_and_output(tmp_path):
    """
    A process that started a gloo group (1 rank, no torchrun) and ends through exit_process(3) or die(): the exit code
    is kept (3; 2 for die), the atexit handlers ran, and block-buffered stdout reached the pipe, with die's one
    `error:` line on stderr. Catches an os._exit that drops the code, skips atexit (logging, prefetch threads) or loses
    buffered output.
    """
    import subprocess
    import sys

    script = tmp_path / "exit_script.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(_exit_env(), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    for how, code in (("3", 3), ("die", 2)):
        out = subprocess.run([sys.executable, str(script), how], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == code, (how, out.stdout, out.stderr[-2000:])
        assert "buffered line from rank 0" in out.stdout and "atexit ran on rank 0" in out.stdout, out.stdout
        if how == "die":
            assert out.stderr.strip().splitlines()[-1] == "error: --flag=x: expected y", out.stderr


@pytest.mark.slow
def test_two_rank_runs_never_abort_at_exit(tmp_path):
    """
    20 launches of a 2-rank torchrun DDP script that ends like base_train (all_gather, barrier, exit), with a busy
    process competing for the 2 cores: every launch exits 0, with both ranks' atexit output. Catches the teardown abort
    that exit_process avoids: with a plain sys.exit after destroy_process_group, gloo's worker thread can still be
    dropping the last collective's tensors (which takes the GIL) when the interpreter finalizes, and the rank dies of
    SIGABRT; measured on this machine with this script's `sys.exit` variant: 9 failed launches in 25 (5 to 7 in 25 to 30 with
    a similar script), so this test fails on that variant with probability about 0.99.
    """
    import subprocess
    import sys

    script = tmp_path / "exit_script.py"
    script.write_text(EXIT_SCRIPT)
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        failed = []
        for i in range(20):
            out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                  str(script), "0"], env=_exit_env(), capture_output=True, text=True, timeout=120)
            if out.returncode != 0 or out.stdout.count("atexit ran on rank") != 2:
                failed.append((i, out.returncode, out.stderr[-1500:]))
    finally:
        hog.kill()
        hog.wait()
    assert not failed, failed


# ----------------------------------------------------------------------------- scalar all-reduces

def _reduce_worker(rank, world, port, out):
    import os

    from nanotrain.common import all_reduce_scalar, any_rank, compute_init, exit_process
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    compute_init("cpu")
    cpu = torch.device("cpu")
    big = 2**53 + 1  # not representable in float64: an int reduced through a float would lose the 1
    out.put((rank, {
        "sum": all_reduce_scalar([3, 4][rank], "sum", cpu), "min": all_reduce_scalar([3, 4][rank], "min", cpu),
        "max": all_reduce_scalar([3.5, -1.0][rank], "max", cpu),
        "mean": all_reduce_scalar(torch.tensor([1.0, 2.0][rank]), "mean", cpu),
        "big": all_reduce_scalar([big, 0][rank], "sum", cpu),
        "any": any_rank(rank == 1, cpu), "none": any_rank(False, cpu)}))
    exit_process(0)  # not a plain return: see exit_process


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_scalar_all_reduces_on_two_ranks():
    """
    all_reduce_scalar and any_rank on 2 gloo ranks give every rank the same literal results (sum 7, min 3, max 3.5,
    mean 1.5 of a fp32 tensor, an int sum exact past 2**53) and any_rank is True when one rank's flag is set; without
    a process group they return the value itself. Catches a mean that forgets to divide, MIN/MAX swapped, ints
    reduced as floats, and a flag reduced with MIN (True only when every rank is set).
    """
    import socket

    import torch.multiprocessing as mp

    from nanotrain.common import all_reduce_scalar, any_rank
    assert all_reduce_scalar(5, "min", "cpu") == 5 and any_rank(True, "cpu") is True
    with pytest.raises(ValueError, match="op='avg'"):
        all_reduce_scalar(1.0, "avg", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_reduce_worker, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(out.get() for _ in procs)
    for p in procs:
        p.join(60)
    expected = {"sum": 7, "min": 3, "max": 3.5, "mean": 1.5, "big": 2**53 + 1, "any": True, "none": False}
    assert results[0] == results[1] == expected


X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme avx512f avx512_bf16 avx512_vnni
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes bf16 i8mm
CPU implementer\t: 0x41
"""


@pytest.mark.unit
def test_cpu_flags_from_literal_cpuinfo(tmp_path):
    """
    The first "flags" line of an x86 /proc/cpuinfo as a set, word by word (the second processor's line ignored);
    None for ARM's "Features" layout, a missing file, and a line whose key only starts with "flags" (flags_x).
    Catches the last processor's line read instead of the first, a substring test ("avx512" matching
    "avx512_bf16"), and an ARM CPU read as one with no flags (which would pin it to fp32 instead of measuring).
    """
    from nanotrain.common import cpu_flags
    x86, arm, odd = tmp_path / "x86", tmp_path / "arm", tmp_path / "odd"
    x86.write_text(X86_CPUINFO)
    arm.write_text(ARM_CPUINFO)
    odd.write_text("flags_x\t: avx512_bf16\n")
    assert cpu_flags(str(x86)) == {"fpu", "vme", "avx512f", "avx512_bf16", "avx512_vnni"}
    assert cpu_flags(str(arm)) is None
    assert cpu_flags(str(tmp_path / "missing")) is None
    assert cpu_flags(str(odd)) is None


# ----------------------------------------------------------------------------- peak FLOP/s by exact card name

@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA H100 PCIe", 756), ("NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", 989.4), ("NVIDIA H200 NVL", 835.5), ("NVIDIA GH200 480GB", 989.4),
    ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100-PCIE-40GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA A10", 125), ("NVIDIA L4", 121), ("NVIDIA L40S", 362.05), ("NVIDIA B200", 2250),
    ("NVIDIA GeForce RTX 4090", 165.2), ("AMD Instinct MI300X", 1307.4),
    # cards of no entry: a substring of theirs names a known card
    ("NVIDIA A10G", None), ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None), ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA H100 80GB HBM3 (emulated)", None), ("Some Future GPU 9000", None),
])
def test_peak_flops_by_exact_card_name(monkeypatch, name, tflops):
    """
    get_peak_flops on CUDA under stand-in card names: each known card gets its own datasheet figure (dense bf16, in
    TFLOP/s: H100 PCIe 756 and NVL 835.5, not the SXM's 989.4), and a name that is not a key of GPU_PEAK_FLOPS gets
    None with a source naming the card and "MFU n/a", without measuring anything. Catches the substring match (an
    "H100 PCIe" or "H200 NVL" read as the SXM part, an "A10G" or a MIG slice read as an A10 / A100), a sparsity
    figure used as the dense one, and a measured or guessed peak for an unknown card.
    """
    import nanotrain.common as common

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(common, "measure_matmul_flops", lambda *a, **k: pytest.fail("measured a CUDA peak"))
    flops, source = common.get_peak_flops(torch.device("cuda"), torch.bfloat16)
    assert source.startswith(name + ": ")
    if tflops is None:
        assert flops is None and "MFU n/a" in source
    else:
        assert flops == pytest.approx(tflops * 1e12, rel=1e-9) and "datasheet" in source


def test_step_log_line_without_a_peak_says_mfu_na():
    """
    step_log_line with peak_flops=None (a card not in the table): the line says "mfu n/a" and the metrics row holds
    mfu None; tokens/s is still 24,000 tokens / 12 s = 2,000. Catches a crash on None, an MFU of 0% or inf printed as
    if measured, and a guessed peak.
    """
    from nanotrain.run import step_log_line

    line, row = step_log_line(5, 55, loss=2.5, grad_norm=None, lrm=1.0, dt=12.0, tokens=24_000, flops_per_token=5e6,
                              peak_flops=None, world_size=2)
    assert "| tok/s 2,000 | mfu n/a | eta" in line
    assert row["mfu"] is None and row["tok_per_sec"] == 2000.0
