"""
The lr multiplier and Muon momentum schedules (nanotrain/training.py) as literal tables, worked out by hand for a few
steps. Written against the current signatures lr_multiplier(step, total_steps, warmup_ratio, warmdown_ratio,
final_lr_frac) and muon_momentum(step, *, warmup_steps, start, end, total_steps, warmdown_ratio, final): update the calls
here if they change.
"""

import pytest

from nanotrain.training import lr_multiplier, muon_momentum

pytestmark = pytest.mark.unit


def test_lr_multiplier_trapezoid_table():
    """
    10 steps, warmup 0.2 (2 steps), warmdown 0.5 (5 steps), final 0.1: 0.5, 1.0 (warmup ends at 1.0 on its last
    step), 1.0 through step 5, then down by 0.18 per step to 0.1 at step 10. Catches a warmup starting at 0 (step
    0 gets no update), a warmdown that starts a step early or late, a decay to 0 instead of final_lr_frac, and
    ratios truncated instead of rounded.
    """
    want = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.82, 0.64, 0.46, 0.28, 0.1]
    got = [lr_multiplier(k, 10, 0.2, 0.5, 0.1) for k in range(11)]
    assert got == pytest.approx(want, abs=1e-12)


def test_lr_multiplier_nanochat_defaults_table():
    """
    nanochat's defaults (no warmup, warmdown 0.2, final 0) on 10 steps: 1.0 through step 8, 0.5 at step 9, 0 at
    step 10; on 7 steps round(1.4) = 1 warmdown step, and warmup 0.3 of 7 = round(2.1) = 2 steps: 0.5, 1.0, ....
    Catches ceil instead of round and a warmdown counted from total_steps - 1.
    """
    assert [lr_multiplier(k, 10) for k in range(11)] == pytest.approx([1.0] * 9 + [0.5, 0.0], abs=1e-12)
    assert [lr_multiplier(k, 7, 0.3, 0.2) for k in range(8)] == pytest.approx([0.5, 1.0, 1, 1, 1, 1, 1, 0.0])
    assert [lr_multiplier(k, 4, 0.0, 0.0) for k in range(5)] == [1.0] * 5  # no warmdown: constant, no division


def test_muon_momentum_table():
    """
    Linear 0.85 -> 0.95 over warmup_steps, then flat: with 4 steps 0.85, 0.875, 0.9, 0.925, 0.95, 0.95; with the
    default 300, 0.85 + 0.1 * k / 300. Catches a ramp over the wrong number of steps, a ramp that overshoots 0.95
    after the warmup, or start and end swapped.
    """
    assert [muon_momentum(k, warmup_steps=4) for k in range(6)] == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95], abs=1e-12)
    assert [muon_momentum(k) for k in (0, 1, 150, 299, 300, 301, 10_000)] == pytest.approx(
        [0.85, 0.8503333333333334, 0.9, 0.9496666666666667, 0.95, 0.95, 0.95], abs=1e-12)
    assert muon_momentum(1, warmup_steps=2, start=0.5, end=0.7) == pytest.approx(0.6, abs=1e-12)


def test_muon_momentum_warmdown_table():
    """
    nanochat 2026's shape on 10 steps: warmup 2 steps 0.85 -> 0.97 (0.85, 0.91), 0.97 until the lr warmdown starts
    (round(0.5 * 10) = 5 steps: from step 5), then down by 0.014 a step towards 0.90 (0.956, 0.942, 0.928, 0.914) and
    0.90 at step 10, where the lr reaches final_lr_frac. With no warmup the first steps are at `end`; with final None
    the warmdown leaves the momentum alone. Catches a decay that starts a step early or late (against
    lr_multiplier's warmdown), one that ends at `end`, one towards `start`, and a warmup of 0 steps dividing by zero.
    """
    got = [muon_momentum(k, warmup_steps=2, start=0.85, end=0.97, total_steps=10, warmdown_ratio=0.5,
                         final=0.90) for k in range(11)]
    want = [0.85, 0.91, 0.97, 0.97, 0.97, 0.97, 0.956, 0.942, 0.928, 0.914, 0.90]
    assert got == pytest.approx(want, abs=1e-12)
    assert [muon_momentum(k, warmup_steps=0, start=0.85, end=0.95, total_steps=4, warmdown_ratio=0.5, final=0.5) for k in range(5)] == pytest.approx(
        [0.95, 0.95, 0.95, 0.725, 0.5], abs=1e-12)
    assert [muon_momentum(k, warmup_steps=0, start=0.85, end=0.95, total_steps=4, warmdown_ratio=0.5) for k in range(5)] == [0.95] * 5
    # `final` without the run's length or warmdown: no warmdown (the defaults total_steps 0, warmdown_ratio 0), so
    # `end` at every step after the warmup; catches either default changed (1.0: a decay over the whole run)
    assert [muon_momentum(k, warmup_steps=0, final=0.5, total_steps=4) for k in range(5)] == [0.95] * 5
    assert muon_momentum(350, final=0.5, warmdown_ratio=1.0) == 0.95


def test_default_muon_weight_decay_table():
    """
    The default Muon weight decay by width, worked by hand: 0.4 at model_dim 128, 256 and 512 (capped), then
    0.4 * (512 / d)^2: 0.4 * 4/9 = 0.177778 at 768, 0.4 * 0.16 = 0.064 at 1280, 0.4 / 9 = 0.044444 at 1536.
    Catches the uncapped square (1.6 at 256, 6.4 at 128), a linear instead of squared shrink (0.16 at 1280) and a cap
    at the wrong width.
    """
    from nanotrain.training import muon_weight_decay_for
    table = {128: 0.4, 256: 0.4, 512: 0.4, 768: 0.177778, 1280: 0.064, 1536: 0.044444}
    for model_dim, want in table.items():
        assert muon_weight_decay_for(model_dim) == pytest.approx(want, abs=1e-6), model_dim
