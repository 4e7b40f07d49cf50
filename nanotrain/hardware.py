"""
What the device can do: wait for its queued work, whether it computes bf16 matmuls fast (fast_bf16: the default
compute dtype and Muon's Newton-Schulz dtype both ask it), its peak FLOP/s for MFU (a datasheet figure on known GPUs,
a measured matmul throughput elsewhere), and whether torch.compile can build on it.
"""

import os
import shutil
import time

import torch

from nanotrain.common import all_reduce_scalar
from nanotrain.errors import UserError


def check_compile_toolchain(device):
    """
    torch.compile's inductor backend generates and builds C++ on CPU: raises UserError naming --compile when no C++
    compiler ($CXX, g++, c++ or clang++) is on the PATH, instead of a long inductor traceback at the first step.
    A no-op on other devices.
    """
    if torch.device(device).type != "cpu":
        return
    candidates = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if not any(c and shutil.which(c) for c in candidates):
        raise UserError("--compile=True on CPU needs a C++ compiler (g++ or clang++, or $CXX) for torch.compile; "
                        "install one or pass --compile=False")


def synchronize(device):
    """Waits for queued device work (CUDA/MPS); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# bf16 dense peak FLOP/s of known accelerators, from the vendors' datasheets
# (NVIDIA H100 SXM / H200 SXM datasheet: 989.4 TFLOPS dense bf16; A100 datasheet: 312 TFLOPS bf16).
GPU_PEAK_FLOPS = [
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10", 125e12),
    ("4090", 165e12),
    ("3090", 71e12),
]


def cpu_flags(path="/proc/cpuinfo"):
    """
    The CPU's feature flags (a set of str, e.g. {"avx512f", "avx512_bf16", ...}) from the first "flags" line of
    `path` (Linux on x86), or None where there is no such line or file (macOS; ARM Linux lists "Features" instead).
    """
    try:
        with open(path, errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "flags":
                    return set(value.split())
    except OSError:
        return None
    return None


def measure_matmul_flops(dtype=torch.float32, n=1024, seconds=1.0, device="cpu"):
    """
    Measures the device's dense matmul throughput in FLOP/s with (n, n) @ (n, n) products of `dtype`
    for about `seconds` seconds (best of repeated timings). Used as the MFU peak on CPU.
    """
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    dev = torch.device(device)
    for _ in range(2):
        a @ b
    synchronize(dev)
    best = 0.0
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        for _ in range(4):
            a @ b
        synchronize(dev)
        dt = time.perf_counter() - t0
        best = max(best, 4 * 2 * n**3 / dt)
    return best


def get_peak_flops(device, dtype=torch.float32):
    """
    Peak FLOP/s used for MFU. On CUDA: the bf16 dense figure of a known device from GPU_PEAK_FLOPS, or the measured
    matmul throughput if the device is not in the table. On CPU/MPS: the matmul throughput measured now in `dtype`.
    Returns (flops_per_second, source description).
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in GPU_PEAK_FLOPS:
            if key in name:
                return flops, f"{name} bf16 dense datasheet peak"
        return measure_matmul_flops(torch.bfloat16, 4096, 1.0, device), f"{name} measured bf16 matmul"
    flops = measure_matmul_flops(dtype, 1024, 0.3, device)
    return flops, f"measured {str(dtype).replace('torch.', '')} matmul on {device.type}"


_FAST_BF16 = {}  # device type -> bool, settled once per process
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16"}  # x86 flags of native bf16 dot products (AVX512-BF16, AMX)


def fast_bf16(device):
    """
    True if bf16 matmuls are native and fast on `device` (a torch.device or str): always on CUDA; never on devices
    other than CUDA and CPU; on CPU it depends on the CPU (CPUs that emulate bf16 run it several times slower than
    fp32). Where the CPU lists its flags (Linux on x86: cpu_flags), native means the avx512_bf16 or amx_bf16 flag,
    so the answer is the same in every process whatever else the machine is doing (a timing under load could flip
    it, and a resumed run would then compute differently). Where it lists none, a (512, 512) bf16 matmul must measure
    at least 2x the fp32 throughput, each timed for 0.05 s (the 2x bar keeps the answer stable under timing noise).
    Settled once per process and device type, with any dispatch mode (FakeTensorMode, MemTracker) switched off. Under
    torch.distributed on CPU the ranks agree (one all-reduce MIN: False unless every rank found fast bf16), so DDP
    replicas run the same numerics; the first call on CPU is then collective: every rank must make it.
    Asked by nanotrain.training.precision (the default --dtype) and nanotrain.muon.ns_dtype_for. Returns a bool.
    """
    kind = torch.device(device).type
    if kind not in _FAST_BF16:
        if kind == "cuda":
            _FAST_BF16[kind] = True
        elif kind == "cpu":
            from torch.utils._python_dispatch import _disable_current_modes
            with _disable_current_modes():  # real tensors even when first asked inside a fake-tensor memory probe
                flags = cpu_flags()
                if flags is not None:
                    fast = bool(flags & BF16_CPU_FLAGS)
                else:
                    fp32 = measure_matmul_flops(torch.float32, 512, 0.05)
                    bf16 = measure_matmul_flops(torch.bfloat16, 512, 0.05)
                    fast = bf16 >= 2 * fp32
                # replicas must run the same numerics: False unless every rank found fast bf16 (reduced inside the
                # guard: under a fake mode .item() of a real tensor is refused)
                _FAST_BF16[kind] = all_reduce_scalar(fast, "min", "cpu") > 0
        else:
            _FAST_BF16[kind] = False
    return _FAST_BF16[kind]
