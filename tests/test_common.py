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
