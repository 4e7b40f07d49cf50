"""A model too large for the device is refused in one line before any of its memory is taken
(nanotrain/auto_batch_size/model_memory.py, scripts/base_train.py)."""

import pytest
import torch
from helpers import run_script

from nanotrain.auto_batch_size.model_memory import check_model_fits, device_memory_bytes
from nanotrain.errors import UserError
from nanotrain.gpt import config_from_depth

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def test_depth_200_is_refused_depth_2_passes():
    """
    depth 200 (a typo for 20: model_dim 12,800, ~400B parameters, > 3 TB to train) is refused in one line naming the
    flag; depth 2 passes and its estimate is 8 bytes per parameter. Catches no check (the allocator's traceback after
    taking the machine's memory) and an estimate in parameters instead of bytes.
    """
    with pytest.raises(UserError) as e:
        check_model_fits(config_from_depth(200, 50304, 2048), CPU, "--depth=200")
    msg = str(e.value)
    assert msg.startswith("--depth=200: the model has ") and "GiB" in msg and "\n" not in msg
    small = config_from_depth(2, 256, 64)
    from nanotrain.gpt import GPT
    n = sum(p.numel() for p in GPT(small).parameters())
    assert check_model_fits(small, CPU, "--depth=2") == 8 * n
    assert check_model_fits(small, CPU, "--depth=2", shards=4) == 2 * n


def test_cpu_memory_is_what_the_kernel_says_is_available():
    """MemAvailable, in bytes: between 1 MiB and the machine's total. Catches kB read as bytes, or MemTotal."""
    have = device_memory_bytes(CPU)
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    assert 2**20 < have <= total


@pytest.mark.smoke
def test_base_train_depth_200_is_one_line(shared_base_dir):
    """base_train --depth=200 ends with one error line naming --depth=200, non-zero, no traceback, within seconds."""
    r = run_script("base_train.py", "--depth=200", "--num_iterations=1", base_dir=shared_base_dir, timeout=120)
    err = [line for line in r.stderr.strip().splitlines() if not line.startswith("Overriding: ")]
    assert r.returncode != 0 and len(err) == 1 and err[0].startswith("error: --depth=200: the model has "), r.stderr


@pytest.mark.smoke
def test_base_train_huge_max_seq_len_is_one_line(shared_base_dir):
    """
    base_train --max_seq_len=10^12 (the rotary tables alone would be ~5 PB, built on the host before the batch-size
    check) ends with one error line naming --max_seq_len, exit status 2, no traceback. Catches the memory check
    building the model first (a 40 TB allocation's traceback) and a message naming another flag.
    """
    r = run_script("base_train.py", "--max_seq_len=1000000000000", base_dir=shared_base_dir, timeout=120)
    err = [line for line in r.stderr.strip().splitlines() if not line.startswith("Overriding: ")]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-2000:]
    assert err[0].startswith("error: --max_seq_len=1000000000000: the rotary tables"), err
