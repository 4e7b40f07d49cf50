"""
Sliding-window attention (GPTConfig.window_pattern / short_window, nanotrain/attention.py): a layer with window W lets
the query at position i attend to the keys i-W..i (W + 1 keys; FlashAttention's window_size=(W, 0), nanochat's
convention). Checked against a plain softmax over a boolean mask built here with loops, for every backend that runs
on the CPU (flex_attention forward only: torch has no CPU backward for it; SDPA with an explicit mask, forward and
backward), at windows shorter than, equal to and longer than T; a probe token outside a row's window changes nothing;
the KV cache (uniform and per-row, the Engine's) and packed rows give the full forward's logits; the model compiles
with fullgraph=True, no graph break and no recompile on the second call, on both backends. The HF export's windows:
tests/test_hf_export.py; the FLOPs: tests/test_flops.py; exact resume: tests/test_resume.py.
"""

import math
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from nanotrain import attention as attn
from nanotrain.attention import KVCache, attention, attention_windows, default_short_window, windowed_attention
from nanotrain.engine import Engine
from nanotrain.errors import UserError
from nanotrain.gpt import GPT, GPTConfig, config_from_depth

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny ops run fastest on one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def allowed(Tq, Tk, window, q0=0):
    """bool (Tq, Tk) built cell by cell: query t (at position q0 + t) may see key s iff s <= q0 + t and, with a
    window, q0 + t - s <= window."""
    out = torch.zeros(Tq, Tk, dtype=torch.bool)
    for t in range(Tq):
        for s in range(Tk):
            out[t, s] = s <= q0 + t and (window is None or q0 + t - s <= window)
    return out


def reference(q, k, v, mask):
    """Plain softmax attention, (B, H, T, D) layout, kv heads repeated for GQA, mask bool (Tq, Tk) or (B, 1, Tq, Tk)."""
    rep = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def qkv(B=2, H=4, Hkv=2, T=24, D=16, seed=0, grad=False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=g).requires_grad_(grad) for h in (H, Hkv, Hkv)]


