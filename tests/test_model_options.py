"""
The model's 2026 options (value embeddings, smear, backout, x0/resid lambdas) against hand-built expectations on tiny
models, each with the plausible wrong implementation that must fail; and the checkpoint format they changed.
KV-cache decode == full forward, packed == unpacked rows, activation checkpointing, FLOPs against FlopCounterMode,
the export round trip and DDP/FSDP equality run with these options on in their own test files.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from nanotrain.attention import KVCache, segment_info
from nanotrain.checkpoint import save_checkpoint
from nanotrain.checkpoint_format import load_checkpoint
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers
from nanotrain.tensor_file import CheckpointError

pytestmark = pytest.mark.unit

TINY = dict(vocab_size=64, n_layer=4, model_dim=32, n_head=2, n_kv_head=1, max_seq_len=16)
ALL_ON = dict(value_embeds=True, smear=True, backout=True, x0_lambdas=True)  # (not all of them are defaults)


def make(seed=0, **options):
    """A tiny GPT with every weight random (the zero-initialised projections and gates too) and lambdas off their
    init, so that a wrong use of any of them changes the output."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **ALL_ON, **options}))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p), alpha=0.3)
            elif name != "wte.weight":
                p.normal_(0.0, 1.0 / math.sqrt(p.size(1)))
    return model


def test_smear_adds_the_gated_previous_embedding_and_never_across_a_segment():
    """
    smear() on one packed row of two segments (doc_ids [0, 0, 1, 1, 1]) equals the hand-built
    x_t + lambda * sigmoid(w . x_t[:12]) * x_{t-1}, with nothing added at t = 0 and at t = 2 (the second segment's
    first token). Catches a smear that crosses the segment boundary, one that reads x_{t+1}, and a gate read from
    x_{t-1} instead of x_t.
    """
    model = make()
    x = torch.randn(1, 5, 32)
    segments = segment_info(torch.tensor([[0, 0, 1, 1, 1]]))
    lam, w = model.smear_lambda.item(), model.smear_gate.weight[0]
    expected = x.clone()
    for t in (1, 3, 4):
        expected[0, t] += lam * torch.sigmoid(w @ x[0, t, :12]) * x[0, t - 1]
    torch.testing.assert_close(model.smear(x, segments=segments), expected, rtol=1e-6, atol=1e-6)
    crossing = model.smear(x)  # the same row read as one sequence: token 2 now gets token 1's embedding
    assert (crossing[0, 2] - expected[0, 2]).abs().max() > 1e-3


def test_smear_in_decode_reads_the_cached_embedding():
    """
    Prefill + one-token decode steps with a KV cache give the full forward's logits when smear is on (value
    embeddings, backout and lambdas too). The wrong variant, a decode step that forgets the previous token's
    embedding (kv_cache.prev_embedding zeroed, i.e. smear skipped in decode), must differ.
    """
    model = make()
    idx = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)
        for forget in (False, True):
            cache = KVCache(2, 1, 16, 4, 9, "cpu", torch.float32)
            out = [model(idx[:, :5], kv_cache=cache)]
            for t in range(5, 9):
                if forget:
                    cache.prev_embedding = torch.zeros_like(cache.prev_embedding)
                out.append(model(idx[:, t:t + 1], kv_cache=cache))
            err = (torch.cat(out, dim=1) - full).abs().max().item()
            assert (err > 1e-3) if forget else (err < 1e-5), (forget, err)


