"""Tests for nanotrain/muon.py (and setup_optimizers of nanotrain/optim.py) on CPU in fp32."""

import copy
import math

import pytest
import torch

from nanotrain.gpt import GPT, GPTConfig
from nanotrain.muon import Muon, normalize_variance, zeropower_via_newtonschulz5
from nanotrain.optim import setup_optimizers

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("shape", [(64, 32), (32, 64)])
def test_newtonschulz_orthogonalises(shape):
    """
    The quintic NS map with (3.4445, -4.7750, 2.0315) is tuned for speed, not exact convergence: singular values
    end in a band around 1 (about 0.68..1.2), so we check [0.5, 1.5] rather than 1. The result must also keep G's
    singular vectors (U^T X V diagonal). Catches wrong coefficients (divergence or no orthogonalisation), a missing
    normalisation (blow-up) and a transpose bug (wrong shape or mixed-up singular vectors).
    """
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    X = zeropower_via_newtonschulz5(G, dtype=torch.float32)  # the default is per CPU (ns_dtype_for)
    assert X.shape == G.shape and X.dtype == torch.float32
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    sv = torch.linalg.svdvals(X)
    assert sv.min() > 0.5 and sv.max() < 1.5
    D = U.T @ X @ Vh.T  # should be diagonal with the new singular values
    off = D - torch.diag(torch.diagonal(D))
    assert off.abs().max() < 1e-3
    # scale invariance (only the direction of G matters)
    torch.testing.assert_close(zeropower_via_newtonschulz5(1000 * G, dtype=torch.float32), X, atol=1e-4, rtol=1e-4)
    assert zeropower_via_newtonschulz5(G, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_update_rule_and_shape_scale():
    """
    Two Muon steps from p = 0 with diagonal gradients, worked by hand (lr 0.1, fp32): on a diagonal matrix Newton-
    Schulz acts on each normalised entry alone (x <- a x + b x^3 + c x^5, 5 times; tests/test_oracles.py has the
    sequence for (0.6, 0.8): 0.722876, 1.119204). Step 1, momentum 0.9, g = diag(3, 4): buffer 0.1 g, look-ahead
    0.19 g, so NS sees (0.6, 0.8). Step 2, momentum set to 0.8 in the group, g = diag(4, 3): buffer
    0.8 (0.3, 0.4) + 0.2 (4, 3) = (1.04, 0.92), look-ahead 0.2 (4, 3) + 0.8 (1.04, 0.92) = (1.632, 1.336), normalised
    (0.773788, 0.633444), whose 5 steps by hand are
        0.773788 -> 1.016579 -> 0.690731 -> 1.125021 -> 0.737145 -> 1.068623
        0.633444 -> 1.175420 -> 0.852338 -> 0.893020 -> 0.829177 -> 0.930191
    A tall 3 x 2 parameter steps sqrt(3/2) times as far as a wide 2 x 3 one: tall p = -0.1 * 1.224745 * (0.722876,
    1.119204) = (-0.088534, -0.137074), then minus 0.1 * 1.224745 * (1.068623, 0.930191) = (-0.219413, -0.250999);
    wide (-0.072288, -0.111920), then (-0.179150, -0.204939). Catches an SGD-style buffer (buf = m buf + g: NS would
    see (0.753, 0.658) at step 2 and give (1.047, 1.086)), a momentum cached at construction, a missing or inverted
    aspect-ratio scale.
    """
    tall, wide = torch.nn.Parameter(torch.zeros(3, 2)), torch.nn.Parameter(torch.zeros(2, 3))
    opt = Muon([tall, wide], lr=0.1, momentum=0.9, ns_dtype="float32")
    want = {1: ((-0.088534, -0.137074), (-0.072288, -0.111920)), 2: ((-0.219413, -0.250999), (-0.179150, -0.204939))}
    for step, m, (g1, g2) in ((1, 0.9, (3.0, 4.0)), (2, 0.8, (4.0, 3.0))):
        opt.param_groups[0]["momentum"] = m
        tall.grad = torch.tensor([[g1, 0.0], [0.0, g2], [0.0, 0.0]])
        wide.grad = tall.grad.T.contiguous()
        opt.step()
        (t1, t2), (w1, w2) = want[step]
        torch.testing.assert_close(tall.detach(), torch.tensor([[t1, 0.0], [0.0, t2], [0.0, 0.0]]), atol=2e-6, rtol=0)
        torch.testing.assert_close(wide.detach(), torch.tensor([[w1, 0.0, 0.0], [0.0, w2, 0.0]]), atol=2e-6, rtol=0)


def test_lr_zero_and_none_grad():
    """Catches an lr that is ignored, and params without a gradient being updated (or crashing the step)."""
    p, q = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4, 8))
    p0, q0 = p.detach().clone(), q.detach().clone()
    opt = Muon([p, q], lr=0.0)
    p.grad = torch.randn(8, 4)
    opt.step()
    assert torch.equal(p.detach(), p0) and torch.equal(q.detach(), q0)
    opt.param_groups[0]["lr"] = 0.02
    opt.step()
    assert not torch.equal(p.detach(), p0) and torch.equal(q.detach(), q0)
    assert "momentum_buffer" not in opt.state[q]
    with pytest.raises(ValueError):
        Muon([torch.nn.Parameter(torch.randn(4))])


