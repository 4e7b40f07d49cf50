"""
A stand-in for torch.cuda on a CPU-only machine, so that the CUDA-only branches of nanotrain (the real probe's entry,
measurement and exit, the memory budget, the environment report) run in the default tier. The fixture `cuda_standin`
monkeypatches the torch.cuda functions nanotrain calls, keeping torch's contracts (torch 2.13, torch/cuda/memory.py
and torch/cuda/__init__.py):
- set_per_process_memory_fraction, get_per_process_memory_fraction and set_device take the device index with
  torch.cuda._utils._get_device_index(device) (optional=False): a CUDA device without an index raises ValueError;
  the memory queries, get_device_properties, mem_get_info, synchronize take it with optional=True (the current
  device). A CPU device raises ValueError everywhere, an index past device_count() too.
- A caching allocator of one device: alloc(nbytes) hands out a block (a CPU tensor standing for nbytes of device
  memory; freed when the tensor is garbage), reserved memory grows by whole blocks and is kept after a free until
  empty_cache(); a block that does not fit next to the cached ones makes the allocator free its cache and retry
  (memory_stats()["num_alloc_retries"] + 1); past fraction * total_memory it raises torch.OutOfMemoryError with the
  caching allocator's message. max_memory_reserved/max_memory_allocated are peaks since reset_peak_memory_stats.
- torch.Generator(device="cuda...") and torch.randint(..., device="cuda...") give CPU ones: the tensors underneath
  are CPU tensors (device_of(x) maps a CUDA device to the CPU for builders).
Every call is recorded in `calls` as (function name, device argument), torch.randint's too, so a test can check
that each device carried its index.
"""

import types
import weakref

import pytest
import torch
from torch.cuda._utils import _get_device_index

GiB = 2**30
MiB = 2**20


class CudaStandIn:
    """One CUDA device of `total_memory` bytes named `name` (see the module docstring for the contracts)."""

    def __init__(self, total_memory=8 * GiB, name="NVIDIA H100 80GB HBM3", capability=(9, 0)):
        self.total_memory, self.name, self.capability = total_memory, name, capability
        self.fraction = 1.0
        self.allocated = self.reserved = self.peak_allocated = self.peak_reserved = 0
        self.retries = self.ooms = self.empty_cache_calls = 0
        self.foreign = 0  # bytes used outside this process's allocator (other processes, the CUDA context)
        self.calls = []
        self.rng_state = torch.zeros(16, dtype=torch.uint8)

    # ------------------------------------------------------------------------- the allocator
    def alloc(self, nbytes):
        """A block of `nbytes` device bytes: a 1-element CPU tensor; the bytes are freed when it is garbage.
        Raises torch.OutOfMemoryError past fraction * total_memory, as the caching allocator does."""
        cap = int(self.fraction * self.total_memory)
        if nbytes > self.reserved - self.allocated:  # the cached free blocks are too small: new memory
            if self.reserved + nbytes > cap:
                if self.allocated + nbytes > cap:
                    self.ooms += 1
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory. Tried to allocate {nbytes / MiB:.2f} MiB. GPU 0 has a total capacity "
                        f"of {self.total_memory / GiB:.2f} GiB of which {(cap - self.reserved) / MiB:.2f} MiB is "
                        f"free. Of the allocated memory {self.allocated / MiB:.2f} MiB is allocated by PyTorch.")
                self.retries += 1  # frees the cached blocks and retries
                self.reserved = self.allocated
            self.reserved += nbytes
        self.allocated += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        block = torch.zeros(1)
        weakref.finalize(block, self._free, nbytes)
        return block

    def _free(self, nbytes):
        self.allocated -= nbytes

    # ------------------------------------------------------------------------- torch.cuda's functions
    def _index(self, name, device, optional):
        self.calls.append((name, device))
        index = _get_device_index(device, optional=optional)
        if index is None or not 0 <= index < self.device_count():
            raise ValueError(f"{name}: invalid device {device!r} (device_count() is {self.device_count()})")
        return index

    def is_available(self):
        return True

    def device_count(self):
        return 1

    def current_device(self):
        return 0

    def set_device(self, device):
        self._index("set_device", device, optional=False)

    def get_device_properties(self, device=None):
        self._index("get_device_properties", device, optional=True)
        return types.SimpleNamespace(name=self.name, total_memory=self.total_memory, major=self.capability[0],
                                     minor=self.capability[1], multi_processor_count=132)

    def get_device_name(self, device=None):
        return self.get_device_properties(device).name

    def get_device_capability(self, device=None):
        props = self.get_device_properties(device)
        return props.major, props.minor

    def get_per_process_memory_fraction(self, device=None):
        self._index("get_per_process_memory_fraction", device, optional=False)
        return self.fraction

    def set_per_process_memory_fraction(self, fraction, device=None):
        self._index("set_per_process_memory_fraction", device, optional=False)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction = fraction

    def memory_allocated(self, device=None):
        self._index("memory_allocated", device, optional=True)
        return self.allocated

    def memory_reserved(self, device=None):
        self._index("memory_reserved", device, optional=True)
        return self.reserved

    def max_memory_allocated(self, device=None):
        self._index("max_memory_allocated", device, optional=True)
        return self.peak_allocated

    def max_memory_reserved(self, device=None):
        self._index("max_memory_reserved", device, optional=True)
        return self.peak_reserved

    def reset_peak_memory_stats(self, device=None):
        self._index("reset_peak_memory_stats", device, optional=True)
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def memory_stats(self, device=None):
        self._index("memory_stats", device, optional=True)
        return {"num_alloc_retries": self.retries, "num_ooms": self.ooms,
                "allocated_bytes.all.current": self.allocated, "reserved_bytes.all.current": self.reserved}

    def mem_get_info(self, device=None):
        self._index("mem_get_info", device, optional=True)
        return self.total_memory - self.reserved - self.foreign, self.total_memory

    def synchronize(self, device=None):
        self._index("synchronize", device, optional=True)

    def get_rng_state(self, device="cuda"):
        self._index("get_rng_state", device, optional=True)
        return self.rng_state.clone()

    def set_rng_state(self, new_state, device="cuda"):
        self._index("set_rng_state", device, optional=True)
        self.rng_state = new_state.clone()

    def empty_cache(self):
        self.calls.append(("empty_cache", None))
        self.empty_cache_calls += 1
        self.reserved = self.allocated