def flex_quiet(fn, *args, **kwargs):
    """Runs fn with flex_attention's 'called without torch.compile' warning (the CPU's unfused path) silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return fn(*args, **kwargs)


@pytest.mark.parametrize("window", [3, 22, 23, 24, 40])
def test_windowed_attention_equals_a_plain_softmax_over_the_window(window):
    """
    T = 24, GQA (4 query heads, 2 kv heads): flex_attention with the block mask (forward, no grad) and SDPA with the
    explicit mask (forward and the gradients of q, k, v) equal the reference to 1e-5, for a window shorter than T,
    T - 2, T - 1 (every key: plain causal) and past T; attention() (the model's entry, (B, T, H, D) layout, the CPU's
    automatic backend) too. Catches a window of W keys instead of W + 1 (off by one: fails at every window < T - 1),
    a mask_mod or mask that forgets causality (keys after i), the window measured from the wrong side, and GQA heads
    paired in the wrong order.
    """
    q, k, v = qkv(grad=True)
    mask = allowed(24, 24, window)
    ref = reference(q, k, v, mask)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    got = flex_quiet(windowed_attention, q.detach(), k.detach(), v.detach(), window, backend="flex")
    assert (got - ref).abs().max().item() < 1e-5
    got = windowed_attention(q, k, v, window, backend="sdpa")
    assert (got - ref).abs().max().item() < 1e-5
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), ref_grads):
        assert (a - b).abs().max().item() < 1e-5
    got = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, window=window).transpose(1, 2)
    assert (got - ref).abs().max().item() < 1e-5
    wrong = reference(q, k, v, allowed(24, 24, window - 1))  # W keys: only the same when the window covers all
    assert ((wrong - ref).abs().max().item() > 1e-3) == (window - 1 < 23)
    with pytest.raises(ValueError, match="backend"):
        windowed_attention(q, k, v, window, backend="flash")


def probe_changes(run, j, tensor):
    """Whether adding 1 to `tensor` (..., T, D) at position j (in place, then restored) changes the output of run()
    (B, H, Tq, D): bool (B, Tq)."""
    saved = tensor[..., j, :].clone()
    before = run()
    tensor[..., j, :] += 1.0
    after = run()
    tensor[..., j, :] = saved
    return (after - before).abs().amax(dim=(1, 3)) > 1e-6


def test_a_probe_outside_the_window_changes_nothing():
    """
    A probe: changing the keys and values at one position j changes query i's output iff i - W <= j <= i, for the
    no-cache path on both CPU backends (every query of T = 20, W = 5), a one-token decode on a uniform KVCache
    (query at position 19; the cache keeps all 19 earlier tokens, the window masks), and a per-row cache (rows of 12
    and 19 tokens decoding together: a row also never sees its stale slots past its length). Catches a decode path
    that attends the whole cache, a per-row mask that ignores the window, and a window that leaks one key.
    """
    T, W = 20, 5
    q, k, v = qkv(T=T)
    kv = torch.cat([k, v], dim=1)  # one tensor to perturb (its two halves are k and v)

    def run(backend):
        return lambda: flex_quiet(windowed_attention, q, kv[:, :2], kv[:, 2:], W, backend=backend)
    for backend in ("flex", "sdpa"):
        for j in range(T):
            seen = probe_changes(run(backend), j, kv)  # (B, T)
            want = torch.tensor([i - W <= j <= i for i in range(T)])
            assert torch.equal(seen, want.expand(2, T)), (backend, j)

    # a uniform cache holding positions 0..18 of layer 0, then one decode token at position 19
    cache = KVCache(2, 2, 16, 1, T, "cpu", torch.float32)
    with torch.no_grad():
        attention(q[:, :, :T - 1].transpose(1, 2), k[:, :, :T - 1].transpose(1, 2), v[:, :, :T - 1].transpose(1, 2),
                  0, cache, window=W)

    def decode():
        cache.pos = T - 1
        return attention(q[:, :, -1:].transpose(1, 2), k[:, :, -1:].transpose(1, 2), v[:, :, -1:].transpose(1, 2),
                         0, cache, window=W).transpose(1, 2)
    for j in range(T - 1):
        seen = probe_changes(decode, j, cache.k_cache[0]) | probe_changes(decode, j, cache.v_cache[0])
        assert seen.all().item() == (j >= T - 1 - W) and seen.any().item() == (j >= T - 1 - W), j

    # a per-row cache: row 0 holds 12 tokens, row 1 19; one token each at positions 12 and 19
    cache = KVCache(2, 2, 16, 1, T, "cpu", torch.float32)
    cache.k_cache.normal_()
    cache.v_cache.normal_()
    lengths = torch.tensor([12, 19])

    def decode_rows():
        cache.lengths, cache.pos = lengths.clone(), 19
        return attention(q[:, :, -1:].transpose(1, 2), k[:, :, -1:].transpose(1, 2), v[:, :, -1:].transpose(1, 2),
                         0, cache, cache.segments(1), window=W).transpose(1, 2)
    for j in range(T):
        if j in (12, 19):  # the decode writes its own token there
            continue
        seen = probe_changes(decode_rows, j, cache.v_cache[0])[:, 0]
        want = torch.tensor([12 - W <= j < 12, 19 - W <= j < 19])
        assert torch.equal(seen, want), j


def windowed_model(pattern="SSSL", short_window=5, seed=0, n_layer=4, **options):
    """A GPT (depth 4, vocab 64, GQA 4/2 heads, model_dim 32) with every weight random: attention matters."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(max_seq_len=32, vocab_size=64, n_layer=n_layer, n_head=4, n_kv_head=2, model_dim=32,
                          window_pattern=pattern, short_window=short_window, **options))
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.4)
    return model.eval()


def test_the_layout_of_the_windows_and_their_config():
    """
    SSSL tiles over the layers with the last always full; the default short window is a quarter of max_seq_len
    rounded up to 128 (512 at 2048, 128 at 256, as nanochat); the config keeps the resolved short_window, so a
    checkpoint's config rebuilt with another max_seq_len (mid_train, chat_sft) keeps its window; a bad pattern or
    window is one UserError naming the field. Catches the last layer left windowed, the pattern not tiled (SSSL read
    as four layers only), and a window re-derived from the new max_seq_len.
    """
    c = config_from_depth(6, 100, 2048, window_pattern="SSSL")
    assert attention_windows(c) == [512, 512, 512, None, 512, None]
    assert attention_windows(config_from_depth(3, 100, 256, window_pattern="S")) == [128, 128, None]
    assert attention_windows(config_from_depth(3, 100, 256)) == [None] * 3  # the default: full everywhere
    assert [default_short_window(n) for n in (64, 256, 1024, 2048, 4096)] == [128, 128, 256, 512, 1024]
    assert GPTConfig(**dict(vars(c), max_seq_len=512)).short_window == 512
    for bad in ({"window_pattern": "SXL"}, {"window_pattern": ""}, {"short_window": 0}):
        with pytest.raises(UserError, match=next(iter(bad))):
            GPT(GPTConfig(max_seq_len=16, vocab_size=16, n_layer=2, n_head=1, n_kv_head=1, model_dim=8, **bad))


