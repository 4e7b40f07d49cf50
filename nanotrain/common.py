"""
Runtime helpers shared by every script: device choice, torchrun / torch.distributed set-up and tear-down, scalar
all-reduces, rank-0 printing, seeding and RNG state, the base directory for data and checkpoints, the script runner
(one `error:` line and an exit code for the errors of nanotrain.errors and Ctrl-C), atomic writes, the git commit.
It imports only nanotrain.errors; every other module may import it. What the device can do (peak FLOP/s, fast bf16):
nanotrain.common.

What the device can do: wait for its queued work, whether it computes bf16 matmuls fast (fast_bf16: the default
compute dtype and Muon's Newton-Schulz dtype both ask it), its peak FLOP/s for MFU (the datasheet figure of a GPU
known by exact name, none for any other GPU, a measured matmul throughput on CPU/MPS), and whether torch.compile can
build on it.
"""

import atexit
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from nanotrain.errors import OS_ERRNOS, UserError, base_dir_setting, os_error_line, path_kind, replacing

# CUDA caching allocator: expandable segments (grow a segment instead of allocating a new one) cut fragmentation when
# shapes vary (eval vs train, packed SFT rows, the auto batch size probes). Read when CUDA's allocator starts, so it is
# set here, at import, before any script touches CUDA; a value the user set in either variable wins. Harmless on CPU.
if not (os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"


def die(msg, code=2):
    """Print `error: msg` as one line to stderr (rank 0 only under torchrun) and exit with `code` (exit_process)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(f"error: {msg}", file=sys.stderr, flush=True)
    exit_process(code)


_DIST_STARTED = False  # set by compute_init once this process has started a process group


def exit_process(code=0):
    """
    Ends the script (or a spawned worker) with exit code `code` (int). In a process that started torch.distributed
    (compute_init under torchrun, or any process group still up) it tears the process group down (compute_cleanup),
    runs the atexit handlers, flushes stdout and stderr and leaves with os._exit(code), skipping the interpreter's
    finalization; otherwise it is sys.exit(code).

    Why: gloo's worker thread (torch 2.13) can still be dropping a finished collective's tensors, which takes the
    GIL, when the interpreter finalizes; CPython then ends that thread inside a C++ destructor and the process
    aborts (SIGABRT, "terminate called without an active exception") after the run has succeeded.
    """
    if not (_DIST_STARTED or is_distributed()):
        sys.exit(code)
    compute_cleanup()
    atexit._run_exitfuncs()  # what normal exit runs before finalization (logging, our prefetch threads, inductor)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_script(main, trains=False):
    """
    Runs a script's main() the way every script ends, and leaves through exit_process(0) (not sys.exit: see
    exit_process) when it returns; the process group is torn down on every path. One `error: ...` line on stderr
    (die: rank 0 under torchrun) instead of a traceback for:
      - a UserError: its message, exit code 2;
      - an OSError of the user's environment (OS_ERRNOS: full disk, read-only, no permission, a path of the wrong
        kind): os_error_line (naming the path and what to do), exit code 1;
      - KeyboardInterrupt (Ctrl-C; in a training script `trains`=True, a second Ctrl-C, nanotrain.stop): exit code
        130, the shell's code for SIGINT. Files being written when it came are cleaned up on the way out.
    `trains`: the script trains and saves checkpoints (the lines then say --resume=True continues the run). Any other
    exception propagates with its traceback (a bug, not the user's input or environment). A script that imported
    nanotrain.interrupt (or nanotrain.stop) first has its start-up and its exit covered too; while main() runs, its
    Ctrl-C raises KeyboardInterrupt (nanotrain.interrupt.main_started).
    """
    interrupt = sys.modules.get("nanotrain.interrupt")  # looked up, not imported: this module imports no nanotrain
    try:
        if interrupt is not None:
            interrupt.main_started = True
        try:
            main()
        finally:  # the work is over: a Ctrl-C from here on (the exit) ends the process at once, without a traceback
            if interrupt is not None:
                interrupt.main_started = False
    except UserError as e:
        die(str(e))
    except KeyboardInterrupt:
        checkpoint = sys.modules.get("nanotrain.checkpoint")  # looked up, not imported (it imports this module)
        die(checkpoint.interrupted_line() if trains and checkpoint is not None else
            "interrupted by a second Ctrl-C; run again with --resume=True to continue from the last checkpoint"
            if trains else "interrupted (Ctrl-C)", 130)
    except OSError as e:
        line = os_error_line(e, trains)
        if line is None:
            raise
        die(line, 1)
    finally:
        compute_cleanup()
    exit_process(0)


def get_base_dir():
    """
    The directory for data, tokenizer, checkpoints and caches (created): $NANOTRAIN_BASE_DIR, made absolute against
    the current directory (so every message names the directory looked in), or ~/.cache/nanotrain. Raises UserError
    (one line naming it) when it exists but is not a directory, or cannot be created (read-only file system, no
    permission, a file on its path).
    """
    base = base_dir_setting()
    what = ("NANOTRAIN_BASE_DIR" if os.environ.get("NANOTRAIN_BASE_DIR")
            else "the default base directory; set NANOTRAIN_BASE_DIR to choose another")
    if os.path.exists(base) and not os.path.isdir(base):
        raise UserError(f"the base directory {base} ({what}) is {path_kind(base)}, not a directory: point "
                        f"NANOTRAIN_BASE_DIR at a directory, or move that file away")
    try:
        os.makedirs(base, exist_ok=True)
    except OSError as e:
        if e.errno not in OS_ERRNOS:
            raise
        raise UserError(f"cannot create the base directory {base} ({what}): {os_error_line(e)}") from None
    return base


def get_dist_info():
    """Returns (is_ddp, rank, local_rank, world_size) from the torchrun environment (RANK, LOCAL_RANK, WORLD_SIZE)."""
    if all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return False, 0, 0, 1


def is_master():
    return get_dist_info()[1] == 0


def print0(*args, **kwargs):
    """print() on rank 0 only, flushed."""
    if is_master():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def autodetect_device_type():
    """'cuda' if available, else 'mps', else 'cpu'."""
    if torch.cuda.is_available():
        return "cuda"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def rng_state(device):
    """
    The RNG states of this process: Python's, NumPy's global generator, torch's CPU generator and, on a CUDA `device`,
    that device's generator. A dict of lists and tensors, loadable with torch.load(weights_only=True) (checkpoints
    keep it per rank).
    """
    version, state, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [version, list(state), gauss], "torch": torch.get_rng_state(),
           "numpy": [torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]}
    if torch.device(device).type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state, device):
    """Restores the RNG states saved by rng_state(device) (the CUDA one only on a CUDA `device`; NumPy's when the
    state has it: a checkpoint written before it was saved has not)."""
    version, st, gauss = state["python"]
    random.setstate((version, tuple(st), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state(("MT19937", keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


@contextlib.contextmanager
def eval_mode(model):
    """model.eval() for the block, then the training mode it had (also when the block returns early or raises)."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def seed_everything(seed):
    """Seeds Python's, NumPy's and torch's (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def is_distributed():
    """True when a torch.distributed process group is up in this process (torchrun, or a test's spawned ranks)."""
    return dist.is_available() and dist.is_initialized()


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "min": "MIN", "max": "MAX"}


