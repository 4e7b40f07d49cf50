"""
Whether a model can be trained on this device at all, decided before any of its memory is taken: the parameter count
from a build on the meta device (free), against the device's memory.
"""

import contextlib

import torch

from nanotrain.errors import UserError

BYTES_PER_PARAM = 8  # the least training needs: fp32 weights and their fp32 gradients (optimizer state comes on top)


def device_memory_bytes(device):
    """
    The memory a model on `device` (torch.device) can take, in bytes: CUDA the device's total memory, CPU the kernel's
    MemAvailable (/proc/meminfo); None where it cannot be known (another device type, no /proc).
    """
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu":
        with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return None


def check_model_fits(model_config, device, flag, shards=1):
    """
    Refuses a model that cannot be trained on `device`: its parameters (counted on the meta device, nothing
    allocated) times BYTES_PER_PARAM, divided over `shards` (FSDP ranks), against device_memory_bytes. A lower
    bound, so a model it passes may still run out of memory; one it refuses surely would. Returns the estimate in
    bytes. Raises UserError (one line naming `flag`, e.g. "--depth=200", the parameters and both sizes) otherwise.
    First, before the build (which computes them on the host): the rotary tables, cos and sin fp32 (10 * max_seq_len,
    head_dim / 2) each (nanotrain.gpt.GPT), against the host's and the device's memory: a UserError naming
    --max_seq_len where they alone do not fit.
    """
    from nanotrain.gpt import GPT
    rotary = 2 * 10 * model_config.max_seq_len * (model_config.model_dim // model_config.n_head // 2) * 4
    for where, have in (("the host", device_memory_bytes(torch.device("cpu"))), (str(device), device_memory_bytes(device))):
        if have is not None and rotary > have:
            raise UserError(f"--max_seq_len={model_config.max_seq_len}: the rotary tables (10 x max_seq_len positions) "
                            f"alone take {rotary / 2**30:,.1f} GiB, more than the {have / 2**30:.1f} GiB {where} has; "
                            f"choose a smaller --max_seq_len")
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(model_config).parameters())
    need = n * BYTES_PER_PARAM // max(1, shards)
    have = device_memory_bytes(device)
    if have is not None and need > have:
        where = "available (MemAvailable)" if device.type == "cpu" else "in total"
        raise UserError(f"{flag}: the model has {n / 1e9:.2f}B parameters, at least {need / 2**30:.1f} GiB to train "
                        f"(fp32 weights and gradients), more than the {have / 2**30:.1f} GiB {device} has {where}; "
                        f"choose a smaller model")
    return need
