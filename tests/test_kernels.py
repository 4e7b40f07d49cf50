"""Tests for nanotrain/kernels.py: the chunked LM head + cross-entropy against torch's naive path, on CPU."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nanotrain import kernels
from nanotrain.gpt import GPT, SOFTCAP, GPTConfig
from nanotrain.kernels import chunk_size_for, linear_cross_entropy

pytestmark = pytest.mark.unit


def naive(hidden, weight, targets, softcap, reduction):
    """The oracle: full logits through nn.functional, differentiated by autograd (what GPT.forward did before)."""
    logits = F.linear(hidden, weight).float()
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits, targets, ignore_index=-1, reduction=reduction)


def inputs(n, vocab, dim, ignored, seed=0, logit_std=8.0):
    """hidden (n, dim), weight (vocab, dim) fp32 leaves giving logits of std ~logit_std (a trained model's range,
    where the soft-cap bends), targets (n,) with every third one ignored if `ignored`."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, dim, generator=g).requires_grad_()
    weight = (torch.randn(vocab, dim, generator=g) * logit_std / math.sqrt(dim)).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=g)
    if ignored:
        targets[::3] = -1
    return hidden, weight, targets


def loss_and_grads(fn, hidden, weight, targets, reduction, grad_out):
    loss = fn(hidden, weight, targets, reduction)
    return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight), grad_out))


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("softcap", [SOFTCAP, None])
@pytest.mark.parametrize("ignored", [False, True])
@pytest.mark.parametrize("n, vocab, chunk", [(48, 96, 16), (37, 101, 8), (50, 77, 64)])
def test_equals_naive_path_fp32(n, vocab, chunk, ignored, softcap, reduction):
    """
    Loss and the gradients of hidden states and head weight equal torch's full-logits path to 1e-5 relative in fp32:
    all targets valid or every third ignored, soft-cap on and off, token counts that are a multiple of the chunk,
    not a multiple (37 rows in chunks of 8), and smaller than one chunk; vocabularies 96, 101 and 77 (the vocab is
    never split, so its size must not matter). The incoming gradient is not 1 (a scaled loss, per-token weights for
    "none"). Catches a chunk boundary that drops or repeats rows, ignored targets that still get a gradient, a wrong
    mean denominator (all rows instead of counted ones) and a backward that ignores the incoming gradient.
    """
    hidden, weight, targets = inputs(n, vocab, 16, ignored)
    grad_out = torch.rand(n) + 0.5 if reduction == "none" else torch.tensor(0.37)
    ref = loss_and_grads(lambda *a: naive(*a[:3], softcap, a[3]), hidden, weight, targets, reduction, grad_out)
    got = loss_and_grads(lambda *a: linear_cross_entropy(*a[:3], softcap, a[3], chunk), hidden, weight, targets,
                         reduction, grad_out)
    for name, a, b in zip(("loss", "d hidden", "d weight"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, name
        assert rel(a, b) < 1e-5, (name, rel(a, b))


def test_dropping_the_softcap_derivative_is_caught(monkeypatch):
    """
    The wrong variant: the gradient through the soft-cap taken as if the cap were the identity (dz/da = 1, the
    plausible omission when the cap is folded into a hand-written backward). Its hidden-state gradient differs from
    the naive path's by far more than the 1e-5 the correct code meets, at logits of a trained model's range (std 8,
    |z| up to ~15 where 1 - (z/15)^2 is small).
    """
    hidden, weight, targets = inputs(48, 96, 16, ignored=True)
    ref = loss_and_grads(lambda *a: naive(*a[:3], SOFTCAP, a[3]), hidden, weight, targets, "mean", torch.tensor(1.0))
    right = loss_and_grads(lambda *a: linear_cross_entropy(*a[:3], SOFTCAP, a[3], 16), hidden, weight, targets, "mean",
                           torch.tensor(1.0))
    real_grads = kernels._chunk_grads
    monkeypatch.setattr(kernels, "_chunk_grads", lambda z, lse, t, s, h, w, cap, gw: real_grads(z, lse, t, s, h, w,
                                                                                                0.0, gw))
    wrong = loss_and_grads(lambda *a: linear_cross_entropy(*a[:3], SOFTCAP, a[3], 16), hidden, weight, targets,
                           "mean", torch.tensor(1.0))
    assert rel(right[1], ref[1]) < 1e-5 and rel(right[2], ref[2]) < 1e-5
    assert rel(wrong[1], ref[1]) > 0.05 and rel(wrong[2], ref[2]) > 0.05
    assert torch.equal(wrong[0], right[0])  # the loss alone cannot tell


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bf16_autocast_within_bf16_rounding(reduction):
    """
    Under CPU bf16 autocast both paths run the head matmuls in bf16 and the rest in fp32. The loss agrees to 1e-5
    relative (both take the fp32 log-softmax of the same bf16 logits; only the fp32 summation order differs) and the
    gradients to 2e-2 relative: the naive path rounds each gradient matmul's result to bf16 once (8 significant
    bits, 2^-9 ~ 0.2% per element) while the chunked one rounds the bf16 logits gradient per chunk and sums the weight
    gradient's chunks in fp32, so they differ by a few bf16 roundings. Catches a loss computed from bf16 log-softmax
    (off by ~1e-3) and a head that ignores autocast (fp32 matmuls: the loss moves by ~1e-3 from the bf16 path's).
    """
    hidden, weight, targets = inputs(64, 96, 32, ignored=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = loss_and_grads(lambda *a: naive(*a[:3], SOFTCAP, a[3]), hidden, weight, targets, reduction,
                             torch.tensor(1.0))
        got = loss_and_grads(lambda *a: linear_cross_entropy(*a[:3], SOFTCAP, a[3], 16), hidden, weight, targets,
                             reduction, torch.tensor(1.0))
    fp32 = naive(hidden, weight, targets, SOFTCAP, reduction).detach()
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    assert rel(got[0], ref[0]) < 1e-5
    assert rel(fp32, ref[0]) > 2e-4  # the bf16 matmul is visible in the loss, so the check above has teeth
    assert rel(got[1], ref[1]) < 2e-2 and rel(got[2], ref[2]) < 2e-2


def test_no_counted_target():
    """Like F.cross_entropy: "mean" over no counted target is NaN, "sum" is 0 with zero (not NaN) gradients.
    Catches a mean that divides by the row count and a gradient scale of 1/0."""
    hidden, weight, targets = inputs(10, 20, 8, ignored=False)
    targets = torch.full_like(targets, -1)
    assert math.isnan(linear_cross_entropy(hidden, weight, targets, SOFTCAP, "mean", 4).item())
    loss = linear_cross_entropy(hidden, weight, targets, SOFTCAP, "sum", 4)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0 and torch.all(gh == 0) and torch.all(gw == 0)


def test_bad_arguments():
    """Catches silently accepting an unknown reduction or mismatched shapes (a (B, T) target with (B*T, d) hidden)."""
    hidden, weight, targets = inputs(8, 20, 8, ignored=False)
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(hidden, weight, targets, reduction="avg")
    with pytest.raises(ValueError, match="targets"):
        linear_cross_entropy(hidden, weight, targets.view(2, 4))
    with pytest.raises(ValueError, match="chunk_size"):
        linear_cross_entropy(hidden, weight, targets, chunk_size=0)


@pytest.mark.parametrize("num_tokens, model_dim, vocab, expected", [
    (16384, 1280, 65536, 512),  # depth 20, B=8, T=2048: 16384 * 1280 / 65536 = 320 -> 512
    (65536, 1280, 65536, 2048),  # B=32: 1280 -> 2048
    (2048, 256, 4096, 256),  # the CPU recipe: 128, raised to the floor of 256
    (100, 64, 512, 100),  # fewer tokens than the floor: one chunk
    (1, 64, 512, 1),
])
def test_chunk_size_for(num_tokens, model_dim, vocab, expected):
    """A literal table of the rule "smallest power of two >= N*d/vocab, at least 256, at most N". Catches a chunk
    that grows with the vocab (the logits memory the head exists to avoid) or ignores the token count."""
    assert chunk_size_for(num_tokens, model_dim, vocab) == expected


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_training_step_never_holds_full_logits():
    """
    A training forward + backward of a GPT with a vocabulary much wider than the model (4096 vs 64) creates no
    tensor of B*T*vocab/4 elements or more: the largest is one chunk's logits (256 tokens x vocab = 1/8 of the full
    logits at B*T = 2048). The naive path (F.cross_entropy over full logits) fails this with a (1024, 4096) tensor,
    and so does a chunked loss whose backward materialises the whole logits gradient.
    """
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, n_layer=1, n_head=1, n_kv_head=1, model_dim=64, max_seq_len=64))
    model.init_weights()
    idx = torch.randint(0, 4096, (32, 64))
    with LargestTensor() as rec:
        model(idx, idx).backward()
    assert rec.largest < 32 * 64 * 4096 // 4, rec.largest
    assert rec.largest >= 256 * 4096  # the chunk's logits are there: the recorder sees the head


def test_gpt_loss_and_gradients_equal_full_logits():
    """
    GPT.forward(idx, targets) (chunked, 3 chunks of 8 tokens with a 4th of 6) gives the loss and every parameter's
    gradient that the cross-entropy of its full soft-capped logits (GPT.forward(idx), the generation path) gives, to
    1e-5 relative in fp32, with padding-like ignored targets. Catches a head that reads another normalisation of the
    hidden states than the logits path, and a soft-cap applied twice or not at all in one of the two.
    """
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=300, n_layer=3, n_head=2, n_kv_head=2, model_dim=64, max_seq_len=16))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # the lambdas: moved off their init
                p.add_(torch.randn_like(p), alpha=0.1)
            elif name != "wte.weight":
                p.normal_(0.0, 2.0 / math.sqrt(p.size(1)))
    model.loss_chunk_size = 8
    idx = torch.randint(0, 300, (2, 15))
    targets = torch.randint(0, 300, (2, 15))
    targets[1, 10:] = -1
    loss = model(idx, targets)
    got = torch.autograd.grad(loss, list(model.parameters()))
    logits = model(idx)
    ref_loss = F.cross_entropy(logits.view(-1, 300), targets.view(-1), ignore_index=-1)
    ref = torch.autograd.grad(ref_loss, list(model.parameters()))
    assert rel(loss, ref_loss) < 1e-6
    for (name, _), a, b in zip(model.named_parameters(), got, ref):
        assert rel(a, b) < 1e-5, name
    last = model(idx, last_only=True)
    assert last.shape == (2, 1, 300) and torch.allclose(last[:, 0], logits[:, -1], rtol=1e-5, atol=1e-6)


