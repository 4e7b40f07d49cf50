"""A second Ctrl-C that lands inside torch.save's own file writes (nanotrain/checkpoint.py): still a Ctrl-C."""

import types

import pytest
import torch

import nanotrain.checkpoint as checkpoint
from nanotrain.checkpoint import SAVES, interrupted_line, list_checkpoints, save_checkpoint
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers

pytestmark = pytest.mark.unit


class _CtrlCFile:
    """A real file whose third write raises KeyboardInterrupt, as Python's SIGINT handler does between bytecodes."""

    def __init__(self, path, mode):
        self.f, self.writes = open(path, mode), 0

    def write(self, b):
        self.writes += 1
        if self.writes == 3:
            raise KeyboardInterrupt
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_ctrl_c_inside_torch_save_is_an_interrupt_not_a_full_disk(tmp_path, monkeypatch):
    """
    torch.save catches the KeyboardInterrupt of its write callback and raises a RuntimeError ("unexpected pos") from
    it. The save must end as a Ctrl-C (KeyboardInterrupt: the line says the checkpoint was NOT written and to continue
    from the previous one, which stays listed), its unfinished directory removed. Catches the RuntimeError taken for a
    disk error ("disk full ... free space").
    """
    for k, v in {"writing": None, "written": None, "after_stop": False}.items():
        monkeypatch.setitem(SAVES, k, v)
    monkeypatch.setitem(__import__("sys").modules, "nanotrain.stop", types.SimpleNamespace(requested=False))
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, model_dim=32))
    model.init_weights()
    run_dir, opts = str(tmp_path / "run"), setup_optimizers(model)
    p1 = save_checkpoint(run_dir, 1, model, opts, {"config": {}}, {})
    monkeypatch.setattr(checkpoint, "open", _CtrlCFile, raising=False)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(run_dir, 2, model, opts, {"config": {}}, {})
    line = interrupted_line()
    assert "while step 2's checkpoint was being written: it was NOT written" in line
    assert "previous checkpoint" in line and "free space" not in line
    assert list_checkpoints(run_dir) == [p1]
    assert not any(n.endswith(".tmp") for n in __import__("os").listdir(tmp_path / "run" / "checkpoints"))


CHILD = r"""
import nanotrain.stop  # first, as a training script does: its handlers take SIGINT
import os, signal, sys
import torch, torch.serialization as ser
from nanotrain.checkpoint import save_checkpoint
from nanotrain.common import run_script
from nanotrain.gpt import GPT, GPTConfig

def main():
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, model_dim=32))
    model.init_weights()
    save_checkpoint(sys.argv[1], 1, model, [], {"config": {}}, {})
    os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: stop after this step
    finish = ser._open_zipfile_writer_buffer.__exit__
    def exit_(self, *args):  # the second Ctrl-C, before torch.save writes the archive's end
        os.kill(os.getpid(), signal.SIGINT)
        return finish(self, *args)
    ser._open_zipfile_writer_buffer.__exit__ = exit_
    save_checkpoint(sys.argv[1], 2, model, [], {"config": {}}, {})
    print("the second Ctrl-C did not interrupt the save")

run_script(main, trains=True)
"""


def test_a_second_ctrl_c_as_torch_save_finishes_is_one_line_not_an_abort(tmp_path):
    """
    A training process (nanotrain.stop's handlers, run_script) gets two real SIGINTs: one before a save, one inside
    torch.save's exit, before its zip writer wrote the archive's end. It prints the line (step 2 NOT written), exits
    130, and step 1 stays the only checkpoint. Catches the C++ abort after that line (exit 134, "terminate ... write to
    closed file"): the zip writer's destructor writing the archive's end into the file `with open` had closed.
    """
    import subprocess
    import sys

    from helpers import REPO
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", CHILD, str(run_dir)], capture_output=True, text=True, timeout=120,
                       cwd=REPO, env=dict(__import__("os").environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"))
    assert r.returncode == 130, (r.returncode, r.stderr[-2000:])
    assert "terminate" not in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "while step 2's checkpoint was being written: it was NOT written" in r.stderr.strip().splitlines()[-1]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000001"]
