"""Tests for nanotrain/gpt.py on tiny fp32 models on CPU."""

import math

import pytest
import torch
import torch.nn.functional as F

from nanotrain.attention import KVCache
from nanotrain.engine import Engine
from nanotrain.errors import UserError
from nanotrain.gpt import GPT, GPTConfig, config_from_depth
from nanotrain.optim import setup_optimizers

pytestmark = pytest.mark.unit

TINY = dict(vocab_size=256, n_layer=2, model_dim=64, n_head=2, n_kv_head=2, max_seq_len=32)


def make_model(seed=0, randomize=True, **overrides):
    """A tiny initialised model. randomize=True also fills the zero-initialised projections and the (tiny) lm_head
    with random values: at init every c_proj is 0, so attention has no effect and cache or causality bugs would be
    invisible."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **overrides}))
    model.init_weights()
    if randomize:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 1:  # the lambdas: away from their init, so a wrong use of them shows
                    p.add_(torch.randn_like(p), alpha=0.1)
                elif name != "wte.weight":
                    p.normal_(0.0, 1.0 / math.sqrt(p.size(1)))
    return model


def random_idx(B, T, vocab=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g)


def test_config_from_depth():
    """Catches a wrong width/head rule (e.g. head_dim 64 instead of 128, or n_head not dividing model_dim)."""
    c = config_from_depth(20, 65536, 2048)
    assert (c.model_dim, c.n_head, c.n_kv_head, c.n_layer) == (1280, 10, 10, 20)
    assert (config_from_depth(4, 256, 32).model_dim, config_from_depth(4, 256, 32).n_head) == (256, 2)
    assert (config_from_depth(1, 256, 32).model_dim, config_from_depth(1, 256, 32).n_head) == (64, 1)
    c3 = config_from_depth(3, 256, 32)
    assert c3.model_dim == 192 and 192 % c3.n_head == 0
    for depth in range(1, 40):
        c = config_from_depth(depth, 256, 32)
        assert c.model_dim % c.n_head == 0 and (c.model_dim // c.n_head) % 2 == 0
    with pytest.raises(UserError):
        config_from_depth(0, 256, 32)


V1 = dict(value_embeds=False, smear=False, backout=False, x0_lambdas=False)  # nanochat v1's architecture


def test_param_count_depth20_on_meta():
    """With the 2026 options off, matches nanochat v1's table (561.0M = 393.2M blocks + 2 x 83.9M embeddings); catches
    biases, tied embeddings, a wrong MLP width or extra parameters. Built on meta, so it allocates nothing."""
    with torch.device("meta"):
        model = GPT(config_from_depth(20, 65536, 2048, **V1))
    blocks = sum(p.numel() for p in model.blocks.parameters())
    assert blocks == 20 * 12 * 1280**2  # 393.2M
    assert model.wte.weight.numel() == model.lm_head.weight.numel() == 65536 * 1280  # 83.9M each
    assert model.num_params() == 560_988_160
    assert round(model.num_params() / 1e6, 1) == 561.0
    assert f"{model.estimate_flops():.2e}" == "3.49e+09"


def test_param_count_depth20_with_the_options():
    """
    The depth-20 model with every option, counted by hand on top of nanochat v1's 560,988,160: 10 value-embedding tables
    (blocks 1, 3, .., 19) of 65,536 x 1,280; their gates 10 x (12 x 10 heads); resid and x0 lambdas 2 x 20; the smear
    gate 12 and smear_lambda 1; backout_lambda 1. The FLOPs add only the gates' matmuls: 6 x (1,200 + 12). Catches
    value embeddings on every block (or on the wrong half), tables of model_dim on a GQA model, and counting a
    lookup table as matmul FLOPs. num_scaling_params (nanochat's: the blocks and the lm_head) is the literal
    477,103,280: fails on all-but-the-tables (560,989,414), on one that leaves out the gates (477,102,080) or that
    counts the token embedding too (560,989,360).
    """
    with torch.device("meta"):
        model = GPT(config_from_depth(20, 65536, 2048, smear=True, backout=True, x0_lambdas=True))
        default = GPT(config_from_depth(20, 65536, 2048))  # value embeddings only
    assert default.num_params() == 560_988_160 + 10 * 65536 * 1280 + 10 * 12 * 10
    assert sorted(int(k) for k in model.value_embeds) == list(range(1, 20, 2))
    assert model.num_params() == 560_988_160 + 10 * 65536 * 1280 + 10 * 12 * 10 + 2 * 20 + 12 + 1 + 1
    with torch.device("meta"):
        v1 = GPT(config_from_depth(20, 65536, 2048, **V1))
    assert model.estimate_flops() - v1.estimate_flops() == 6 * (1200 + 12)
    # the blocks and the lm_head, counted by hand: 20 x 12 x 1,280^2 matrices + the 1,200 value-embedding gate weights
    # (in the blocks) + the lm_head 65,536 x 1,280 = 393,216,000 + 1,200 + 83,886,080 = 477,103,280
    assert model.num_scaling_params() == 477_103_280


def test_bad_config_raises():
    """Catches silently accepting a model_dim that heads do not divide, or an n_kv_head that does not divide n_head."""
    with pytest.raises(UserError):
        GPT(GPTConfig(**{**TINY, "n_head": 3}))
    with pytest.raises(UserError):
        GPT(GPTConfig(**{**TINY, "n_head": 4, "n_kv_head": 3}))


def test_shapes_dtypes_and_autocast_loss():
    """Catches logits returned in bf16 under autocast (loss must be fp32) and wrong output shapes."""
    model = make_model()
    idx, targets = random_idx(2, 16), random_idx(2, 16, seed=2)
    logits = model(idx)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    assert logits.abs().max() <= 15.0  # soft cap
    loss = model(idx, targets)
    assert loss.shape == () and loss.dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_bf16 = model(idx, targets)
        logits_bf16 = model(idx)
    assert loss_bf16.dtype == torch.float32 and logits_bf16.dtype == torch.float32
    assert abs(loss_bf16.item() - loss.item()) < 0.1
    none = model(idx, targets, loss_reduction="none")
    assert none.shape == (32,) and none.dtype == torch.float32
    assert torch.allclose(none.mean(), loss, atol=1e-6)
    assert torch.allclose(model(idx, targets, loss_reduction="sum"), none.sum(), atol=1e-4)


def test_ignore_index():
    """Targets == -1 are excluded from the mean; a wrong variant averaging over all B*T positions must differ."""
    model = make_model()
    idx, targets = random_idx(2, 16), random_idx(2, 16, seed=2)
    targets[0, :5] = -1
    targets[1, 10:] = -1
    keep = targets.view(-1) != -1
    logits = model(idx).view(-1, 256)
    expected = F.cross_entropy(logits[keep], targets.view(-1)[keep])
    loss = model(idx, targets)
    assert torch.allclose(loss, expected, atol=1e-6)
    wrong = F.cross_entropy(logits[keep], targets.view(-1)[keep], reduction="sum") / targets.numel()
    assert not torch.allclose(loss, wrong, atol=1e-3)
    none = model(idx, targets, loss_reduction="none")
    assert torch.all(none[~keep] == 0)


def test_num_params_and_flops():
    """
    TINY (default options: value embeddings) counted by hand: wte, lm_head and block 1's value embedding 256 x 64
    each; two blocks of 12 x 64^2; block 1's value-embedding gate 12 x 2. FLOPs: 6 x the matmul weights (blocks, gate,
    lm_head) + attention 12 x 2 layers x 2 heads x 32 head_dim x 32 positions. With smear, backout and the lambdas on:
    + 12 (the smear gate) + 1 (smear_lambda) + 1 + 2 + 2 parameters, and the smear gate's matmul 6 x 12 FLOPs. Catches
    a num_params that skips modules, or a FLOPs formula that keeps an embedding table or drops attention.
    """
    model = make_model(randomize=False)
    assert model.num_params() == 3 * 256 * 64 + 2 * 12 * 64**2 + 24 == 147_480
    matmul = 2 * 12 * 64**2 + 24 + 256 * 64
    assert model.estimate_flops() == 6 * matmul + 12 * 2 * 2 * 32 * 32 == 737_424
    every = make_model(randomize=False, smear=True, backout=True, x0_lambdas=True)
    assert every.num_params() == 147_480 + 12 + 1 + 5
    assert every.estimate_flops() == 737_424 + 6 * 12


def test_meta_init_deterministic_and_zero_proj():
    """Catches rotary buffers left uninitialised after to_empty, RNG-dependent init outside torch's generator,
    non-zero output projections and a wrong init scale."""
    config = GPTConfig(**TINY)
    states = []
    for _ in range(2):
        with torch.device("meta"):
            model = GPT(config)
        model.to_empty(device="cpu")
        torch.manual_seed(123)
        model.init_weights()
        states.append(model)
    ref = GPT(config)  # built directly on CPU
    torch.manual_seed(123)
    ref.init_weights()
    for m in states:
        for (n1, p1), (n2, p2) in zip(m.state_dict().items(), ref.state_dict().items()):
            assert n1 == n2 and torch.equal(p1, p2), n1
        assert torch.equal(m.cos, ref.cos) and torch.equal(m.sin, ref.sin)
    assert "cos" not in ref.state_dict() and ref.cos.shape == (1, 320, 1, 16)
    for block in ref.blocks:
        assert torch.all(block.attn.c_proj.weight == 0) and torch.all(block.mlp.c_proj.weight == 0)
        assert block.attn.c_q.weight.abs().max() <= math.sqrt(3 / 64)
    assert 0.9 < ref.wte.weight.std() < 1.1 and 0.0008 < ref.lm_head.weight.std() < 0.0012
    # to_empty alone (no init_weights) must also restore the rotary tables
    with torch.device("meta"):
        m = GPT(config)
    m.to_empty(device="cpu")
    assert torch.equal(m.cos, ref.cos)


def test_causality():
    """Catches non-causal attention (e.g. is_causal forgotten): a future token must not change earlier logits."""
    model = make_model()
    idx = random_idx(1, 20)
    idx2 = idx.clone()
    idx2[0, 12] = (idx[0, 12] + 1) % 256
    a, b = model(idx), model(idx2)
    assert torch.equal(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_kv_cache_matches_full_forward(n_kv_head):
    """Prefill + one token at a time, and a chunked prefill at pos > 0, must reproduce the full forward: catches
    rotary positions not offset by the cache position, a wrong chunk mask, a wrong GQA head mapping, and a cache
    position that advances per layer instead of once."""
    model = make_model(n_kv_head=n_kv_head)
    idx = random_idx(2, 24)
    full = model(idx)
    cache = KVCache(2, n_kv_head, 32, 2, 24, "cpu", torch.float32)
    steps = [model(idx[:, :10], kv_cache=cache)]
    assert cache.pos == 10
    for t in range(10, 16):
        steps.append(model(idx[:, t:t + 1], kv_cache=cache))
    steps.append(model(idx[:, 16:24], kv_cache=cache))  # chunk at pos 16
    assert cache.pos == 24
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        model(idx[:, :1], kv_cache=cache)  # full


def greedy_reference(model, tokens, n):
    ids = list(tokens)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(tokens):]


class NoStopTok:
    """Engine's tokenizer needs: stop tokens outside the vocabulary (these generations run their length)."""

    def encode_special(self, name):
        return 10**6

    def get_bos_token_id(self):
        return 10**6 + 1


