"""
Activation checkpointing (GPT.activation_checkpointing, --activation_checkpointing=True): same loss and gradients,
less memory (measured with the fake-tensor MemTracker probe of nanotrain.autobatch), a larger discovered
device_batch_size under the same budget, a cache entry of its own, and the same losses in base_train.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import TINY_TRAIN, run_script

from nanotrain.autobatch.builders import gpt_builder
from nanotrain.autobatch.probe import GiB, measure_fake_peak
from nanotrain.autobatch.search import discover_device_batch_size
from nanotrain.gpt import GPT, GPTConfig, KVCache, config_from_depth

TINY = GPTConfig(max_seq_len=32, vocab_size=64, n_layer=3, n_head=2, n_kv_head=1, model_dim=32, smear=True, backout=True,
                 x0_lambdas=True)  # every model option on


def tiny_model(seed=0):
    """A tiny fp32 GPT whose output projections are not zero (with the zero init, most block gradients are 0 and a
    gradient comparison would pass trivially)."""
    torch.manual_seed(seed)
    model = GPT(TINY)
    model.init_weights()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(0, 0.05)
            block.mlp.c_proj.weight.normal_(0, 0.05)
    return model.train()


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.max_seq_len), generator=g)
    targets = torch.randint(0, TINY.vocab_size, (2, TINY.max_seq_len), generator=g)
    doc_ids = torch.tensor([[0] * 10 + [1] * 22, [0] * 5 + [1] * 20 + [2] * 7])
    return idx, targets, doc_ids


def loss_and_grads(model, forward, idx, targets, doc_ids):
    model.zero_grad(set_to_none=True)
    loss = forward(idx, targets, doc_ids=doc_ids)
    loss.backward()
    return loss.item(), {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                         for n, p in model.named_parameters()}


def max_rel_diff(a, b):
    """max over parameters of max|a - b| / max|a| (gradients)."""
    return max(((a[n] - b[n]).abs().max() / a[n].abs().max().clamp_min(1e-30)).item() for n in a)


class DetachedInput(torch.nn.Module):
    """The wrong variant: a checkpoint wrapper that hands the block a detached input (the pattern of hand-rolled
    checkpointing that recomputes from x.detach() and forgets to route the gradient back to x)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, *args):
        return self.block(x.detach(), *args)


@pytest.mark.unit
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "doc_ids"])
def test_same_loss_and_gradients(packed):
    """
    Checkpointed and plain training steps give the same fp32 loss and gradients (max relative difference <= 1e-6 per
    parameter), with plain rows and with doc_ids packing (the block-diagonal mask and per-segment rotary positions
    must be the ones of the recomputation too). Catches a checkpoint wrapper that detaches the block input: its loss
    is identical but the gradients of the embedding and all lower blocks vanish; the test runs that variant and
    asserts it fails the same tolerance.
    """
    idx, targets, doc_ids = batch()
    doc_ids = doc_ids if packed else None
    model = tiny_model()
    loss0, g0 = loss_and_grads(model, model, idx, targets, doc_ids)
    model.activation_checkpointing = True
    loss1, g1 = loss_and_grads(model, model, idx, targets, doc_ids)
    assert abs(loss1 - loss0) <= 1e-6 * abs(loss0)
    assert max_rel_diff(g0, g1) <= 1e-6
    assert g0["wte.weight"].abs().max() > 0 and g0["blocks.0.attn.c_q.weight"].abs().max() > 0

    blocks = list(model.blocks)  # the wrong variant, run through the same checkpointed forward
    model.blocks = torch.nn.ModuleList(DetachedInput(b) for b in blocks)
    loss2, g2 = loss_and_grads(model, model, idx, targets, doc_ids)
    model.blocks = torch.nn.ModuleList(blocks)
    g2 = {n.replace(".block.", "."): g for n, g in g2.items()}
    assert abs(loss2 - loss0) <= 1e-6 * abs(loss0)  # the loss alone cannot see it
    assert max_rel_diff(g0, g2) > 1e-6  # (wte still gets a gradient through smear and the x0 lambdas)


