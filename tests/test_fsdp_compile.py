"""
FSDP2 with torch.compile, compile then shard (nanotrain.fsdp.shard_model(compile_backend=...)): each block compiled in
place before fully_shard, on a one-rank gloo group in this process (the torch.distributed paths without a second
process).
"""

import pytest
import torch

from nanotrain.gpt import GPT, GPTConfig


def model_and_batch():
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, model_dim=32))
    model.init_weights()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.c_proj.weight.normal_(0, 0.05)
            block.mlp.c_proj.weight.normal_(0, 0.05)
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g)


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["none", "selective"])
def test_blocks_compiled_then_sharded_give_the_eager_gradients(one_rank_mesh, policy):
    """
    shard_model(compile_backend="aot_eager") compiles every block (nn.Module.compile: the module, its parameters and
    state-dict names stay) and then shards it: the blocks are FSDP modules whose calls go through torch.compile, and
    a training step (with activation checkpointing none or selective) gives the loss and gradients of the same model
    sharded without compile, within 1e-6 relative. Catches a compile applied after sharding to the root only (the
    blocks would run eagerly: no compiled call) and a compiled block that loses FSDP's all-gather or the gradient.
    """
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import FSDPModule

    from nanotrain.fsdp import shard_model
    results = []
    torch._dynamo.reset()
    counters.clear()
    try:
        for backend in (None, "aot_eager"):
            model, x, y = model_and_batch()
            model.activation_checkpointing = policy
            shard_model(model, torch.device("cpu"), torch.float32, compile_backend=backend)
            names = [n for n, _ in model.named_parameters()]
            assert all(isinstance(b, FSDPModule) for b in model.blocks)
            assert all((b._compiled_call_impl is not None) == (backend is not None) for b in model.blocks)
            loss = model(x, y)
            loss.backward()
            results.append((loss.item(), {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}))
            assert "blocks.0.attn.c_q.weight" in names
        assert counters["stats"]["unique_graphs"] >= 2  # each block really went through dynamo (not skipped)
    finally:
        torch._dynamo.reset()
    (loss0, g0), (loss1, g1) = results
    assert abs(loss1 - loss0) <= 1e-6 * abs(loss0)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert (g0[n] - g1[n]).abs().max() <= 1e-6 * g0[n].abs().max().clamp_min(1e-30), n