def generate(model, prompt, max_tokens, **kw):
    """One prompt through nanotrain.engine.Engine, no stop tokens: list[int] of max_tokens new tokens."""
    return list(Engine(model, NoStopTok()).generate_stream(prompt, max_tokens, ignore_eos=True, **kw))


def test_generate_greedy_matches_full_forward():
    """Greedy generation with the cache must equal argmax over full forwards, also past max_seq_len (32) thanks to
    the 10x rotary table; catches cache and position bugs on the generation path."""
    model = make_model(n_kv_head=1)
    prompt = random_idx(1, 20)[0].tolist()
    out = generate(model, prompt, 20)
    assert out == greedy_reference(model, prompt, 20)
    assert model.training  # generate leaves the mode alone


def test_generate_sampling_seeded():
    """Catches sampling that ignores the seed (or uses the global RNG), and a top-k filter that keeps too many."""
    model = make_model()
    prompt = [1, 2, 3]
    a = generate(model, prompt, 12, temperature=1.0, seed=7)
    torch.manual_seed(999)  # the global RNG must not matter
    b = generate(model, prompt, 12, temperature=1.0, seed=7)
    c = generate(model, prompt, 12, temperature=1.0, seed=8)
    assert a == b and a != c
    assert generate(model, prompt, 12, temperature=0.7, top_k=1) == generate(model, prompt, 12)
    with pytest.raises(UserError):
        generate(model, [], 3)
    with pytest.raises(UserError):
        generate(model, prompt, 400)