def device_of(device):
    """The device the tensors of `device` live on under the stand-in: the CPU for a CUDA device."""
    device = torch.device(device)
    return torch.device("cpu") if device.type == "cuda" else device


FUNCTIONS = ("is_available", "device_count", "current_device", "set_device", "get_device_properties",
             "get_device_name", "get_device_capability", "get_per_process_memory_fraction",
             "set_per_process_memory_fraction", "memory_allocated", "memory_reserved", "max_memory_allocated",
             "max_memory_reserved", "reset_peak_memory_stats", "memory_stats", "mem_get_info", "synchronize",
             "get_rng_state", "set_rng_state", "empty_cache")


def install(monkeypatch, **kwargs):
    """Patches torch.cuda (FUNCTIONS), torch.Generator and torch.randint with a CudaStandIn(**kwargs); returns it.
    compute_init's TF32 switches are restored by monkeypatch afterwards."""
    standin = CudaStandIn(**kwargs)
    for name in FUNCTIONS:
        monkeypatch.setattr(torch.cuda, name, getattr(standin, name))
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", torch.backends.cuda.matmul.allow_tf32)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", torch.backends.cudnn.allow_tf32)
    generator, randint = torch.Generator, torch.randint

    class CpuGenerator(generator):
        def __new__(cls, device="cpu"):
            return generator(device=device_of(device))

    def cpu_randint(*args, device=None, **kw):
        standin.calls.append(("randint", device))
        return randint(*args, device=None if device is None else device_of(device), **kw)

    monkeypatch.setattr(torch, "Generator", CpuGenerator)
    monkeypatch.setattr(torch, "randint", cpu_randint)
    return standin


@pytest.fixture(name="cuda_standin")
def cuda_standin_fixture(monkeypatch):
    """`cuda_standin`: torch.cuda stood in for by a CudaStandIn of 8 GiB (an "NVIDIA H100 80GB HBM3" by name), see
    install. A test module imports cuda_standin_fixture to use it."""
    return install(monkeypatch)
