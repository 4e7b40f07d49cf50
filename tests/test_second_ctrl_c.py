"""A second Ctrl-C in a training script says whether the checkpoint of the step in progress was written
(nanotrain.checkpoint.interrupted_line, printed by nanotrain.common.run_script)."""

import types

import pytest
import torch

import nanotrain.checkpoint as checkpoint
from nanotrain.checkpoint import SAVES, interrupted_line, list_checkpoints, save_checkpoint
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers

pytestmark = pytest.mark.unit

CONFIG = GPTConfig(max_seq_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, model_dim=32)


@pytest.fixture
def run(tmp_path, monkeypatch):
    """A tiny model and optimizers; SAVES fresh; nanotrain.stop stood in for by a namespace (importing the real one
    would install its signal handlers in the test process)."""
    for k, v in {"writing": None, "written": None, "after_stop": False}.items():
        monkeypatch.setitem(SAVES, k, v)
    stop = types.SimpleNamespace(requested=False)
    monkeypatch.setitem(__import__("sys").modules, "nanotrain.stop", stop)
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    return str(tmp_path / "run"), model, setup_optimizers(model), stop


def save(run, step, **kw):
    run_dir, model, opts, _ = run
    return save_checkpoint(run_dir, step, model, opts, {"config": {}}, {}, **kw)


def test_each_moment_of_a_second_ctrl_c_gets_its_own_line(run, monkeypatch):
    """
    The line, literally, for: no save yet; a scheduled save then a Ctrl-C mid-step (this step's checkpoint not
    written, the newest named); the stop's own save done (written); a Ctrl-C inside the save's file writes (NOT
    written, and no complete copy on disk); a Ctrl-C after the marker, during the commit's rename (written: the
    complete .tmp copy is what a resume takes). Catches the one fixed line that said "before the step in progress was
    saved" even when the save had completed, and a line that trusts the save's start instead of the disk.
    """
    run_dir, _, _, stop = run
    assert interrupted_line() == ("interrupted by a second Ctrl-C before the checkpoint of the step in progress was "
                                  "written (this run wrote none); run again with --resume=True to continue from the "
                                  "last checkpoint")
    p1 = save(run, 1)
    assert interrupted_line() == (f"interrupted by a second Ctrl-C before the checkpoint of the step in progress was "
                                  f"written (the newest one this run wrote is step 1 ({p1})); run again with "
                                  f"--resume=True to continue from the last checkpoint")
    stop.requested = True
    p2 = save(run, 2)
    assert interrupted_line() == (f"interrupted by a second Ctrl-C after this step's checkpoint was written (step 2: "
                                  f"{p2}); run again with --resume=True to continue from it")

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_save_tensors", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            save(run, 3)
    assert interrupted_line() == ("interrupted by a second Ctrl-C while step 3's checkpoint was being written: it was "
                                  "NOT written (its unfinished files are ignored); run again with --resume=True to "
                                  "continue from the previous checkpoint")
    assert [checkpoint.step_of(p) for p in list_checkpoints(run_dir)] == [1, 2]
    with monkeypatch.context() as m:
        m.setattr(checkpoint, "commit", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            save(run, 4)
    p4 = p2.replace("step_000002", "step_000004")
    assert interrupted_line() == (f"interrupted by a second Ctrl-C once step 4's checkpoint was written ({p4}); run "
                                  f"again with --resume=True to continue from it")
    assert [checkpoint.step_of(p) for p in list_checkpoints(run_dir)] == [1, 2, 4]
