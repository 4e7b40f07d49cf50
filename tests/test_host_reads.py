"""
One device-to-host read per optimizer step in the three training loops (base_train, mid_train, chat_sft), counted
in this process on a tiny model with tests/count_host_reads.py (its docstring says what counts as a read), and the
NaN guard without a read: a non-finite gradient norm leaves the weights and the optimizer state of the step before,
and the run stops with check_finite's message when the loop reads the norm.
"""

import contextlib
import os
import pathlib

import pytest
import torch
from count_host_reads import count_script
from helpers import REPO, TINY_TRAIN
from test_chat_train import MID, SFT

import nanotrain.report.card
import nanotrain.training

pytestmark = pytest.mark.unit
STEPS = 10


def script(name):
    return os.path.join(REPO, "scripts", name)


@contextlib.contextmanager
def lean_runs():
    """One torch thread (as the smoke tests' scripts run) and no report card (its plots cost seconds, after the
    training), restored afterwards."""
    threads, card = torch.get_num_threads(), nanotrain.report.card.write_section_or_warn
    torch.set_num_threads(1)
    nanotrain.report.card.write_section_or_warn = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        nanotrain.report.card.write_section_or_warn = card


@pytest.fixture(scope="module")
def counted(shared_base_dir, tmp_path_factory):
    """base_train, then mid_train from it, then chat_sft from that, STEPS steps each, counted. Returns
    {script: (reads, where)}."""
    base = tmp_path_factory.mktemp("host_reads")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    old = os.environ.get("NANOTRAIN_BASE_DIR")
    os.environ["NANOTRAIN_BASE_DIR"] = str(base)
    quiet = ["--eval_every=-1", "--save_every=-1", "--sample_every=-1", f"--num_iterations={STEPS}", "--run_name=r"]
    try:
        with lean_runs():
            out = {"base_train.py": count_script(script("base_train.py"), [*TINY_TRAIN, *quiet, "--eval_tokens=256"])}
            out["mid_train.py"] = count_script(script("mid_train.py"), [*MID, *quiet, "--eval_tokens=128"])
            out["chat_sft.py"] = count_script(script("chat_sft.py"), [*SFT, *quiet, "--source_run_name=r",
                                                                      "--eval_examples=4"])
    finally:
        if old is None:
            os.environ.pop("NANOTRAIN_BASE_DIR", None)
        else:
            os.environ["NANOTRAIN_BASE_DIR"] = old
    return out


@pytest.mark.parametrize("name", ["base_train.py", "mid_train.py", "chat_sft.py"])
def test_one_host_read_per_step(counted, name):
    """
    Over STEPS optimizer steps each loop reads the device at most once per step (the loss, gradient norm and stop
    flag together), none in the micro-steps, the optimizer, the schedule, clipping or the loader. Catches any
    .item()/float()/bool()/.tolist()/.cpu() of a device tensor added to the step (today's loop before this change
    made 7 (base_train, mid_train) and 9.4 (chat_sft) per step: the loss, the gradient norm twice, SFT's target count per
    micro-batch).
    """
    reads, where = counted[name]
    assert reads <= STEPS, f"{reads} host reads in {STEPS} steps; the first at:\n" + "".join(where[:3])


def test_nan_gradient_leaves_the_step_before_and_stops(base_dir, monkeypatch, capsys):
    """
    base_train with a NaN written into one gradient at step 3 (0-based) of 6: the run stops with check_finite's
    message naming step 3 (exit status 2), and the weights and every optimizer state tensor (AdamW's step counts,
    moments, Muon's momentum buffers) are bit for bit those after step 2, though the NaN step's update was queued
    without a host read. Catches an update applied with the NaN (NaN weights), a step counter or momentum advanced
    on the skipped step (0 * NaN masked too late), and a run that goes on past the NaN.
    """
    real = nanotrain.training.optimizer_step
    seen = {}

    def optimizer_step(model, optimizers, *args, **kwargs):
        n = seen["calls"] = seen.get("calls", 0) + 1
        if n == 4:  # step 3: keep the state of step 2, then poison one gradient
            seen["model"], seen["optimizers"] = model, optimizers
            seen["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
            seen["state"] = [[v.clone() for s in opt.state.values() for v in s.values()] for opt in optimizers]
            next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        return real(model, optimizers, *args, **kwargs)

    monkeypatch.setattr(nanotrain.training, "optimizer_step", optimizer_step)
    with pytest.raises(SystemExit) as exit_info, lean_runs():
        count_script(script("base_train.py"), [*TINY_TRAIN, "--num_iterations=6", "--run_name=nan"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "non-finite gradient norm nan at step 3" in err, err[-2000:]
    assert seen["calls"] == 4  # stopped when step 3's norm was read, before step 4's update
    model = seen["model"]
    assert all(torch.equal(v, seen["weights"][k]) for k, v in model.state_dict().items())
    now = [[v for s in opt.state.values() for v in s.values()] for opt in seen["optimizers"]]
    assert all(torch.equal(a, b) for was, new in zip(seen["state"], now) for a, b in zip(was, new, strict=True))
    assert pathlib.Path(base_dir, "base", "nan").is_dir()