def test_value_embedding_enters_v_through_its_gate():
    """
    With one token, attention returns v itself, so the attention block gives c_proj(c_v(x) + 2 sigmoid(W_g x[:12]) *
    ve) (one kv head, repeated for both query heads). Catches the value embedding added without its gate, added to
    the keys instead, or the gate taken from the wrong channels.
    """
    model = make()
    attn = model.blocks[3].attn  # the last block always has a value embedding
    assert attn.ve_gate is not None and model.blocks[2].attn.ve_gate is None
    x, ve = torch.randn(1, 1, 32), torch.randn(1, 1, 16)
    cos_sin = model.cos[:, :1], model.sin[:, :1]
    gate = 2 * torch.sigmoid(attn.ve_gate.weight[0] @ x[0, 0, :12])
    v = x[0, 0] @ attn.c_v.weight.T + gate * ve[0, 0]
    expected = attn.c_proj.weight @ torch.cat([v, v])
    torch.testing.assert_close(attn(x, cos_sin, ve=ve)[0, 0], expected, rtol=1e-5, atol=1e-5)
    assert (attn(x, cos_sin)[0, 0] - expected).abs().max() > 1e-3  # without the value embedding it differs


def test_x0_lambdas_mix_the_embedding_in_before_each_block():
    """
    A block whose output projections are zero adds nothing, so it returns resid_lambda * x + x0_lambda * x0 exactly.
    Catches the mix applied after the block (the block would return x unchanged) and swapped lambdas.
    """
    model = make()
    block = model.blocks[1]
    with torch.no_grad():
        block.attn.c_proj.weight.zero_()
        block.mlp.c_proj.weight.zero_()
    x, x0 = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    a, b = torch.tensor(1.1), torch.tensor(0.3)
    cos_sin = model.cos[:, :3], model.sin[:, :3]
    torch.testing.assert_close(block(x, cos_sin, x0_mix=(a, b, x0)), 1.1 * x + 0.3 * x0)


def test_backout_subtracts_the_middle_blocks_output():
    """
    Depth 4, blocks 2 and 3 zeroed (they pass their input through), x0 lambdas off: the last block's output equals
    block 1's, the middle block ((4 - 1) // 2 = 1). With backout_lambda 1 the head sees norm(0) = 0, so every logit is
    0 and the loss is exactly ln(vocab). Catches backout taken from the embedding or from block 0 (the logits are not
    0), and backout applied after the final norm.
    """
    model = make(x0_lambdas=False)
    with torch.no_grad():
        for block in model.blocks[2:]:
            block.attn.c_proj.weight.zero_()
            block.mlp.c_proj.weight.zero_()
        model.backout_lambda.fill_(1.0)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    assert model(idx).abs().max().item() < 1e-5
    assert model(idx, idx).item() == pytest.approx(math.log(64), abs=1e-5)
    with torch.no_grad():
        model.backout_lambda.fill_(0.5)
    assert model(idx).abs().max().item() > 0.1  # half of it taken away: the logits are those of norm(x_mid)


def test_options_off_is_the_plain_model():
    """With every option off there are no extra parameters and the forward equals a hand-run plain transformer:
    norm(embedding) through the blocks, final norm, soft-capped head. Catches an option that is not really off."""
    model = make(value_embeds=False, smear=False, backout=False, x0_lambdas=False)
    names = {n.split(".")[0] for n, _ in model.named_parameters()}
    assert names == {"wte", "blocks", "lm_head"}
    idx = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        x = F.rms_norm(model.wte(idx), (32,))
        cos_sin = model.cos[:, :6], model.sin[:, :6]
        for block in model.blocks:
            x = block(x, cos_sin)
        logits = model.lm_head(F.rms_norm(x, (32,)))
        torch.testing.assert_close(model(idx), 15 * torch.tanh(logits / 15))


def test_a_checkpoint_of_the_previous_format_is_refused_in_one_line(tmp_path):
    """A checkpoint written before the options (meta format 1) is refused with a CheckpointError that names the
    format, instead of failing later on missing weights. Catches a loader that ignores the format."""
    model = make()
    opts = setup_optimizers(model)
    path = save_checkpoint(str(tmp_path), 3, model, opts, {"config": {}, "model_config": vars(model.config)}, {})
    assert load_checkpoint(path, "cpu")["meta"]["step"] == 3
    meta_file = f"{path}/meta.json"
    with open(meta_file) as f:
        meta = json.load(f)
    meta["format"] = 1
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    with pytest.raises(CheckpointError, match="format 1") as info:
        load_checkpoint(path, "cpu")
    assert "\n" not in str(info.value)