@torch.no_grad()
def test_kv_cache_generation_equals_the_full_forward():
    """
    A depth-4 SSSL model (window 5, smear on) over 30 tokens: the logits of a prefill of 7 then steps of 1, 1, 11 and 10
    tokens through a uniform KVCache equal the full forward's (1e-5); Engine.generate (mixed prompt lengths: a
    per-row cache) and GPT.generate give the greedy tokens of a loop that re-runs the full forward each step. The
    full model differs (the window matters here). Catches a decode that attends past the window (its logits move by
    > 1e-3), a chunk at pos > 0 masked without the window, and a per-row mask without it.
    """
    model = windowed_model(smear=True)
    idx = torch.randint(0, 64, (2, 30), generator=torch.Generator().manual_seed(1))
    full = model(idx)
    cache = KVCache(2, 2, 8, 4, 30, "cpu", torch.float32)
    steps = [model(idx[:, lo:hi], kv_cache=cache) for lo, hi in [(0, 7), (7, 8), (8, 9), (9, 20), (20, 30)]]
    assert (torch.cat(steps, dim=1) - full).abs().max().item() < 1e-5
    no_window = GPT(GPTConfig(**dict(vars(model.config), window_pattern="L")))
    no_window.load_state_dict(model.state_dict())
    assert (no_window.eval()(idx) - full).abs().max().item() > 1e-3

    class Tok:  # stop tokens outside the vocabulary: every row runs its 14 tokens
        def encode_special(self, name):
            return 1000

        def get_bos_token_id(self):
            return 1001

    def greedy_no_cache(prompt, n):
        seq = list(prompt)
        for _ in range(n):
            seq.append(model(torch.tensor([seq]))[0, -1].argmax().item())
        return seq[len(prompt):]

    prompts = [[(5 * i + 3 * j) % 60 for j in range(n)] for i, n in enumerate([3, 9, 9, 14])]
    want = [greedy_no_cache(p, 14) for p in prompts]
    assert Engine(model, Tok()).generate(prompts, max_tokens=14) == want
    assert list(Engine(model, Tok()).generate_stream(prompts[3], 14)) == want[3]
    assert Engine(no_window, Tok()).generate(prompts, max_tokens=14) != want


@torch.no_grad()
def test_packed_rows_are_document_causal_and_windowed():
    """
    Two documents of 13 and 19 tokens packed in one row (doc_ids) through a depth-4 SSSL model (window 5) give each
    document's own logits (1e-5). Catches a packed mask without the window (the longer document then sees too far
    back) and a window without the document mask (the second document sees the first's tail).
    """
    model = windowed_model()
    idx = torch.randint(0, 64, (1, 32), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.tensor([[0] * 13 + [1] * 19])
    got = model(idx, doc_ids=doc_ids)
    want = torch.cat([model(idx[:, :13]), model(idx[:, 13:])], dim=1)
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_compiles_with_fullgraph_without_recompiles(backend, monkeypatch):
    """
    torch.compile(model, fullgraph=True) of a depth-2 SL model (window 5, T = 24) traces without a graph break (a
    break raises under fullgraph) and runs a second call without recompiling (one graph), on the CPU's SDPA mask
    (forward + backward) and on the flex_attention path the CUDA step takes (forced here with use_flex; forward
    only, no grad, as torch has no CPU backward for flex). backend="eager": dynamo's tracing is what is checked.
    Logits equal the uncompiled model's. Catches a mask cache read while tracing (a guarded global: a recompile on
    the second call, when the cache has filled) and a data-dependent branch that breaks the graph.
    """
    import torch._dynamo
    from torch._dynamo.utils import counters
    model = windowed_model("SL", n_layer=2)
    idx = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    if backend == "flex":
        monkeypatch.setattr(attn, "use_flex", lambda q: True)
        with torch.no_grad():
            want = flex_quiet(model, idx)  # (eager flex runs through a compiled wrapper of its own: counted before)
            counters.clear()
            for _ in range(2):
                got = flex_quiet(compiled, idx)
    else:
        model.train()
        want = model(idx)
        counters.clear()
        for _ in range(2):
            got = compiled(idx)
            got.float().square().mean().backward()
    assert (got - want).abs().max().item() < 1e-5
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch._dynamo.reset()


def test_the_masks_are_built_once_per_shape():
    """Two calls of windowed_attention with one (T, window) reuse the cached mask object, another T builds its own;
    under fake tensors nothing is cached (a fake tensor must never reach a real forward). Catches a mask rebuilt
    at every layer of every step, and a fake mask served to real tensors."""
    attn._CACHE.clear()
    q, k, v = qkv(T=24)
    windowed_attention(q, k, v, 5, backend="sdpa")
    first = dict(attn._CACHE)
    windowed_attention(q, k, v, 5, backend="sdpa")
    assert len(attn._CACHE) == 1 and all(attn._CACHE[key] is first[key] for key in first)
    mode = FakeTensorMode()
    fq, fk, fv = (mode.from_tensor(t[:, :, :20]) for t in (q, k, v))
    with mode:
        windowed_attention(fq, fk, fv, 5, backend="sdpa")
    assert len(attn._CACHE) == 1
    windowed_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], 5, backend="sdpa")
    assert len(attn._CACHE) == 2
    assert not any(is_fake(m) for m in attn._CACHE.values())
