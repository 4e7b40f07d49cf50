"""
The precision policy of the training step on CPU: bf16 autocast lowers the matmuls only; parameters, gradients and
the optimizer state of AdamW and Muon stay fp32, and the loss is computed from fp32 logits. The guard test shows why
it matters: many small updates must change most parameter elements, which a model stored in bf16 cannot do
(bf16 keeps 8 mantissa bits, so an update below 2**-8 of a weight rounds away).
"""

import pytest
import torch
import torch.nn.functional as F

from nanotrain.gpt import GPT, SOFTCAP, GPTConfig
from nanotrain.optim import setup_optimizers
from nanotrain.training import forward_backward, micro_batches, optimizer_step, precision

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
CONFIG = GPTConfig(max_seq_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, model_dim=32)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (2 OpenMP threads on a busy 2-core machine were 70x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny_model(seed=0):
    """A tiny GPT whose zero-initialised c_proj and 0.001-std lm_head get N(0, 0.05) weights, so that every element's
    update is small relative to its weight (a zero weight moves in bf16 too, which would blur the guard)."""
    torch.manual_seed(seed)
    model = GPT(CONFIG)
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "c_proj" in name or "lm_head" in name:
                p.normal_(0, 0.05)
    return model


def batch(step, rows=8):
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(0, CONFIG.vocab_size, (rows, CONFIG.max_seq_len + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def non_fp32_state(model, optimizers):
    """Names of the parameters, gradients and optimizer-state tensors that are not fp32 (floating point only)."""
    names = {id(p): n for n, p in model.named_parameters()}
    bad = [f"param {n}" for n, p in model.named_parameters() if p.dtype != torch.float32]
    bad += [f"grad {n}" for n, p in model.named_parameters() if p.grad is not None and p.grad.dtype != torch.float32]
    for opt in optimizers:
        for p, state in opt.state.items():
            for key, t in state.items():
                if torch.is_tensor(t) and t.is_floating_point() and t.dtype != torch.float32:
                    bad.append(f"{type(opt).__name__} {key} of {names[id(p)]}")
    return bad


def one_bf16_step(model, device=CPU):
    """One training step as base_train runs it with --dtype=bfloat16 (accumulation 2) on `device`. Returns
    (optimizers, dtypes seen: the c_q matmul output under autocast, the gradients right before the update)."""
    model.to(device)
    optimizers = setup_optimizers(model)
    compute_dtype, ctx = precision("bfloat16", device)
    assert compute_dtype == torch.bfloat16
    seen = {}

    def record(module, inputs, out):
        seen.setdefault("matmul", out.dtype)
    hook = model.blocks[0].attn.c_q.register_forward_hook(record)
    x, y = batch(0)
    forward_backward(model, micro_batches(x.to(device), y.to(device), 4), ctx)
    hook.remove()
    seen["grads"] = {p.grad.dtype for p in model.parameters()}
    optimizer_step(model, optimizers, 1.0, 0.95, 1.0)
    return optimizers, seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_bf16_autocast_keeps_fp32_master_state(device):
    """
    After a step under bf16 autocast (the matmuls really run in bf16, checked with a hook) every parameter, gradient
    and AdamW/Muon state tensor (exp_avg, exp_avg_sq, momentum_buffer) is fp32, on CPU and (gpu tier) on CUDA, where
    AdamW is fused and Muon orthogonalises in bf16. Wrong variant exercised: a model cast to bf16
    (`model.to(torch.bfloat16)`, "pure bf16" training) trains too, but fails the same check.
    """
    device = torch.device(device)
    model = tiny_model()
    optimizers, seen = one_bf16_step(model, device)
    assert seen["matmul"] == torch.bfloat16, "autocast did not lower the matmuls: the test would prove nothing"
    assert seen["grads"] == {torch.float32}
    kinds = {(type(o).__name__, k) for o in optimizers for s in o.state.values() for k in s}
    assert {("AdamW", "exp_avg"), ("AdamW", "exp_avg_sq"), ("Muon", "momentum_buffer")} <= kinds
    assert non_fp32_state(model, optimizers) == []
    # counter-example: pure bf16 (parameters, and so gradients and optimizer state, stored in bf16)
    bad_model = tiny_model().to(torch.bfloat16)
    bad_opts, bad_seen = one_bf16_step(bad_model, device)
    bad = non_fp32_state(bad_model, bad_opts)
    assert bad_seen["grads"] == {torch.bfloat16}
    assert any(b.startswith("param") for b in bad) and any(b.startswith("AdamW") for b in bad)
    assert any(b.startswith("Muon") for b in bad)


def test_loss_is_cross_entropy_of_fp32_logits_under_autocast():
    """
    Under bf16 autocast the loss is fp32 and equals the cross-entropy of the fp32 soft-capped logits computed from the
    lm_head output (1e-6 relative: a few fp32 ulps, the chunked loss sums in another order). Wrong variant exercised: soft-capping the bf16 lm_head output without the upcast (CPU
    autocast still returns an fp32 cross-entropy, so only the value can tell) is off by more than 1e-4.
    """
    model = tiny_model()
    _, ctx = precision("bfloat16", CPU)
    x, y = batch(1)
    with torch.no_grad():  # logits of a trained model's size (std ~6), where the soft-cap's precision matters
        model.lm_head.weight.normal_(0, 1.0)
    captured = {}

    def record(module, inputs, out):
        captured.setdefault("head", out)
    hook = model.lm_head.register_forward_hook(record)
    with ctx:
        loss = model(x, y)
        logits = model(x)
    hook.remove()
    head = captured["head"]
    assert head.dtype == torch.bfloat16 and loss.dtype == torch.float32 and logits.dtype == torch.float32
    ref = F.cross_entropy((SOFTCAP * torch.tanh(head.float() / SOFTCAP)).view(-1, CONFIG.vocab_size), y.view(-1))
    assert abs(loss.item() - ref.item()) < 1e-6 * ref.item()
    with ctx:  # the wrong variant: soft-cap computed in bf16
        wrong = F.cross_entropy((SOFTCAP * torch.tanh(head / SOFTCAP)).view(-1, CONFIG.vocab_size), y.view(-1))
    assert abs(wrong.item() - ref.item()) > 1e-4


def changed_fraction(param_dtype, steps=100, lr=1e-5):
    """Fraction of parameter elements that differ from their initial value after `steps` steps at lr for every group
    (AdamW for wte/lm_head, Muon for the blocks), with bf16 autocast and parameters stored in param_dtype."""
    model = tiny_model().to(param_dtype)
    optimizers = setup_optimizers(model, matrix_lr=lr, embedding_lr=lr, unembedding_lr=lr)
    before = [p.detach().clone() for p in model.parameters()]
    _, ctx = precision("bfloat16", CPU)
    for step in range(steps):
        x, y = batch(step)
        forward_backward(model, micro_batches(x, y, 8), ctx)
        optimizer_step(model, optimizers, 1.0, 0.95, 1.0)
    changed = sum((p.detach() != b).sum().item() for p, b in zip(model.parameters(), before))
    return changed / sum(p.numel() for p in model.parameters())


def test_many_small_updates_change_most_parameters():
    """
    Guard against bf16 master weights: 100 steps at lr 1e-5 under bf16 autocast
    change >= 90% of the parameter elements when the parameters are fp32. Wrong variant exercised: the same run with
    the parameters stored in bf16 loses almost every update to rounding and changes < 20% (measured ~2.4%).
    """
    good = changed_fraction(torch.float32)
    bad = changed_fraction(torch.bfloat16)
    assert good >= 0.90, good
    assert bad < 0.20, bad


def saved_bytes(fn, *inputs):
    """Bytes of the distinct storages autograd saves for backward while fn(*inputs) runs (each storage once)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    return out, sum(storages.values())


def test_norm_of_bf16_saves_bf16_and_equals_rms_norm():
    """
    norm() of a bf16 tensor gives F.rms_norm's values bit for bit and its gradient to bf16 rounding (both compute in
    fp32 and round once; the two backward formulas round differently), while its backward keeps only x itself
    (bf16) and one fp32 1/rms per row. The wrong variant, F.rms_norm itself, keeps an fp32 copy of x (2 bytes more
    per element), which is what this test measures it by.
    """
    from nanotrain.kernels import norm
    x = (torch.randn(64, 4, 128) * 3).to(torch.bfloat16).requires_grad_()
    g = torch.randn(64, 4, 128).to(torch.bfloat16)
    y, got = saved_bytes(norm, x)
    ref, wrong = saved_bytes(lambda t: F.rms_norm(t, (128,)), x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, ref)
    gx, gref = torch.autograd.grad(y, x, g)[0].float(), torch.autograd.grad(ref, x, g)[0].float()
    assert ((gx - gref).norm() / gref.norm()).item() < 4e-3  # bf16 keeps 8 significant bits: 2^-8 ~ 3.9e-3
    assert got == x.numel() * 2 + 64 * 4 * 4
    assert wrong >= got + x.numel() * 2


def test_block_saves_32_bytes_per_token_and_dim_under_bf16_autocast():
    """
    What a block must keep for backward under bf16 autocast, counted by hand in bytes per token per model_dim: the
    fp32 residual before attention and before the MLP (4 + 4); the normed input of c_q/c_k/c_v and of c_fc in bf16
    (2 + 2); the rotated q and k that the QK norm differentiates (2 + 2); q, k, v and the attention output in bf16
    (2 + 2 + 2 + 2); the MLP's ReLU output (4 x model_dim wide, bf16: 8), whose square c_proj's weight gradient
    recomputes: 32 in all, plus autocast's bf16 copies of the weights (subtracted) and per-row 1/rms, attention
    log-sum-exp and the rotary tables (under 1 here). Catches keeping the square as well (40), autocast casting the
    normed input once per projection (three bf16 copies: +4) and a QK norm that keeps fp32 copies of q and k (+4;
    all three together, 48, were what the block kept before this was measured).
    """
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=128, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, model_dim=128))
    model.init_weights()
    x = torch.randn(8, 128, 128, requires_grad=True)
    cos_sin = model.cos[:, :128], model.sin[:, :128]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, nbytes = saved_bytes(model.blocks[0], x, cos_sin)
    weight_copies = 2 * sum(p.numel() for p in model.blocks[0].parameters())
    per = (nbytes - weight_copies) / (8 * 128 * 128)
    assert 32 <= per < 33, per


@pytest.mark.parametrize("amp", [False, True])
def test_mlp_equals_eager_relu_square_and_linear(amp):
    """
    The MLP's c_proj(relu(h)^2), whose backward recomputes the square, gives eager autograd's output and gradients
    (of h and of c_proj's fp32 weight) bit for bit, in fp32 and under bf16 autocast: the same ops on the same
    values, only one saved tensor fewer. Catches a gradient without the factor 2 of the square, one that lets
    negative h through (no ReLU mask), and a weight gradient left in bf16 or taken from relu(h) instead of its square.
    """
    from nanotrain.gpt import MLP
    torch.manual_seed(0)
    mlp = MLP(CONFIG)
    with torch.no_grad():
        mlp.c_proj.weight.normal_(0, 0.1)
    x = torch.randn(2, 16, CONFIG.model_dim, requires_grad=True)
    g = torch.randn(2, 16, CONFIG.model_dim)
    params = [x, mlp.c_fc.weight, mlp.c_proj.weight]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        got = mlp(x)
        ref = mlp.c_proj(F.relu(mlp.c_fc(x)).square())
    assert got.dtype == ref.dtype == (torch.bfloat16 if amp else torch.float32) and torch.equal(got, ref)
    for a, b in zip(torch.autograd.grad(got, params, g), torch.autograd.grad(ref, params, g)):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)