@pytest.mark.unit
def test_same_gradients_under_torch_compile():
    """
    torch.compile(fullgraph=True) of the checkpointed model with packed rows (dynamo traces torch.utils.checkpoint
    into its checkpoint higher-order op; aot_eager runs AOT autograd's joint graph and partitioner without the slow
    C++ codegen) gives the eager gradients within 1e-6. Catches a graph break or an error on the checkpoint path (the
    reentrant variant, use_reentrant=True, is not traceable by dynamo in one graph) and a recomputation that sees
    other inputs than the forward.
    """
    idx, targets, doc_ids = batch()
    model = tiny_model()
    loss0, g0 = loss_and_grads(model, model, idx, targets, doc_ids)
    model.activation_checkpointing = True
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, dynamic=False, fullgraph=True, backend="aot_eager")
        loss1, g1 = loss_and_grads(model, compiled, idx, targets, doc_ids)
    finally:
        torch._dynamo.reset()
    assert abs(loss1 - loss0) <= 1e-6 * abs(loss0)
    assert max_rel_diff(g0, g1) <= 1e-6


@pytest.mark.slow
def test_same_gradients_under_inductor():
    """As test_same_gradients_under_torch_compile with the default inductor backend (C++ codegen, ~1 min on this CPU;
    measured max relative gradient difference ~7e-7: fused kernels round differently). Tolerance 1e-5."""
    idx, targets, doc_ids = batch()
    model = tiny_model()
    loss0, g0 = loss_and_grads(model, model, idx, targets, doc_ids)
    model.activation_checkpointing = True
    torch._dynamo.reset()
    try:
        loss1, g1 = loss_and_grads(model, torch.compile(model, dynamic=False), idx, targets, doc_ids)
    finally:
        torch._dynamo.reset()
    assert abs(loss1 - loss0) <= 1e-5 * abs(loss0)
    assert max_rel_diff(g0, g1) <= 1e-5


