"""nanotrain.common pieces that are not covered elsewhere."""

import pytest
import torch

from nanotrain.common import UserError, check_compile_toolchain

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
