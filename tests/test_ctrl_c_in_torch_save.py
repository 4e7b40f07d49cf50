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