def rank_world():
    """(rank, world_size) in this process's process group; (0, 1) without one."""
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def all_reduce_scalar(value, op, device):
    """
    One number reduced over all ranks: op is "sum", "mean", "min" or "max". value: a 0-dim tensor (reduced in its
    own dtype, e.g. an fp32 loss), a bool or int (int64: exact counts and flags) or a float (float64), placed on
    `device` for the collective. Returns a Python number (float for tensors and floats, int for bools and ints);
    without a process group, the value itself. Collective: every rank must call it. Raises ValueError for another op.
    """
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce_scalar: op={op!r}: expected one of {sorted(_REDUCE_OPS)}")
    if not is_distributed():  # no tensor, no device sync for plain numbers
        return value.item() if torch.is_tensor(value) else int(value) if isinstance(value, bool) else value
    if torch.is_tensor(value):
        t = value.detach().reshape(()).clone()
    elif isinstance(value, (bool, int)):
        t = torch.tensor(int(value), dtype=torch.int64, device=device)
    else:
        t = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]))
    if op == "mean":
        t /= dist.get_world_size()
    return t.item()


def any_rank(flag, device):
    """True if `flag` (bool) is set on any rank (one all-reduce MAX; the flag itself without a process group)."""
    return all_reduce_scalar(bool(flag), "max", device) > 0


def barrier():
    """dist.barrier() when a process group is up; a no-op otherwise."""
    if is_distributed():
        dist.barrier()


def compute_init(device_type=""):
    """
    Sets up the device and, under torchrun, the process group (nccl on CUDA, gloo otherwise), one device per
    local rank. `device_type` is "cuda", "mps", "cpu" or "" for autodetect.
    Returns (is_ddp, rank, local_rank, world_size, device). Raises UserError for an unknown or unavailable device.
    """
    device_type = device_type or autodetect_device_type()
    if device_type not in ("cuda", "mps", "cpu"):
        raise UserError(f"--device_type={device_type!r}: expected one of 'cuda', 'mps', 'cpu' or '' (autodetect)")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device_type=cuda but torch.cuda.is_available() is False (CPU-only torch or no GPU)")
    if device_type == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device_type=mps but MPS is not available on this machine")
    is_ddp, rank, local_rank, world_size = get_dist_info()
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if is_ddp:
        global _DIST_STARTED
        _DIST_STARTED = True  # (set first: a failed init must still exit through exit_process)
        if device_type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            device = torch.device(device_type)
            dist.init_process_group(backend="gloo")
            # one process per core group: split the cores among the local ranks
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        dist.barrier()
    else:
        device = indexed_device(torch.device(device_type))
    return is_ddp, rank, local_rank, world_size, device


