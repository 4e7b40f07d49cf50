"""
SFT loss normalisation (token_loss_scale of nanotrain/sft_data.py through nanotrain.training.forward_backward): the gradient of an optimizer step is that of the
global token mean, whatever the split into micro-batches (gradient accumulation) and ranks (DDP on gloo).
Tiny real GPT in fp32 on CPU: the correct normalisation matches within 1e-6 relative (fp32 roundoff), the naive
per-micro-batch mean misses by more than 1e-2.
"""

import math
import os
import tempfile
from contextlib import nullcontext
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, sft_backward, spawn_ranks

from nanotrain.common import exit_process
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.sft_data import lpt_pack, micro_batch, pad_conversations

TINY = dict(vocab_size=128, n_layer=2, model_dim=64, n_head=2, n_kv_head=1, max_seq_len=64)


def make_model(seed=0):
    """A tiny fp32 GPT whose zero-initialised projections are filled with random values (so attention matters)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**TINY))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # the lambdas: moved off their init
                p.add_(torch.randn_like(p), alpha=0.1)
            elif name != "wte.weight":
                p.normal_(0.0, 1.0 / math.sqrt(p.size(1)))
    return model


def make_convs():
    """8 conversations (ids, mask) of 6..40 tokens whose trained-token counts range from 1 to 38: the counts
    per micro-batch differ a lot, which is what separates the correct normalisation from the per-micro-batch mean."""
    g = torch.Generator().manual_seed(3)
    lengths = [40, 6, 31, 9, 25, 12, 18, 7]
    trained = [38, 1, 3, 8, 24, 2, 10, 5]  # the last `trained` tokens of each conversation are targets
    convs = []
    for n, k in zip(lengths, trained):
        ids = torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()
        convs.append((ids, [0] * (n - k) + [1] * k))
    return convs


def grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def reference(model, convs):
    """The single-batch reference, computed without sft_data's normalisation: one padded batch with all
    conversations and torch's mean cross-entropy over all trained targets. Returns (loss, gradient)."""
    model.zero_grad(set_to_none=True)
    x, y = pad_conversations(convs, pad_id=0)
    loss = model(x, y)  # reduction "mean" over the non-ignored targets of the whole batch
    loss.backward()
    return loss.item(), grads(model)


def naive_backward(model, batches):
    """The wrong variant (nanochat / HF before Oct 2024): each micro-batch's own token mean, divided by the number of
    micro-batches (guarded against empty micro-batches so that it fails on weighting, not on NaN)."""
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    for i, b in enumerate(batches):
        if ddp:
            model.require_backward_grad_sync = i == len(batches) - 1
        loss = model(b["x"], b["y"], loss_reduction="sum", doc_ids=b["doc_ids"]) / max(b["targets"], 1)
        (loss / len(batches)).backward()


@pytest.mark.unit
@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("grad_accum_steps", [1, 2, 4])
def test_grad_accum_equals_single_batch(grad_accum_steps, packing):
    """
    grad_accum_steps micro-batches (packed or padded) with sum-loss * 1/global_count give the single-batch gradient
    and logged loss within 1e-6 relative. Catches the per-micro-batch mean / grad_accum_steps (the 2024 gradient-
    accumulation bug), which is exercised here and must differ by more than 1e-2 whenever grad_accum_steps > 1,
    and a count taken per micro-batch instead of over the whole step.
    """
    convs = make_convs()
    model = make_model()
    ref_loss, ref_grad = reference(model, convs)
    per = len(convs) // grad_accum_steps
    batches = [micro_batch(convs[i:i + per], packing, pad_id=0) for i in range(0, len(convs), per)]
    assert len(batches) == grad_accum_steps
    model.zero_grad(set_to_none=True)
    scaled, count = sft_backward(model, batches, nullcontext() if grad_accum_steps == 2 else None)  # both paths
    assert count == 38 + 1 + 3 + 8 + 24 + 2 + 10 + 5  # make_convs' trained counts: none starts at the first token
    assert rel(grads(model), ref_grad) <= 1e-6
    assert abs(scaled.item() - ref_loss) <= 1e-6 * ref_loss  # the logged loss is the global token mean
    if grad_accum_steps > 1:
        model.zero_grad(set_to_none=True)
        naive_backward(model, batches)
        assert rel(grads(model), ref_grad) > 1e-2


