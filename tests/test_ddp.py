"""
DDP on CPU (2 gloo processes): base_train's step under DDP equals one process with the full batch, one gradient
all-reduce per optimizer step, replicas bitwise equal after several steps, the logged loss is the global mean.
"""

import os
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import free_port
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from nanotrain.common import all_reduce_scalar, exit_process
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers
from nanotrain.run import check_replicas
from nanotrain.training import forward_backward, micro_batches, optimizer_step

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]
WORLD = 2


def make_model():
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, model_dim=32, smear=True,
                          backout=True, x0_lambdas=True))  # every model option on
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "c_proj" in name or "lm_head" in name:
                p.normal_(0, 0.05)
    return model


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)


def worker(rank, port, out_dir, wrong):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        return default_hooks.allreduce_hook(None, bucket)
    ddp.register_comm_hook(None, counting_hook)
    x, y = data(0)
    mine = slice(rank * 4, rank * 4 + 4)  # each rank gets half of the rows, in 2 micro-batches of 2
    forward_backward(model, micro_batches(x[mine], y[mine], 2), nullcontext())  # no DDP: this rank's own gradient, not synced
    local_norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
    model.zero_grad(set_to_none=True)
    if wrong:  # counter-example: the wrong step syncs on every micro-step and never divides by the accumulation
        for i in range(2):
            ddp(x[mine][2 * i:2 * i + 2], y[mine][2 * i:2 * i + 2]).backward()
    else:
        loss = forward_backward(ddp, micro_batches(x[mine], y[mine], 2), nullcontext())
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    n_buckets = len(set(calls))
    syncs = len(calls) / max(n_buckets, 1)
    result = {"grad": grad, "syncs": syncs}
    if not wrong:
        result["loss"] = all_reduce_scalar(loss, "mean", torch.device("cpu"))
        opts = setup_optimizers(model)
        result["grad_norm"] = optimizer_step(model, opts, 1.0, 0.95, 0.05).item()  # clipping active (norm > 0.05)
        result["local_norm"] = local_norm
        for step in range(1, 5):
            x, y = data(step)
            forward_backward(ddp, micro_batches(x[mine], y[mine], 2), nullcontext())
            optimizer_step(model, opts, 1.0, 0.95, 1.0)
        result["checksum"] = check_replicas(model)
        result["params"] = torch.cat([p.detach().flatten() for p in model.parameters()])
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    exit_process(0)  # destroys the group; a plain return can abort at exit (see nanotrain.common.exit_process)


def run(tmp_path, wrong=False):
    mp.start_processes(worker, args=(free_port(), str(tmp_path), wrong), nprocs=WORLD, start_method="spawn",
                       join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]


def test_ddp_two_ranks_equals_full_batch(tmp_path):
    """
    2 ranks x accumulation 2 give the gradient of one process on the full batch (1e-6 relative), with exactly one
    all-reduce per bucket per optimizer step, the same global-mean loss on both ranks, and bitwise-equal parameters
    after 5 steps. The wrong variant (sync every micro-step, no division by the accumulation) is run too: it
    all-reduces twice and its gradient is off by 2x. Gradient clipping uses the global norm: the norm optimizer_step
    clips with equals the full batch's on both ranks (1e-6); the wrong variant, clipping by each rank's own gradient
    norm before the sync (nanochat's old bug), is computed too and differs.
    """
    res = run(tmp_path)
    model = make_model()
    x, y = data(0)
    ref_loss = model(x, y)
    ref_loss.backward()
    ref = torch.cat([p.grad.flatten() for p in model.parameters()])
    for r in res:
        assert ((r["grad"] - ref).norm() / ref.norm()).item() < 1e-6
        assert r["syncs"] == 1
        assert abs(r["loss"] - ref_loss.item()) < 1e-6
    assert res[0]["loss"] == res[1]["loss"]
    ref_norm = ref.norm().item()
    assert ref_norm > 0.05  # so the clip at 0.05 is active
    for r in res:
        assert abs(r["grad_norm"] - ref_norm) / ref_norm < 1e-6
        assert abs(r["local_norm"] - ref_norm) / ref_norm > 1e-2  # per-rank clipping would use a different norm
    assert torch.equal(res[0]["params"], res[1]["params"]) and res[0]["checksum"] == res[1]["checksum"]
    bad = run(tmp_path, wrong=True)
    assert bad[0]["syncs"] == 2
    assert ((bad[0]["grad"] - ref).norm() / ref.norm()).item() > 0.5


def ns_worker(rank, port, out_dir, agree):
    """One rank as a training script starts it (compute_init on CPU, a model, setup_optimizers), with rank 1
    measuring slow bf16 matmuls."""
    import nanotrain.common as hardware
    import nanotrain.muon as muon
    from nanotrain.common import compute_init
    from nanotrain.gpt import GPT, GPTConfig
    from nanotrain.optim import setup_optimizers

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    speed = 4.5 if rank == 0 else 0.25  # bf16 / fp32 throughput each rank "measures"
    hardware.measure_matmul_flops = lambda dtype, n, s: 1e11 * (speed if dtype == torch.bfloat16 else 1.0)
    hardware.cpu_flags = lambda: None  # a CPU that lists no flags: each rank's timing decides
    if not agree:  # the wrong variant: each rank decides alone
        hardware.all_reduce_scalar = lambda value, op, device: int(value)
    compute_init("cpu")
    model = GPT(GPTConfig(max_seq_len=8, vocab_size=32, n_layer=1, n_head=1, n_kv_head=1, model_dim=16))
    setup_optimizers(model)  # ns_dtype "": settles Muon's Newton-Schulz dtype, before any step
    torch.save({"chosen": muon.ns_dtype_for("cpu")}, os.path.join(out_dir, f"ns{rank}.pt"))
    exit_process(0)


@pytest.mark.parametrize("agree", [True, False])
def test_ranks_agree_on_the_newton_schulz_dtype(tmp_path, agree):
    """
    Muon's Newton-Schulz dtype is measured per CPU; under DDP every rank must use the same one or the replicas drift.
    nanotrain.optim.setup_optimizers settles it on every rank before any Muon step: with rank 0 measuring fast bf16 and rank 1
    slow bf16, both choose fp32. The wrong variant (each rank decides alone) is run
    too and gives rank 0 bf16 and rank 1 fp32.
    """
    mp.start_processes(ns_worker, args=(free_port(), str(tmp_path), agree), nprocs=WORLD, start_method="spawn",
                       join=True)
    chosen = [torch.load(tmp_path / f"ns{r}.pt")["chosen"] for r in range(WORLD)]
    if agree:
        assert chosen == [torch.float32, torch.float32]
    else:
        assert chosen == [torch.bfloat16, torch.float32]