def indexed_device(device):
    """
    `device` (a torch.device or a string) with its index filled in on CUDA: torch.device("cuda") becomes
    cuda:<torch.cuda.current_device()>. torch.cuda's memory-fraction calls (set/get_per_process_memory_fraction)
    raise ValueError for a CUDA device without an index; every device a script gets carries one. Other device
    types are returned as torch.device(device), unchanged.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def compute_cleanup():
    """Destroys the process group if one is up (safe to call twice, on error paths too)."""
    if is_distributed():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def atomic_write_text(path, text):
    """
    Writes `text` to `path` through a temp file in the same directory and os.replace (never a torn file). If the
    write fails (an OSError, e.g. a full disk, or KeyboardInterrupt) the temp file is removed and the error raised,
    an OSError naming `path` (not the temp file); `path` is untouched.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with replacing(path) as tmp, open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def atomic_write_json(path, obj):
    """atomic_write_text of json.dumps(obj, indent=2)."""
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def git_commit():
    """The repo's git commit hash (with '-dirty' if there are local changes), or 'unknown'."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5)
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5)
        return sha.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:
        return "unknown"


# ----------------------------------------------------------------------------- hardware: bf16 speed, peak FLOP/s, compile toolchain

def check_compile_toolchain(device):
    """
    torch.compile's inductor backend generates and builds C++ on CPU: raises UserError naming --compile when no C++
    compiler ($CXX, g++, c++ or clang++) is on the PATH, instead of a long inductor traceback at the first step.
    A no-op on other devices.
    """
    if torch.device(device).type != "cpu":
        return
    if cxx_compiler() is None:
        raise UserError("--compile=True on CPU needs a C++ compiler (g++ or clang++, or $CXX) for torch.compile; "
                        "install one or pass --compile=False")


def cxx_compiler():
    """The first C++ compiler on the PATH among $CXX, g++, c++ and clang++ (its name), or None."""
    return next((c for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++") if c and shutil.which(c)), None)


def synchronize(device):
    """Waits for queued device work (CUDA/MPS); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# name -> (dense bf16 peak FLOP/s, where the figure comes from): no 2:4 sparsity; bf16 inputs, fp32 accumulate, as
