"""Tests of nanotrain.checkpoint: atomic layout, round trip, corrupt checkpoints, retention, no pickle."""

import json
import os
import pickle
import random

import pytest
import torch

from nanotrain.checkpoint import list_checkpoints, load_latest, save_checkpoint
from nanotrain.common import rng_state, set_rng_state
from nanotrain.gpt import GPT, GPTConfig

pytestmark = pytest.mark.unit


def setup():
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, model_dim=32))
    model.init_weights()
    opts = model.setup_optimizers()
    model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))).backward()
    for o in opts:
        o.step()
    return model, opts


def test_round_trip_and_layout(tmp_path):
    model, opts = setup()
    state = {"rng": rng_state("cpu"), "loader": {"epoch": 1, "doc_index": 7, "offset": 3}}
    path = save_checkpoint(str(tmp_path), 5, model, opts, {"config": {"depth": 1}}, state)
    assert sorted(os.listdir(path)) == ["meta.json", "model.pt", "optim.pt", "rank_00000.pt"]
    assert not [p for p in os.listdir(tmp_path / "checkpoints") if p.endswith(".tmp")]
    ck = load_latest(str(tmp_path), "cpu")
    assert ck["meta"]["step"] == 5 and ck["meta"]["config"] == {"depth": 1} and "git_commit" in ck["meta"]
    assert all(torch.equal(a, b) for a, b in zip(ck["model"].values(), model.state_dict().values()))
    assert ck["rank_state"]["loader"] == {"epoch": 1, "doc_index": 7, "offset": 3}
    model2, opts2 = setup()
    for o, s in zip(opts2, ck["optim"]):
        o.load_state_dict(s)
    assert opts2[0].state_dict()["state"].keys() == opts[0].state_dict()["state"].keys()


def test_rng_state_round_trip():
    """Restoring the saved RNG states reproduces the same random numbers (Python and torch)."""
    s = rng_state("cpu")
    a = (random.random(), torch.rand(3))
    set_rng_state(s, "cpu")
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_partial_and_corrupt_checkpoints_are_skipped(tmp_path):
    """A directory without meta.json (interrupted save) is not listed; a corrupt model.pt falls back with a warning."""
    model, opts = setup()
    save_checkpoint(str(tmp_path), 1, model, opts, {}, {})
    save_checkpoint(str(tmp_path), 2, model, opts, {}, {})
    os.makedirs(tmp_path / "checkpoints" / "step_000003.tmp")  # an interrupted save
    os.makedirs(tmp_path / "checkpoints" / "step_000004")  # no meta.json: incomplete
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["step_000001", "step_000002"]
    with open(tmp_path / "checkpoints" / "step_000002" / "model.pt", "wb") as f:
        f.write(b"garbage")
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint"):
        ck = load_latest(str(tmp_path), "cpu")
    assert ck["meta"]["step"] == 1


def test_keep_last(tmp_path):
    model, opts = setup()
    for s in range(1, 6):
        save_checkpoint(str(tmp_path), s, model, opts, {}, {}, keep_last=2)
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["step_000004", "step_000005"]


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    """A model.pt holding a pickled arbitrary object is refused (weights_only=True), so the checkpoint is skipped."""
    model, opts = setup()
    path = save_checkpoint(str(tmp_path), 1, model, opts, {}, {})

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))
    with open(os.path.join(path, "model.pt"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.warns(UserWarning):
        assert load_latest(str(tmp_path), "cpu") is None
    assert not (tmp_path / "pwned").exists()
    assert json.load(open(os.path.join(path, "meta.json")))["step"] == 1


def test_resume_checks_settings_and_world_size(tmp_path, capsys):
    """
    resume_checkpoint finds the newest complete checkpoint (or warns and returns None on an empty run), and
    check_resume refuses a checkpoint whose listed settings or world size differ, naming the flag, while settings
    outside the list may change. Catches a check that compares the wrong dict (this run's settings against
    themselves), ignores the world size, or refuses every change.
    """
    from nanotrain.checkpoint import check_resume, resume_checkpoint
    from nanotrain.common import UserError
    run = str(tmp_path / "run")
    assert resume_checkpoint(run, "cpu") is None and "no complete checkpoint" in capsys.readouterr().out
    model, opts = setup()
    state = {"rng": rng_state("cpu")}
    save_checkpoint(run, 3, model, opts, {"config": {"data": "a", "seq": 16, "lr": 0.1}}, state)
    ckpt = resume_checkpoint(run, "cpu")
    assert ckpt["meta"]["step"] == 3
    check_resume(ckpt, run, {"data": "a", "seq": 16, "lr": 0.5}, ("data", "seq"), 1)  # lr is not checked
    with pytest.raises(UserError, match="has seq=16 but this run has --seq=32"):
        check_resume(ckpt, run, {"data": "a", "seq": 32, "lr": 0.1}, ("data", "seq"), 1)
    with pytest.raises(UserError, match="world_size 1; resume with the same number of processes \\(2\\)"):
        check_resume(ckpt, run, {"data": "a", "seq": 16, "lr": 0.1}, ("data", "seq"), 2)