def test_setup_optimizers(capsys):
    """
    The AdamW groups' lrs are literal values worked out by hand, not recomputed with the module's scale expression:
    at model_dim 64 the lr scale is (768 / 64) ** 0.5 = sqrt(12) = 3.46410162, so lm_head 0.004 x 3.46410162 =
    0.01385641, wte 0.2 x 3.46410162 = 0.69282032, value embeddings half of that, 0.34641016; resid lambdas 0.5 / 100
    = 0.005, x0 lambdas 0.5 (beta1 0.96), smear gate + smear_lambda + backout_lambda 0.4 x 0.5 = 0.2. Fails on an
    inverted scale (model_dim / 768) ** 0.5 (0.00115470 for lm_head), on a scale from another reference width, on
    value embeddings without their halving, on a scaled scalar lr, and on the x0 lambdas without their beta1 0.96;
    also catches parameters missing from (or duplicated in) the optimizers and a missing initial_lr.
    """
    model = make_model(randomize=False, smear=True, backout=True, x0_lambdas=True)
    adamw, muon = setup_optimizers(model, matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004, scalar_lr=0.5)
    assert capsys.readouterr().out == ""  # the model prints nothing; the scripts log the lr scale
    lrs = [g["lr"] for g in adamw.param_groups]
    assert lrs == pytest.approx([0.01385641, 0.69282032, 0.34641016, 0.005, 0.5, 0.2], rel=1e-6)
    assert [(g["betas"][0], len(g["params"])) for g in adamw.param_groups] == [(0.8, 1), (0.8, 1), (0.8, 1),
                                                                              (0.8, 1), (0.96, 1), (0.8, 3)]
    assert adamw.defaults["eps"] == 1e-10
    assert not adamw.defaults["fused"]  # fused on CUDA only; torch's default implementation on CPU
    ids = [id(p) for opt in (adamw, muon) for g in opt.param_groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    for opt in (adamw, muon):
        for g in opt.param_groups:
            assert g["initial_lr"] == g["lr"]
    assert muon.param_groups[0]["lr"] == 0.02


def test_setup_optimizers_beta2_per_group():
    """
    embedding_beta2 and unembedding_beta2 replace the second beta of the embeddings (token and value embeddings) and of
    lm_head only, as literals: (0.8, 0.96) for lm_head, (0.8, 0.995) for wte and the value embeddings, the scalars
    keep (0.8, 0.95) and (0.96, 0.95); left None, every group keeps adam_betas. Catches the two swapped (lm_head
    getting the embeddings' beta2), the value embeddings left out, and the scalars' groups changed too.
    """
    model = make_model(randomize=False, smear=True, backout=True, x0_lambdas=True)
    adamw, _ = setup_optimizers(model, embedding_beta2=0.995, unembedding_beta2=0.96)
    assert [g["betas"] for g in adamw.param_groups] == [(0.8, 0.96), (0.8, 0.995), (0.8, 0.995), (0.8, 0.95),
                                                         (0.96, 0.95), (0.8, 0.95)]
    adamw, _ = setup_optimizers(model)
    assert [g["betas"][1] for g in adamw.param_groups] == [0.95] * 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_paths(monkeypatch):
    """On CUDA under bf16 autocast: flash-attn (when installed) must agree with SDPA, the cache path must agree with
    the full forward, and the fused AdamW + bf16 Muon step must run. Catches a (B, T, H, D) vs (B, H, T, D) layout
    mix-up on the flash path."""
    import nanotrain.attention as attention_module

    model = make_model(n_kv_head=1).cuda()
    idx = random_idx(2, 32).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(idx)
        monkeypatch.setattr(attention_module, "flash_attn_func", None)
        logits_sdpa = model(idx)
        out = generate(model, idx[0, :8].tolist(), 8)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, logits_sdpa, atol=0.1, rtol=0.05)
    assert len(out) == 8
    adamw, muon = setup_optimizers(model)
    assert adamw.defaults["fused"]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(idx, idx).backward()
    adamw.step()
    muon.step()


def test_build_model_loads_checkpoint_and_checks_vocab(tmp_path):
    """build_model equals a model built by hand and loaded from the same state, after the same seed; a checkpoint
    whose vocab_size differs from the tokenizer's is one UserError, not a size-mismatch traceback. Catches a
    build_model that skips load_state_dict (the weights would be the fresh init) or the vocab check."""
    from nanotrain.gpt import build_model
    config = GPTConfig(max_seq_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, model_dim=32)
    torch.manual_seed(0)
    trained = GPT(config)
    trained.init_weights()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p))
    ckpt = {"model": trained.state_dict(), "meta": {"model_config": vars(config)}, "path": str(tmp_path / "ck")}
    model = build_model(config, torch.device("cpu"), ckpt, vocab_size=64)
    idx = torch.randint(0, 64, (2, 16))
    assert torch.equal(model(idx), trained(idx))
    with pytest.raises(UserError, match="vocab_size 64 but the tokenizer has 80"):
        build_model(config, torch.device("cpu"), ckpt, vocab_size=80)