@pytest.mark.unit
def test_zero_token_micro_batch_and_empty_step():
    """
    A micro-batch without trained targets (the dummy of a rank with no data, or a fully masked one) contributes an
    exactly zero gradient and no NaN, and a step with no target at all runs no backward (count 0: the caller
    skips it). Catches a mean reduction there (0/0 = NaN, exercised below) and a dummy that trains on its token.
    """
    convs = make_convs()
    model = make_model()
    dummy = micro_batch([], packing=True, pad_id=5)
    loss = model(dummy["x"], dummy["y"], loss_reduction="sum")
    loss.backward()
    assert loss.item() == 0.0 and all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    assert math.isnan(model(dummy["x"], dummy["y"]).item())  # the wrong variant: mean over zero targets
    masked = micro_batch([(convs[0][0], [0] * len(convs[0][0]))], packing=True, pad_id=0)
    assert masked["targets"] == 0
    real = micro_batch(convs[:3], packing=True, pad_id=0)
    model.zero_grad(set_to_none=True)
    sft_backward(model, [real])
    alone = grads(model)
    model.zero_grad(set_to_none=True)
    scaled, count = sft_backward(model, [dummy, real, masked])
    assert torch.isfinite(grads(model)).all() and rel(grads(model), alone) <= 1e-6
    model.zero_grad(set_to_none=True)
    scaled, count = sft_backward(model, [dummy, masked])
    assert count == 0 and scaled.item() == 0.0
    assert all(p.grad is None for p in model.parameters())


# ----------------------------------------------------------------------------- 2 ranks on gloo
def _dist_worker(rank, world_size, port, out_dir):
    """One rank: DDP over the tiny model, this rank's micro-batches from lpt_pack, correct and naive backward."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    convs = make_convs()[:7]  # 7 conversations, one per rank and micro-batch: rank 1 ends with a dummy
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    plan = lpt_pack([len(ids) for ids, _ in convs], max_tokens=45, world_size=world_size, max_items=1)
    batches = [micro_batch([convs[i] for i in mb[rank]], True, pad_id=0) for mb in plan]
    scaled, count = sft_backward(ddp, batches)
    loss = scaled.clone()
    dist.all_reduce(loss)
    out = {"grad": grads(model), "loss": loss.item() / world_size, "count": count, "num_micro": len(batches),
           "targets": sum(b["targets"] for b in batches), "dummies": sum(not mb[rank] for mb in plan)}
    model.zero_grad(set_to_none=True)
    naive_backward(ddp, batches)
    out["naive_grad"] = grads(model)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    exit_process(0)  # destroys the group; a plain return can abort at exit (see nanotrain.common.exit_process)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_ddp_two_ranks_with_accumulation_equals_single_process():
    """
    2 gloo ranks with DDP, each running its LPT micro-batches (2+ per rank, unequal token counts, dummy micro-batches
    where a rank runs out) with loss_sum * world_size / global_count: the averaged gradient equals the single-process
    full-batch gradient within 1e-6 relative and the logged loss is the global token mean. Catches the per-rank
    per-micro-batch mean (exercised, must differ by > 1e-2), a missing world_size factor, and a local count.
    """
    ref_loss, ref_grad = reference(make_model(), make_convs()[:7])
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_dist_worker, (2, free_port(), out_dir))
        r = [torch.load(os.path.join(out_dir, f"rank{i}.pt"), weights_only=True) for i in range(2)]
    assert r[0]["num_micro"] == r[1]["num_micro"] == 4 and r[0]["dummies"] + r[1]["dummies"] == 1
    assert r[0]["targets"] != r[1]["targets"]  # the ranks really carry unequal token counts
    assert r[0]["count"] == r[1]["count"] == r[0]["targets"] + r[1]["targets"]
    assert torch.equal(r[0]["grad"], r[1]["grad"])  # DDP: identical gradients on both ranks
    assert rel(r[0]["grad"], ref_grad) <= 1e-6
    assert abs(r[0]["loss"] - ref_loss) <= 1e-6 * ref_loss
    assert rel(r[0]["naive_grad"], ref_grad) > 1e-2
