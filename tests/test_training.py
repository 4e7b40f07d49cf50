"""Tests of nanotrain.training: gradient accumulation in base_train's step, the metrics log (the lr and momentum
schedules as literal tables: tests/test_schedule_oracles.py)."""

import json
from contextlib import nullcontext

import pytest
import torch
from conftest import grads, rel, tiny_model

from nanotrain.training import MetricsLog, forward_backward, muon_momentum

pytestmark = pytest.mark.unit


def test_grad_accumulation_equals_full_batch():
    """
    forward_backward (base_train's step) over 8 rows in micro-batches of 8, 4 and 2 (accumulation 1, 2, 4) gives the
    same gradient within 1e-6 relative in fp32. The wrong variant, accumulating the per-micro-batch mean losses without
    dividing by the number of micro-batches, is exercised too and must be off by the accumulation factor.
    """
    torch.manual_seed(1)
    x = torch.randint(0, 64, (8, 16))
    y = torch.randint(0, 64, (8, 16))
    model = tiny_model()
    loss1 = forward_backward(model, x, y, 8, nullcontext())
    ref = grads(model)
    for micro in (4, 2):
        model.zero_grad(set_to_none=True)
        loss = forward_backward(model, x, y, micro, nullcontext())
        assert rel(grads(model), ref) < 1e-6
        assert abs(loss.item() - loss1.item()) < 1e-6
    # counter-example: no division by the number of micro-batches
    model.zero_grad(set_to_none=True)
    for i in range(4):
        model(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]).backward()
    assert rel(grads(model), ref) > 1.0


def test_forward_backward_rejects_ragged_split():
    model = tiny_model()
    with pytest.raises(ValueError):
        forward_backward(model, torch.zeros(6, 16, dtype=torch.long), torch.zeros(6, 16, dtype=torch.long), 4,
                         nullcontext())


def test_muon_momentum_ramp():
    assert muon_momentum(0) == pytest.approx(0.85)
    assert muon_momentum(150) == pytest.approx(0.90)
    assert muon_momentum(300) == muon_momentum(10_000) == pytest.approx(0.95)


def test_metrics_log_resume_drops_later_rows(tmp_path):
    """A resumed run keeps the rows up to its step and drops the later ones (they are logged again)."""
    log = MetricsLog(str(tmp_path))
    for s in range(1, 6):
        log.log(step=s, loss=float(s), dt=0.1)
    log.close()
    log = MetricsLog(str(tmp_path), resume_step=3)
    log.log(step=4, loss=40.0, dt=0.1)
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    MetricsLog(str(tmp_path)).close()  # a fresh run starts empty
    assert open(tmp_path / "metrics.jsonl").read() == ""


@pytest.mark.unit
def test_metrics_log_resume_keeps_each_evaluation_once(tmp_path):
    """
    Resuming at step k keeps the rows before k and step k's training row, and drops step k's evaluation and every
    later row (the resumed run evaluates at k again), so each evaluation appears once whether the saving run
    evaluated at k (a regular save) or not (a stop request). A torn last line is skipped. Catches: keeping rows
    `<= k` (a duplicate val row after a resume at an eval step) or skipping the eval at k (a missing one).
    """
    rows = [{"step": 0, "val_bpb": 3.0}, {"step": 1, "loss": 5.0, "dt": 0.1}, {"step": 2, "loss": 4.0, "dt": 0.1},
            {"step": 2, "val_bpb": 2.5}, {"step": 3, "loss": 3.0, "dt": 0.1}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    log = MetricsLog(str(tmp_path), resume_step=2)
    log.log(step=2, val_bpb=2.5)  # what the resumed run does first
    log.close()
    got = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert got == rows[:4]


def test_grad_accum_steps_and_the_batch_arithmetic_error():
    """
    grad_accum_steps_for: 4096 tokens of 8 rows x 256 tokens on 1 rank is 2 micro-batches; 4096 over 2 ranks of
    8 x 128 is 2. A total that does not divide is one UserError naming the nearest valid totals and nearby valid
    device batch sizes (worked by hand: 5000 / (3 * 256) -> 4608 or 5376; 4096 / 256 = 16 rows, divisors near 3 are
    2, 4, 1). Catches a division that floors silently (5000 // 768 = 6 steps of the wrong size), a check that forgets
    world_size, and a zero or negative size reaching the division.
    """
    from nanotrain.common import UserError
    from nanotrain.training import grad_accum_steps_for
    assert grad_accum_steps_for(4096, 8, 256, 1) == 2
    assert grad_accum_steps_for(4096, 8, 128, 2) == 2
    with pytest.raises(UserError, match=r"= 8 \* 256 \* 4 = 8192; nearest valid: --total_batch_size=8192, or "):
        grad_accum_steps_for(4096, 8, 256, 4)  # the world size counts: 4 ranks need 8192 tokens per step
    with pytest.raises(UserError) as e:
        grad_accum_steps_for(5000, 3, 256, 1)
    assert "nearest valid: --total_batch_size=4608 or 5376" in str(e.value)
    with pytest.raises(UserError) as e:
        grad_accum_steps_for(4096, 3, 256, 1)
    assert "--device_batch_size in [1, 2, 4] (divisors of 4096 / (256 * 1) = 16)" in str(e.value)
    with pytest.raises(UserError, match="must be positive"):
        grad_accum_steps_for(4096, 0, 256, 1)