@pytest.mark.unit
def test_kv_cache_and_eval_are_not_checkpointed():
    """
    With activation_checkpointing=True, a forward with a KV cache (here even in training mode with grad enabled)
    still fills and reads the cache: prefill + one decode step give the logits of the full forward, and eval/
    no_grad forwards equal the plain ones. Catches checkpointing that passes kv_cache=None to the blocks (the
    cache stays empty and the decode step sees no prefix).
    """
    model = tiny_model()
    idx, _, _ = batch()
    idx = idx[:1, :9]
    full = model(idx).detach()
    model.activation_checkpointing = True
    cache = KVCache(1, TINY.n_kv_head, model.head_dim, TINY.n_layer, 16, "cpu", torch.float32)
    prefill = model(idx[:, :8], kv_cache=cache)
    step = model(idx[:, 8:], kv_cache=cache)
    torch.testing.assert_close(torch.cat([prefill, step], dim=1).detach(), full, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert torch.equal(model.eval()(idx), full)


@pytest.mark.unit
def test_lower_peak_memory_same_batch():
    """
    The MemTracker peak of the training step (measure_fake_peak, the auto batch size probe: 2 micro-steps, optimizer
    step, 1 micro-step) at depth 4, max_seq_len 256, device_batch_size 8 is at most 65% of the plain step's
    (measured ~60% at vocab 512; 55% without value embeddings, smear, backout and lambdas). Catches a flag that the builder ignores (the probes would measure the plain model)
    and checkpointing that still saves the blocks' inner activations (e.g. checkpoint only around the attention).
    """
    config = config_from_depth(4, 512, 256)
    peaks = {ac: measure_fake_peak(gpt_builder(config, activation_checkpointing=ac), 8, max_seq_len=256,
                                   vocab_size=512) for ac in (False, True)}
    assert peaks[True] <= 0.65 * peaks[False], peaks


@pytest.mark.slow  # the default run keeps test_lower_peak_memory_same_batch and test_auto_batch_size's discovery
def test_discovery_finds_a_larger_batch_and_its_own_cache_entry(tmp_path, monkeypatch):
    """
    With a budget in which the checkpointed step fits at device_batch_size 16 and (as measured first) the plain one
    does not, discovery finds < 16 without checkpointing and >= 16 with it, and the second discovery misses the
    first one's cache entry. Catches a cache key without the flag (the checkpointed run would reuse the smaller size
    found without it, or, the other way round, a plain run an oversized one) and probes of the plain model.
    """
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    config = config_from_depth(2, 512, 64)  # at depth 1 the one recomputed block is the whole peak: nothing to save
    args = dict(max_seq_len=64, vocab_size=512, total_batch_size=64 * 16, world_size=1, device="cpu",
                margin=1.0, key_fields={}, log=lambda *a, **k: None)
    peak16 = {ac: measure_fake_peak(gpt_builder(config, activation_checkpointing=ac), 16, max_seq_len=64,
                                    vocab_size=512) for ac in (False, True)}
    assert peak16[False] > 1.01 * peak16[True]
    gb = 1.005 * peak16[True] / GiB
    plain, rec_plain = discover_device_batch_size(gpt_builder(config), device_memory_gb=gb, **args)
    ckpt, rec_ckpt = discover_device_batch_size(gpt_builder(config, activation_checkpointing=True),
                                                device_memory_gb=gb, **args)
    assert plain < 16 <= ckpt, (plain, ckpt)
    assert not rec_ckpt["cache_hit"] and rec_ckpt["cache_path"] != rec_plain["cache_path"]
    assert rec_ckpt["cache_key"]["key_fields"]["activation_checkpointing"] is True
    assert os.path.exists(rec_plain["cache_path"]) and os.path.exists(rec_ckpt["cache_path"])


def metrics(base_dir, run):
    with open(os.path.join(base_dir, "base", run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.smoke
@pytest.mark.slow  # the same gradients in process are in the default run (test_same_gradients_*)
def test_base_train_same_losses(base_dir):
    """
    base_train for 2 steps with --activation_checkpointing=True logs the losses of the plain run (relative 1e-6);
    the checkpointed run discovers its batch size (--auto_batch_size=True, capped at the plain run's 4 rows) and
    the discovery record's cache key says activation_checkpointing=True. Catches a script that never sets the flag
    on the model (the config says True, the model runs plain) or does not pass it to the probes, and any change of
    the training numerics.
    """
    args = [a for a in TINY_TRAIN if not a.startswith("--device_batch_size=")]
    runs = [[*TINY_TRAIN, "--run_name=plain"],
            [*args, "--run_name=ac", "--activation_checkpointing=True", "--auto_batch_size=True", "--max_batch_size=4",
             "--device_memory_gb=4"]]
    with ThreadPoolExecutor(2) as pool:  # two single-threaded processes side by side
        results = list(pool.map(lambda a: run_script("base_train.py", *a, "--num_iterations=2", base_dir=base_dir),
                                runs))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    a = {r["step"]: r["loss"] for r in metrics(base_dir, "plain") if "loss" in r}
    b = {r["step"]: r["loss"] for r in metrics(base_dir, "ac") if "loss" in r}
    assert sorted(a) == sorted(b) == [1, 2]
    assert all(abs(a[s] - b[s]) <= 1e-6 * abs(a[s]) for s in a), (a, b)
    with open(os.path.join(base_dir, "base", "ac", "auto_batch_size.json")) as f:
        record = json.load(f)
    assert record["device_batch_size"] == 4 and record["cache_key"]["key_fields"]["activation_checkpointing"] is True
    with open(os.path.join(base_dir, "base", "ac", "config.json")) as f:
        assert json.load(f)["activation_checkpointing"] is True