def test_softcap_saturates_where_exp_overflows():
    """
    Logits far beyond the cap (|a| up to ~1e4, so exp(2a / c) overflows fp32 to inf on the CPU path) give the
    naive path's loss and gradients: the cap saturates at +-c with zero slope. Fails on the textbook form
    c * (e^(2a/c) - 1) / (e^(2a/c) + 1), which gives inf / inf = NaN there, and on a cap that forgets to divide by c
    inside the exponential (its values leave [-c, c]).
    """
    hidden, weight, targets = inputs(24, 50, 16, ignored=False, logit_std=3000.0)
    a = F.linear(hidden, weight).detach()
    assert a.abs().max() > 45 * SOFTCAP  # exp(2 * 45) overflows fp32 (max ~3.4e38 = e^88.7)
    got = loss_and_grads(lambda h, w, t, r: linear_cross_entropy(h, w, t, softcap=SOFTCAP, reduction=r, chunk_size=8),
                         hidden, weight, targets, "mean", torch.tensor(1.0))
    want = loss_and_grads(lambda h, w, t, r: naive(h, w, t, SOFTCAP, r), hidden, weight, targets, "mean",
                          torch.tensor(1.0))
    for g, w in zip(got, want):
        assert torch.isfinite(g).all()
        assert rel(g, w) < 1e-5
    z = kernels._chunk_logits(hidden.detach(), weight.detach(), SOFTCAP)
    assert z.abs().max() <= SOFTCAP and z.abs().max() > SOFTCAP * (1 - 1e-6)