def test_state_dict_round_trip():
    """Resuming from state_dict must continue identically; catches momentum buffers that are not saved/restored."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(16, 8, generator=gen) for _ in range(6)]
    p = torch.nn.Parameter(torch.randn(16, 8, generator=gen))
    opt = Muon([p], lr=0.05)
    for g in grads[:3]:
        p.grad = g.clone()
        opt.step()
    saved_p, saved_state = p.detach().clone(), copy.deepcopy(opt.state_dict())
    for g in grads[3:]:
        p.grad = g.clone()
        opt.step()
    q = torch.nn.Parameter(saved_p.clone())
    opt2 = Muon([q], lr=0.05)
    opt2.load_state_dict(saved_state)
    for g in grads[3:]:
        q.grad = g.clone()
        opt2.step()
    assert torch.equal(p.detach(), q.detach())


def test_tiny_model_trains():
    """AdamW + Muon from setup_optimizers must overfit a fixed batch: catches sign errors, a dead optimizer for the
    block matrices (zero-init projections only move through Muon), or a broken LR scaling."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, model_dim=64, n_head=2, n_kv_head=2, max_seq_len=32))
    model.init_weights()
    optimizers = setup_optimizers(model)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 256, (4, 32), generator=gen)
    targets = torch.randint(0, 256, (4, 32), generator=gen)
    losses = []
    for _ in range(30):
        loss = model(idx, targets)
        loss.backward()
        for opt in optimizers:
            opt.step()
        model.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert any(b.attn.c_proj.weight.abs().sum() > 0 for b in model.blocks)


