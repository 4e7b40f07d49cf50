"""Tests of nanotrain.training: gradient accumulation in base_train's step, the lr schedule, the metrics log."""

import json
from contextlib import nullcontext

import pytest
import torch

from nanotrain.gpt import GPT, GPTConfig
from nanotrain.training import MetricsLog, forward_backward, lr_multiplier, muon_momentum

pytestmark = pytest.mark.unit


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, model_dim=32))
    model.init_weights()
    with torch.no_grad():  # give the zero-initialised projections some weight so every path matters
        for name, p in model.named_parameters():
            if "c_proj" in name or "lm_head" in name:
                p.normal_(0, 0.05)
    return model


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


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


@pytest.mark.parametrize("total,warmup,warmdown", [(100, 0.0, 0.2), (10, 0.1, 0.5), (7, 0.3, 0.3)])
def test_lr_multiplier_formula(total, warmup, warmdown):
    """The multiplier at optimizer step k follows the trapezoid: warmup, 1.0, then linear decay to final_lr_frac."""
    w, d = round(warmup * total), round(warmdown * total)
    for k in range(total):
        got = lr_multiplier(k, total, warmup, warmdown, 0.1)
        if k < w:
            want = (k + 1) / w
        elif k <= total - d:
            want = 1.0
        else:
            want = (total - k) / d + (1 - (total - k) / d) * 0.1
        assert got == pytest.approx(want)
    assert lr_multiplier(total, total, warmup, warmdown, 0.1) == pytest.approx(0.1 if d else 1.0)


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


class OOMAbove(torch.nn.Module):
    """A simulated device: the wrapped model raises a real torch.OutOfMemoryError for micro-batches above `limit`."""

    def __init__(self, model, limit):
        super().__init__()
        self.model, self.limit, self.calls = model, limit, []

    def forward(self, x, y):
        self.calls.append(x.size(0))
        if x.size(0) > self.limit:
            raise torch.OutOfMemoryError(f"simulated: micro-batch {x.size(0)} > {self.limit}")
        return self.model(x, y)


def test_oom_step_down_keeps_tokens_and_loss():
    """
    An OOM at the discovered size steps down to the next candidate and redoes the step on the same rows: loss and
    gradient equal a run that used the smaller size from the start (1e-6, fp32). Catches a step-down that skips the
    step (other rows), applies a partial gradient twice (grads not zeroed), or keeps grad_accum_steps (fewer tokens).
    """
    from nanotrain.training import forward_backward_or_step_down
    torch.manual_seed(2)
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    ref_model = tiny_model()
    ref_loss = forward_backward(ref_model, x, y, 2, nullcontext())
    model = OOMAbove(tiny_model(), limit=2)
    logs = []
    loss, micro = forward_backward_or_step_down(model, x, y, 8, [1, 2, 4, 8], nullcontext(), log=logs.append)
    assert micro == 2 and model.calls == [8, 4, 2, 2, 2, 2]
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    assert rel(grads(model.model), grads(ref_model)) < 1e-6
    assert "stepping down to 4" in logs[0] and "stepping down to 2" in logs[1]
    # counter-example: without zeroing the gradients of the failed attempt the result differs
    bad = OOMAbove(tiny_model(), limit=4)
    bad.model(x[:4], y[:4]).backward()  # a partial micro-step's gradient left behind
    forward_backward(bad.model, x, y, 4, nullcontext())
    assert rel(grads(bad.model), grads(ref_model)) > 1e-3


def test_oom_at_smallest_candidate_is_a_clear_error():
    from nanotrain.common import UserError
    from nanotrain.training import forward_backward_or_step_down
    model = OOMAbove(tiny_model(), limit=0)
    x = torch.zeros(4, 16, dtype=torch.long)
    with pytest.raises(UserError, match="smallest candidate"):
        forward_backward_or_step_down(model, x, x, 2, [1, 2, 4], nullcontext(), log=lambda *a: None)


def test_step_down_propagates_other_errors():
    from nanotrain.training import forward_backward_or_step_down

    class Broken(torch.nn.Module):
        def forward(self, x, y):
            raise RuntimeError("shape mismatch, not an OOM")
    x = torch.zeros(4, 16, dtype=torch.long)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        forward_backward_or_step_down(Broken(), x, x, 2, [1, 2, 4], nullcontext(), log=lambda *a: None)


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