# torch's bf16 matmuls run. The key is the exact name torch.cuda.get_device_name returns (one card per name: an
# "H100 PCIe" is not an "H100 80GB HBM3"; a MIG slice's name carries a suffix and is not in the table). Where a
# datasheet prints only the figure with sparsity ("*"), the dense figure is half of it. Sources (vendor documents):
#   Hopper whitepaper (H100 SXM5 / PCIe): https://resources.nvidia.com/en-us-tensor-core/gtc22-whitepaper-hopper
#   H100 datasheet: https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet
#   H200 datasheet: https://www.nvidia.com/en-us/data-center/h200/
#   GH200 datasheet: https://resources.nvidia.com/en-us-grace-cpu/grace-hopper-superchip
#   Blackwell datasheets: "NVIDIA DGX B200" / "HGX B100, B200" / "GB200 NVL72",
#     https://www.nvidia.com/en-us/data-center/hgx/ and https://www.nvidia.com/en-us/data-center/gb200-nvl72/
#   A100 datasheet: nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf, https://www.nvidia.com/en-us/data-center/a100/
#   A10 / A30 / A40 / L4 / L40 / L40S datasheets: https://www.nvidia.com/en-us/data-center/<card>/; RTX A6000
#   datasheet: https://www.nvidia.com/en-us/design-visualization/rtx-a6000/
#   Ampere GA102 whitepaper: "NVIDIA Ampere GA102 GPU Architecture" (RTX 3090: BF16 with FP32 accumulate),
#     https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf
#   Ada whitepaper: "NVIDIA Ada GPU Architecture" (RTX 4090, RTX 6000 Ada: BF16 with FP32 accumulate),
#     https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf
#   AMD Instinct MI300X / MI325X datasheets: https://www.amd.com/en/products/accelerators/instinct/mi300.html
GPU_PEAK_FLOPS = {
    "NVIDIA H100 80GB HBM3": (989.4e12, "H100 SXM5, Hopper whitepaper: 989.4 TFLOP/s (1,978.9 sparse)"),
    "NVIDIA H100 PCIe": (756e12, "H100 PCIe, Hopper whitepaper: 756 TFLOP/s (1,513 sparse)"),
    "NVIDIA H100 NVL": (835.5e12, "H100 NVL, H100 datasheet: 1,671 TFLOP/s sparse per GPU"),
    "NVIDIA H200": (989.4e12, "H200 SXM, H200 datasheet: 1,979 TFLOP/s sparse (the H100 SXM5's GPU and clocks)"),
    "NVIDIA H200 NVL": (835.5e12, "H200 NVL, H200 datasheet: 1,671 TFLOP/s sparse"),
    "NVIDIA GH200 480GB": (989.4e12, "GH200 (96 GB HBM3), GH200 datasheet: 1,979 TFLOP/s sparse"),
    "NVIDIA GH200 144G HBM3e": (989.4e12, "GH200 (144 GB HBM3e), GH200 datasheet: 1,979 TFLOP/s sparse"),
    "NVIDIA B200": (2250e12, "B200, HGX B200 datasheet: 4.5 PFLOP/s sparse per GPU"),
    "NVIDIA B100": (1750e12, "B100, HGX B100 datasheet: 3.5 PFLOP/s sparse per GPU"),
    "NVIDIA GB200": (2500e12, "GB200, GB200 NVL72 datasheet: 5 PFLOP/s sparse per GPU"),
    "NVIDIA A100-SXM4-80GB": (312e12, "A100 SXM4 80GB, A100 datasheet: 312 TFLOP/s"),
    "NVIDIA A100-SXM4-40GB": (312e12, "A100 SXM4 40GB, A100 datasheet: 312 TFLOP/s"),
    "NVIDIA A100 80GB PCIe": (312e12, "A100 PCIe 80GB, A100 datasheet: 312 TFLOP/s"),
    "NVIDIA A100-PCIE-40GB": (312e12, "A100 PCIe 40GB, A100 datasheet: 312 TFLOP/s"),
    "NVIDIA A10": (125e12, "A10, A10 datasheet: 125 TFLOP/s"),
    "NVIDIA A30": (165e12, "A30, A30 datasheet: 165 TFLOP/s"),
    "NVIDIA A40": (149.7e12, "A40, A40 datasheet: 149.7 TFLOP/s"),
    "NVIDIA RTX A6000": (154.8e12, "RTX A6000, RTX A6000 datasheet: 309.7 TFLOP/s tensor, sparse"),
    "NVIDIA L4": (121e12, "L4, L4 datasheet: 242 TFLOP/s sparse"),
    "NVIDIA L40": (181.05e12, "L40, L40 datasheet: 181.05 TFLOP/s"),
    "NVIDIA L40S": (362.05e12, "L40S, L40S datasheet: 362.05 TFLOP/s"),
    "NVIDIA RTX 6000 Ada Generation": (364.2e12, "RTX 6000 Ada, Ada whitepaper: 364.2 TFLOP/s"),
    "NVIDIA GeForce RTX 4090": (165.2e12, "RTX 4090, Ada whitepaper: 165.2 TFLOP/s with FP32 accumulate"),
    "NVIDIA GeForce RTX 3090": (71e12, "RTX 3090, GA102 whitepaper: 71 TFLOP/s with FP32 accumulate"),
    "AMD Instinct MI300X": (1307.4e12, "MI300X, MI300X datasheet: 1,307.4 TFLOP/s"),
    "AMD Instinct MI325X": (1307.4e12, "MI325X, MI325X datasheet: 1,307.4 TFLOP/s"),
}


def cpu_flags(path="/proc/cpuinfo"):
    """
    The CPU's feature flags (a set of str, e.g. {"avx512f", "avx512_bf16", ...}) from the first "flags" line of
    `path` (Linux on x86), or None where there is no such line or file (macOS; ARM Linux lists "Features" instead).
    """
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        for line in f:
            key, sep, value = line.partition(":")
            if sep and key.strip() == "flags":
                return set(value.split())
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
    Peak FLOP/s used for MFU, as (flops_per_second or None, source description). On CUDA (and ROCm): the dense bf16
    datasheet figure of the card whose exact torch.cuda.get_device_name is a key of GPU_PEAK_FLOPS; for any other
    card None (the run logs "MFU n/a": a guessed or measured peak would make the MFU incomparable), with a source
    that names the card. On CPU/MPS: the matmul throughput measured now in `dtype`.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if name in GPU_PEAK_FLOPS:
            flops, source = GPU_PEAK_FLOPS[name]
            return flops, f"{name}: dense bf16 datasheet peak ({source})"
        return None, f"{name}: not in nanotrain.common.GPU_PEAK_FLOPS, MFU n/a"
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
        if kind != "cpu":
            _FAST_BF16[kind] = kind == "cuda"  # always on CUDA, never on other devices
        else:
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
    return _FAST_BF16[kind]