@pytest.mark.unit
def test_ns_dtype_is_measured_per_cpu_and_pinnable(monkeypatch):
    """
    Muon's Newton-Schulz dtype: "" picks bf16 on a CPU only where bf16 matmuls measure >= 2x fp32, else fp32; an
    explicit ns_dtype wins; the choice is made on real tensors even when first asked inside FakeTensorMode (a memory
    probe of nanotrain.auto_batch_size). Wrong variants caught: a fixed choice that ignores the measurement (both
    outcomes are forced here through the measurement), or a measurement of fake tensors (its result would not be
    the real one).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    import nanotrain.common as hardware
    import nanotrain.muon as muon

    monkeypatch.setattr(hardware, "cpu_flags", lambda: None)  # a CPU that lists no flags: measured
    for bf16_speed, expected in ((4.5, torch.bfloat16), (1.5, torch.float32), (0.25, torch.float32)):
        monkeypatch.setattr(hardware, "_FAST_BF16", {})
        monkeypatch.setattr(hardware, "measure_matmul_flops",
                            lambda dtype, n, s, f=bf16_speed: 1e11 * (f if dtype == torch.bfloat16 else 1.0))
        assert muon.ns_dtype_for(torch.device("cpu")) == expected
    monkeypatch.undo()
    monkeypatch.setattr(hardware, "_FAST_BF16", {})
    monkeypatch.setattr(hardware, "cpu_flags", lambda: None)
    seen = []
    real = hardware.measure_matmul_flops

    def spy(dtype, n, s):
        seen.append(type(torch.empty(1)))
        return real(dtype, n, s)
    monkeypatch.setattr(hardware, "measure_matmul_flops", spy)
    with FakeTensorMode():
        muon.ns_dtype_for(torch.device("cpu"))
    assert seen and all(t is torch.Tensor for t in seen)

    g, w = torch.randn(8, 16), torch.randn(8, 16)
    results, reached = {}, []
    real_ns = muon.zeropower_via_newtonschulz5

    def ns_spy(G, steps=5, dtype=None, polar_express=False):
        reached.append(dtype)
        return real_ns(G, steps, dtype, polar_express)
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        q = torch.nn.Parameter(w.clone())
        q.grad = g.clone()
        opt = Muon([q], lr=0.1, momentum=0.95, ns_dtype=name)
        opt.fns["zeropower"] = ns_spy
        opt.step()
        assert reached[-1] == dtype and q.dtype == torch.float32
        results[name] = q.detach()
    assert not torch.equal(results["float32"], results["bfloat16"])  # the setting reaches the computation
    with pytest.raises(ValueError, match="ns_dtype"):
        Muon([torch.nn.Parameter(w.clone())], ns_dtype="float16")


def test_load_state_dict_keeps_the_runs_ns_dtype():
    """
    ns_dtype is a run setting, not optimizer state: loading a state saved with another ns_dtype (or before the
    setting existed) keeps this optimizer's, while the momentum buffers do load. Catches the plain
    Optimizer.load_state_dict, which would restore the saved group's ns_dtype over the --ns_dtype flag (or drop it).
    """
    w = torch.nn.Parameter(torch.randn(8, 16))
    w.grad = torch.randn(8, 16)
    saved = Muon([w], ns_dtype="bfloat16")
    saved.step()
    state = copy.deepcopy(saved.state_dict())
    fresh = Muon([torch.nn.Parameter(w.detach().clone())], ns_dtype="float32")
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["ns_dtype"] == "float32"
    assert torch.equal(next(iter(fresh.state.values()))["momentum_buffer"], saved.state[w]["momentum_buffer"])
    del state["param_groups"][0]["ns_dtype"]  # a state saved before the setting existed
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["ns_dtype"] == "float32"


@pytest.mark.unit
def test_polar_express_narrows_the_singular_values():
    """
    Five Polar Express steps (Amsel et al. 2025) take every singular value of a Gaussian 64 x 128, 128 x 64 and
    48 x 96 matrix into [0.8, 1.2]; the fixed quintic leaves the smallest at ~0.68 after the same five steps. Catches the fixed coefficients used under the Polar Express name, the triples applied in reverse order
    and the tall orientation not transposed.
    """
    torch.manual_seed(0)
    for shape in [(64, 128), (128, 64), (48, 96)]:
        G = torch.randn(*shape)
        s = torch.linalg.svdvals(zeropower_via_newtonschulz5(G, dtype=torch.float32, polar_express=True))
        assert 0.8 <= s.min() and s.max() <= 1.2, (shape, s.min(), s.max())
        plain = torch.linalg.svdvals(zeropower_via_newtonschulz5(G, dtype=torch.float32))
        assert plain.min() < 0.75


@pytest.mark.unit
def test_normalize_variance_evens_out_the_rows_and_keeps_the_norm():
    """
    NorMuon on a tall 3 x 2 update [[3, 4], [1, 0], [0, 2]] (||u||_F^2 = 30), first step: the second moment is
    (1 - beta2) * the rows' mean squares, so every row is scaled to the same norm, sqrt(30 / 3) = sqrt(10), in its own
    direction: the rows become sqrt(10) * [0.6, 0.8], [1, 0], [0, 1]. A wide 2 x 3 update is evened out by columns.
    Catches statistics taken along the shorter side, a result not rescaled to the update's norm, and an EMA that
    starts from the first value instead of zero (same here: the rescale cancels it; checked on the second step).
    """
    u = torch.tensor([[3.0, 4.0], [1.0, 0.0], [0.0, 2.0]])
    state = {}
    out = normalize_variance(u, state, beta2=0.9)
    r = math.sqrt(10)
    torch.testing.assert_close(out, torch.tensor([[0.6 * r, 0.8 * r], [r, 0.0], [0.0, r]]))
    assert state["second_moment"].shape == (3, 1)
    torch.testing.assert_close(state["second_moment"], 0.1 * torch.tensor([[12.5], [0.5], [2.0]]))
    out_t = normalize_variance(u.T.contiguous(), {}, beta2=0.9)  # wide: per column
    torch.testing.assert_close(out_t, out.T)
    # second step with a different update: the EMA mixes 0.9 of the old statistic with 0.1 of the new one
    normalize_variance(torch.ones(3, 2), state, beta2=0.9)
    torch.testing.assert_close(state["second_moment"], 0.9 * 0.1 * torch.tensor([[12.5], [0.5], [2.0]]) + 0.1)


@pytest.mark.unit
def test_cautious_weight_decay_decays_only_where_the_update_agrees():
    """
    One Muon step with weight decay against the same step without: entries where the update u and the parameter p
    have opposite signs are bit-identical, the others are smaller in magnitude by exactly lr * wd * |p| (u is read
    back from the step without decay). Catches plain (non-cautious) decay, a mask with the sign flipped, and decay
    that ignores the lr.
    """
    torch.manual_seed(0)
    p0, g = torch.randn(8, 16), torch.randn(8, 16)
    after = {}
    for wd in (0.0, 0.5):
        p = torch.nn.Parameter(p0.clone())
        p.grad = g.clone()
        Muon([p], lr=0.1, momentum=0.0, nesterov=False, ns_dtype="float32", weight_decay=wd).step()
        after[wd] = p.detach()
    u = (p0 - after[0.0]) / 0.1  # the step's update (rows <= cols: no shape factor)
    agree = u * p0 > 0
    assert 0 < agree.sum() < agree.numel()
    assert torch.equal(after[0.5][~agree], after[0.0][~agree])
    torch.testing.assert_close(after[0.5][agree], after[0.0][agree] - 0.1 * 0.5 * p0[agree])


def test_defaults_are_plain_muon():
    """
    The documented defaults: Muon(params) is plain Muon (lr 0.02, momentum 0.95, Nesterov, 5 steps of the fixed
    quintic, dtype chosen per device, no NorMuon, no weight decay), and zeropower_via_newtonschulz5(u) is 5 steps of
    the fixed quintic. Catches a default that turns an option on (Polar Express, decay) or changes the lr or the step
    count.
    """
    opt = Muon([torch.nn.Parameter(torch.randn(4, 8))])
    assert opt.defaults == dict(lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="", polar_express=False,
                                beta2=0.0, weight_decay=0.0)
    G = torch.randn(12, 8, generator=torch.Generator().manual_seed(0))
    plain = zeropower_via_newtonschulz5(G, 5, torch.float32, polar_express=False)
    assert torch.equal(zeropower_via_newtonschulz5(G, dtype=torch.float32), plain)
    assert not torch.equal(zeropower_via_newtonschulz5(G, 4, torch.float32), plain)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(lr=-0.01), "lr=-0.01"), (dict(momentum=1.0), "momentum=1.0"), (dict(momentum=1.5), "momentum=1.5"),
    (dict(momentum=-0.1), "momentum=-0.1"), (dict(weight_decay=-1.0), "weight_decay=-1.0"),
    (dict(beta2=1.0), "beta2=1.0"), (dict(beta2=1.5), "beta2=1.5"), (dict(beta2=-0.5), "beta2=-0.5"),
])
def test_each_bad_setting_alone_is_refused_by_name(kwargs, fragment):
    """
    Each out-of-range setting, with every other one valid, raises ValueError naming it; the bounds momentum = 1 and
    beta2 = 1 are refused (an EMA with factor 1 never moves). Catches checks joined with `and` instead of `or` (a
    bad value passes when the others are fine), `<=` for `<` at the bounds, and a message without the values.
    """
    with pytest.raises(ValueError, match=fragment.replace(".", r"\.")):
        Muon([torch.nn.Parameter(torch.randn(4, 8))], **kwargs)
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(3, 4, 5))])


def test_a_polar_express_step_narrows_the_update():
    """
    One Muon step with polar_express=True from p = 0 (momentum 0, no Nesterov, lr 1) sets p = -update: its singular
    values lie in Polar Express's band [0.8, 1.2], where the same step without it leaves the smallest below 0.75.
    Catches the setting not reaching the orthogonalisation (dropped by the optimizer or by orthogonalize).
    """
    G = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    bands = {}
    for pe in (True, False):
        p = torch.nn.Parameter(torch.zeros(64, 128))
        p.grad = G.clone()
        Muon([p], lr=1.0, momentum=0.0, nesterov=False, ns_dtype="float32", polar_express=pe).step()
        s = torch.linalg.svdvals(-p.detach())
        bands[pe] = (s.min().item(), s.max().item())
    assert 0.8 <= bands[True][0] and bands[True][1] <= 1.2, bands
    assert bands[False][0] < 0.75, bands


def test_normalize_variance_square_dtype_and_a_large_statistic():
    """
    NorMuon on a square 2 x 2 update evens out its rows (the longer-or-equal side: one statistic per row); a bf16
    update comes back in bf16; and when the stored second moment is large (the normalised update's norm is below 1)
    the result still has the update's own norm. [[3, 4], [0, 1]]: rows scaled to the same norm sqrt(26 / 2) = sqrt(13)
    in their own directions: sqrt(13) * [0.6, 0.8] and [0, sqrt(13)]. Catches statistics per column for square
    matrices (`>` for `>=`), a result left in fp32, and a rescale whose denominator is clamped at 1 instead of ~0.
    """
    u = torch.tensor([[3.0, 4.0], [0.0, 1.0]])
    r = math.sqrt(13)
    torch.testing.assert_close(normalize_variance(u, {}, beta2=0.5), torch.tensor([[0.6 * r, 0.8 * r], [0.0, r]]))
    assert normalize_variance(u.bfloat16(), {}, beta2=0.5).dtype == torch.bfloat16
    state = {"second_moment": torch.full((2, 1), 1e4)}
    small = 0.01 * u  # ||small||_F = 0.051; divided by ~sqrt(1e4) its norm is ~5e-4
    out = normalize_variance(small, state, beta2=0.99)
    torch.testing.assert_close(out.norm(), small.norm())


def test_ns_dtype_for_other_devices_and_the_2x_bar(monkeypatch):
    """
    ns_dtype_for: CUDA runs bf16 (no measurement, no GPU needed to ask), other non-CPU devices fp32; on CPU the bar is
    bf16 >= 2x fp32 inclusive: exactly 2x and 2.9x pick bf16, 1.99x fp32. Catches a mistyped device name, a
    missing dtype, `>` for `>=` and a 3x bar.
    """
    import nanotrain.common as hardware
    import nanotrain.muon as muon

    monkeypatch.setattr(hardware, "_FAST_BF16", {})
    assert muon.ns_dtype_for("cuda") == torch.bfloat16 and muon.ns_dtype_for(torch.device("cuda", 1)) == torch.bfloat16
    assert muon.ns_dtype_for("meta") == torch.float32
    monkeypatch.setattr(hardware, "cpu_flags", lambda: None)
    for speed, expected in ((2.0, torch.bfloat16), (2.9, torch.bfloat16), (1.99, torch.float32)):
        monkeypatch.setattr(hardware, "_FAST_BF16", {})
        monkeypatch.setattr(hardware, "measure_matmul_flops",
                            lambda dtype, n, s, f=speed: 1e11 * (f if dtype == torch.bfloat16 else 1.0))
        assert muon.ns_dtype_for("cpu") == expected, speed


def test_ns_dtype_for_reads_the_cpu_flags_without_timing(monkeypatch):
    """
    Where the CPU lists its flags the choice is theirs, with no timing: avx512_bf16 or amx_bf16 -> bf16 (even when a
    timing under load would have measured bf16 as slow: the measurement is made to raise), neither (avx512f alone,
    or no flags) -> fp32 (even where a timing would have measured it fast). Catches the flags ignored (the timing
    decides), the flag names misspelled, and either flag alone not counting.
    """
    import nanotrain.common as hardware
    import nanotrain.muon as muon

    def timing(*args):
        raise AssertionError("timed although the CPU lists its flags")
    monkeypatch.setattr(hardware, "measure_matmul_flops", timing)
    for flags, expected in (({"fpu", "avx512f", "avx512_bf16"}, torch.bfloat16), ({"amx_bf16", "amx_tile"}, torch.bfloat16),
                            ({"fpu", "avx512f", "avx512_vnni"}, torch.float32), (set(), torch.float32)):
        monkeypatch.setattr(hardware, "_FAST_BF16", {})
        monkeypatch.setattr(hardware, "cpu_flags", lambda f=flags: f)
        assert muon.ns_dtype_for("cpu") == expected, flags


def test_muon_on_a_dtensor_equals_the_plain_step(one_rank_mesh, monkeypatch):
    """
    Muon on DTensor parameters sharded on dim 0 (FSDP2's layout; one rank here) gives the plain step's parameters and
    momentum buffers bit for bit, for a tall and a wide matrix, with NorMuon, cautious weight decay and Polar Express
    on and off; the buffers stay DTensors with the parameters' placements, the second moments plain tensors; the
    ranks' CPU dtype agreement (ns_dtype_for under a process group) names a valid device. Catches the DTensor path
    computing on DTensors (a second moment that is a DTensor), the update not written into the local shard (the
    parameter unchanged) and an option dropped on that path.
    """
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import nanotrain.common as hardware
    import nanotrain.muon as muon

    gen = torch.Generator().manual_seed(0)
    for pe in (False, True):
        ws = [torch.randn(12, 8, generator=gen), torch.randn(8, 12, generator=gen)]
        gs = [torch.randn_like(w) for w in ws]
        kw = dict(lr=0.1, ns_dtype="float32", polar_express=pe, beta2=0.9, weight_decay=0.5)
        plain = [torch.nn.Parameter(w.clone()) for w in ws]
        sharded = [torch.nn.Parameter(distribute_tensor(w.clone(), one_rank_mesh, [Shard(0)])) for w in ws]
        opts = Muon(plain, **kw), Muon(sharded, **kw)
        for _ in range(2):
            for p, q, g in zip(plain, sharded, gs):
                p.grad, q.grad = g.clone(), distribute_tensor(g.clone(), one_rank_mesh, [Shard(0)])
            for opt in opts:
                opt.step()
        for p, q, w in zip(plain, sharded, ws):
            assert not torch.equal(p.detach(), w)
            assert isinstance(q, DTensor) and torch.equal(q.full_tensor(), p.detach()), pe
            buf = opts[1].state[q]["momentum_buffer"]
            assert isinstance(buf, DTensor) and buf.placements == (Shard(0),)
            assert torch.equal(buf.full_tensor(), opts[0].state[p]["momentum_buffer"])
            assert type(opts[1].state[q]["second_moment"]) is torch.Tensor
    monkeypatch.setattr(hardware, "_FAST_BF16", {})
    assert muon.ns_dtype_for("cpu") in (torch.float32, torch.bfloat16)  # the collective ran on a real device
