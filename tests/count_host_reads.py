"""
Counts the device-to-host reads of a training loop, run in this process on a tiny model (tests/test_host_reads.py),
or from the command line for the numbers of dev/LOG.md:

    PYTHONPATH=$PWD python tests/count_host_reads.py scripts/base_train.py --depth=2 ... --num_iterations=10

What counts as a read (decided here, the same on every device): each call of aten._local_scalar_dense, which is what
.item(), float(), int(), bool() and formatting of a tensor call (seen by a TorchDispatchMode), plus each .tolist(),
.numpy() and .cpu() of a tensor (patched on torch.Tensor: on a CPU tensor they dispatch no copy a mode could see).
On a GPU each of these is a device-to-host copy that waits for the queue; on this CPU-only machine every tensor is a
host tensor, so the count also includes reads of host-side tensors (an upper bound of the GPU's count), which is why
the loops count on the host what lives on the host (e.g. SFT's trained targets).

The window: from the first call of nanotrain.training.forward_backward (the first step's micro-steps) to the first
call of nanotrain.checkpoint.save_checkpoint (with --save_every=-1 the save at the end, the first thing a loop does
after reading its last step), so the start-up, the evaluations and samples at the end, and the final save are not
counted. Reads per step = reads in the window / steps.
"""

import contextlib
import runpy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nanotrain.checkpoint
import nanotrain.training


class HostReads(TorchDispatchMode):
    """The count of host reads (`count`) while `active`; a context manager (enters the mode and the patches)."""

    def __init__(self):
        super().__init__()
        self.count, self.active, self.started, self.where = 0, False, False, []

    def _seen(self):  # the mode is entered only for the window: outside it, torch runs without Python dispatch
        if self.active:
            self.count += 1
            self.where.append("".join(__import__("traceback").format_stack(limit=6)[:-2]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self._seen()
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def patched(self):
        """The mode, the Tensor methods and the window's two markers, restored on exit."""
        saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

        def counting(real):
            def method(t, *args, **kwargs):
                self._seen()
                return real(t, *args, **kwargs)
            return method

        real_fb, real_save = nanotrain.training.forward_backward, nanotrain.checkpoint.save_checkpoint

        def forward_backward(*args, **kwargs):
            if not self.started:
                self.active = self.started = True
                self.__enter__()
            return real_fb(*args, **kwargs)

        def save_checkpoint(*args, **kwargs):
            if self.active:
                self.active = False
                self.__exit__(None, None, None)
            return real_save(*args, **kwargs)

        try:
            for name, real in saved.items():
                setattr(torch.Tensor, name, counting(real))
            nanotrain.training.forward_backward = forward_backward
            nanotrain.checkpoint.save_checkpoint = save_checkpoint
            yield self
        finally:
            if self.active:  # the run ended inside the window (an error)
                self.active = False
                self.__exit__(None, None, None)
            for name, real in saved.items():
                setattr(torch.Tensor, name, real)
            nanotrain.training.forward_backward = real_fb
            nanotrain.checkpoint.save_checkpoint = real_save


def count_script(script, args):
    """Runs `script` (a path) with `args` in this process under HostReads. Returns (reads in the window, the
    places they were made: a list of stack excerpts). SystemExit 0 is a normal end; another status raises it."""
    reads = HostReads()
    argv = sys.argv
    sys.argv = [script, *args]
    try:
        with reads.patched():
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as e:
                if e.code not in (0, None):
                    raise
    finally:
        sys.argv = argv
    return reads.count, reads.where


if __name__ == "__main__":
    steps = next((int(a.split("=")[1]) for a in sys.argv[2:] if a.startswith("--num_iterations=")), None)
    n, where = count_script(sys.argv[1], sys.argv[2:])
    print(f"host reads: {n} in the window" + (f", {n / steps:.2f} per step over {steps} steps" if steps else ""),
          file=sys.stderr)
