"""
FSDP2 on CPU (2 gloo processes, nanotrain.fsdp): the same losses as DDP, fp32 reduction and fp32 state, checkpoints
that move between FSDP and DDP in both directions, and base_train --fsdp=True through torchrun.
The in-process checks run in one spawn of 2 ranks (module fixture `runs`); the tests read its results.
"""

import json
import os
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import TINY_TRAIN, free_port, run_script

from nanotrain.checkpoint import load_optimizers, save_checkpoint
from nanotrain.checkpoint_format import load_checkpoint
from nanotrain.common import all_reduce_scalar, exit_process
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers
from nanotrain.training import forward_backward, micro_batches, optimizer_step

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
WORLD = 2
STEPS, SAVE_AT = 5, 3  # optimizer steps per run; the checkpoint is written after SAVE_AT steps
CPU = torch.device("cpu")


# Muon with every option (NorMuon, cautious weight decay) and its Newton-Schulz in fp32: in bf16, updates that differ
# by fp32 roundoff (FSDP's reduce-scatter sums in another order than DDP's all-reduce) may round differently and
# drift apart by more than the 1e-5 compared here
OPT = dict(ns_dtype="float32", muon_beta2=0.9, muon_weight_decay=0.1)


def make_model():
    """The same tiny GPT on every rank and in every run (output projections perturbed so every gradient is > 0)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, model_dim=32, smear=True,
                          backout=True, x0_lambdas=True))  # every model option on
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "c_proj" in name or "lm_head" in name:
                p.normal_(0, 0.05)
    return model


def train(model, fwd, opts, rank, steps):
    """Optimizer steps `steps` on this rank's 4 of 8 rows (2 micro-batches of 2). Returns the global mean losses."""
    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
        loss = forward_backward(fwd, micro_batches(x[rank * 4:rank * 4 + 4], y[rank * 4:rank * 4 + 4], 2), nullcontext())
        losses.append(all_reduce_scalar(loss, "mean", CPU))
        optimizer_step(model, opts, 1.0, 0.95, 1.0)
    return losses


def full_params(model):
    """name -> full fp32 tensor (all-gathered under FSDP: collective)."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


def same(a, b):
    """Recursive equality of state dicts: same keys, lengths and values, tensors torch.equal with the same dtype."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def local_only(local, rows, group):
    """The wrong variant of nanotrain.muon._rows_to_matrices: this rank's matrices built from its own rows alone (the
    other ranks' rows zero, no communication), so each matrix is orthogonalised from one rank's rows."""
    world, rank, (n, have, cols) = dist.get_world_size(group), dist.get_rank(group), local.shape
    per, chunk = -(-n // world), -(-rows // world)
    whole = local.new_zeros(per, rows, cols)
    mine = local[rank * per:(rank + 1) * per]
    start = min(rank * chunk, rows)
    whole[:mine.size(0), start:start + have] = mine
    return whole


def worker(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import nanotrain.muon
    from nanotrain.fsdp import full_state_dicts, shard_model
    res = {}

    def fsdp_model(compute_dtype=torch.float32, state=None):
        model = make_model()
        if state is not None:
            model.load_state_dict(state)
        return shard_model(model, CPU, compute_dtype)

    # DDP reference, checkpoint after SAVE_AT steps
    model = make_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opts = setup_optimizers(model, **OPT)
    res["ddp"] = train(model, ddp, opts, rank, range(SAVE_AT))
    save_checkpoint(out + "/ddp", SAVE_AT, model, opts, {}, {"rank": rank}, rank, WORLD)
    res["ddp"] += train(model, ddp, opts, rank, range(SAVE_AT, STEPS))

    # FSDP, same init and data; checkpoint after SAVE_AT steps
    model = fsdp_model()
    opts = setup_optimizers(model, **OPT)
    res["fsdp"] = train(model, model, opts, rank, range(SAVE_AT))
    save_checkpoint(out + "/fsdp", SAVE_AT, model, opts, {}, {"rank": rank}, rank, WORLD)
    fsdp_params = full_params(model)
    res["fsdp"] += train(model, model, opts, rank, range(SAVE_AT, STEPS))

    # the wrong variant: Muon orthogonalises the local shard only
    right = nanotrain.muon._rows_to_matrices
    nanotrain.muon._rows_to_matrices = local_only
    model = fsdp_model()
    res["wrong"] = train(model, model, setup_optimizers(model, **OPT), rank, range(STEPS))
    nanotrain.muon._rows_to_matrices = right

    # FSDP checkpoint -> plain model under DDP: identical parameters, then the same losses as the DDP run
    ck = load_checkpoint(out + "/fsdp/checkpoints/step_%06d" % SAVE_AT, CPU, rank)
    model = make_model()
    model.load_state_dict(ck["model"])
    res["fsdp_ckpt_equal"] = all(torch.equal(p, fsdp_params[n]) for n, p in model.named_parameters())
    opts = setup_optimizers(model, **OPT)
    load_optimizers(model, opts, ck["optim"])
    res["fsdp_to_ddp"] = train(model, torch.nn.parallel.DistributedDataParallel(model), opts, rank,
                               range(SAVE_AT, STEPS))

    # DDP checkpoint -> FSDP: the optimizer state round-trips exactly, then the same losses as the DDP run
    ck = load_checkpoint(out + "/ddp/checkpoints/step_%06d" % SAVE_AT, CPU, rank)
    model = fsdp_model(state=ck["model"])
    opts = setup_optimizers(model, **OPT)
    load_optimizers(model, opts, ck["optim"])
    model_state, optim_states = full_state_dicts(model, opts)
    if rank == 0:
        res["roundtrip_model"] = all(torch.equal(v, model_state[k]) for k, v in ck["model"].items())
        res["roundtrip_optim"] = same(optim_states, ck["optim"])
    res["ddp_to_fsdp"] = train(model, model, opts, rank, range(SAVE_AT, STEPS))

    # precision: reduce_dtype fp32 in every FSDP group; with bf16 compute, params/grads/optimizer state stay fp32
    model = fsdp_model(torch.bfloat16)
    policies = [m._get_fsdp_state()._mp_policy for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    res["policies"] = [(p.param_dtype, p.reduce_dtype) for p in policies]
    opts = setup_optimizers(model, **OPT)
    g = torch.Generator().manual_seed(7)
    x, y = torch.randint(0, 64, (4, 16), generator=g), torch.randint(0, 64, (4, 16), generator=g)
    forward_backward(model, micro_batches(x, y, 2), nullcontext())
    res["grads"] = {(isinstance(p.grad, DTensor), p.grad.dtype) for p in model.parameters()}
    optimizer_step(model, opts, 1.0, 0.95, 1.0)
    res["params"] = {(isinstance(p, DTensor), p.dtype) for p in model.parameters()}
    res["states"] = {(isinstance(t, DTensor), t.dtype) for opt in opts for st in opt.state.values()
                     for k, t in st.items() if t.ndim > 0 and k != "second_moment"}
    # NorMuon's statistic (one number per row or column) is computed from the whole update: a plain fp32 tensor
    res["second_moments"] = {(isinstance(st["second_moment"], DTensor), st["second_moment"].dtype)
                             for opt in opts for st in opt.state.values() if "second_moment" in st}

    # Muon on a matrix whose rows do not split evenly (3 + 2 rows) equals Muon on the whole matrix
    torch.manual_seed(1)
    w, grad = torch.randn(5, 3), torch.randn(5, 3)
    plain = torch.nn.Parameter(w.clone())
    plain.grad = grad.clone()
    nanotrain.muon.Muon([plain]).step()
    mesh = model.wte.weight.device_mesh
    sharded = torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)]))
    sharded.grad = distribute_tensor(grad.clone(), mesh, [Shard(0)])
    nanotrain.muon.Muon([sharded]).step()
    res["uneven_muon"] = (sharded.full_tensor() - plain).abs().max().item()
    res["uneven_local_rows"] = sharded.to_local().shape[0]
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    exit_process(0)  # destroys the group; a plain return can abort at exit (see nanotrain.common.exit_process)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(worker, args=(free_port(), str(out)), nprocs=WORLD, start_method="spawn", join=True)
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_fsdp_losses_equal_ddp_and_local_muon_differs(runs):
    """
    5 steps of FSDP (2 ranks x 2 micro-batches, Muon + AdamW, clipping) give DDP's per-step losses within 1e-5 on
    the same data and init. Catches Muon orthogonalising each rank's shard alone (run here as "wrong": its losses
    differ by more than the tolerance), a gradient reduced twice or not averaged, a Muon scale from the local shape.
    Muon on a 5-row matrix sharded 3 + 2 equals Muon on the whole matrix (uneven shards).
    """
    _, res = runs
    for r in res:
        assert len(r["fsdp"]) == STEPS
        assert max(abs(a - b) for a, b in zip(r["fsdp"], r["ddp"])) < 1e-5, (r["fsdp"], r["ddp"])
        assert max(abs(a - b) for a, b in zip(r["wrong"], r["ddp"])) > 1e-4, (r["wrong"], r["ddp"])
        assert r["uneven_muon"] < 1e-6
    assert [r["uneven_local_rows"] for r in res] == [3, 2]
    assert res[0]["fsdp"] == res[1]["fsdp"]


def test_fsdp_reduces_in_fp32_and_keeps_fp32_state(runs):
    """
    Every FSDP group (2 blocks + root) reduces gradients in fp32; with bf16 compute (param_dtype bf16) the sharded
    parameters, gradients and optimizer state are fp32 DTensors after a step. Catches a policy that reduces in bf16
    or master weights / optimizer state kept in the compute dtype.
    """
    from nanotrain.fsdp import mixed_precision_policy
    _, res = runs
    for r in res:
        assert r["policies"] == [(torch.bfloat16, torch.float32)] * 3
        assert r["grads"] == r["params"] == r["states"] == {(True, torch.float32)}
        assert r["second_moments"] == {(False, torch.float32)}
    for compute_dtype in (torch.bfloat16, torch.float32):
        assert mixed_precision_policy(compute_dtype).reduce_dtype == torch.float32


def test_fsdp_checkpoints_move_between_fsdp_and_ddp(runs):
    """
    A checkpoint written under FSDP has the files and format of a DDP one (same model keys, shapes, dtypes, same
    optimizer state indices and keys); it loads into a plain model with torch.equal parameters and a DDP run resumed
    from it gives the uninterrupted losses (1e-5); a DDP checkpoint loads under FSDP, its optimizer state gathers
    back bitwise, and the FSDP run resumed from it gives the same losses. Catches sharded tensors or parameter-name
    keys written to optim.pt, a lost momentum buffer or Adam moment, and shards loaded onto the wrong rank.
    """
    out, res = runs
    ck = {m: load_checkpoint(str(out / m / "checkpoints" / f"step_{SAVE_AT:06d}"), CPU) for m in ("ddp", "fsdp")}
    assert sorted(os.listdir(out / "fsdp" / "checkpoints" / f"step_{SAVE_AT:06d}")) == sorted(
        os.listdir(out / "ddp" / "checkpoints" / f"step_{SAVE_AT:06d}"))
    a, b = ck["ddp"], ck["fsdp"]
    assert [(k, v.shape, v.dtype, type(v)) for k, v in a["model"].items()] == [
        (k, v.shape, v.dtype, type(v)) for k, v in b["model"].items()]
    for sa, sb in zip(a["optim"], b["optim"], strict=True):
        assert sa["param_groups"] == sb["param_groups"]
        assert {i: {k: (t.shape, t.dtype, type(t)) for k, t in st.items()} for i, st in sa["state"].items()} == {
            i: {k: (t.shape, t.dtype, type(t)) for k, t in st.items()} for i, st in sb["state"].items()}
    assert "momentum_buffer" in b["optim"][1]["state"][0] and "exp_avg" in b["optim"][0]["state"][0]
    assert json.load(open(out / "fsdp" / "checkpoints" / f"step_{SAVE_AT:06d}" / "meta.json"))["step"] == SAVE_AT
    for r in res:
        assert r["fsdp_ckpt_equal"]
        for key in ("fsdp_to_ddp", "ddp_to_fsdp"):
            assert max(abs(x - y) for x, y in zip(r[key], r["ddp"][SAVE_AT:], strict=True)) < 1e-5, (key, r[key])
    assert res[0]["roundtrip_model"] and res[0]["roundtrip_optim"]


@pytest.mark.smoke
def test_base_train_fsdp_torchrun(base_dir):
    """base_train --fsdp=True on 2 gloo ranks trains (finite, falling loss), samples at the end and saves a checkpoint."""
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=6", "--run_name=f", "--fsdp=True",
                   base_dir=base_dir, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fsdp True" in r.stdout and "Replica check: skipped under FSDP" in r.stdout
    assert "sample: 'The capital of France is' ->" in r.stdout
    ckpt = base_dir / "base" / "f" / "checkpoints" / "step_000006"
    assert sorted(os.listdir(ckpt)) == ["meta.json", "model.pt", "optim.pt", "rank_00000.pt", "rank_00001.pt"]
    model = GPT(GPTConfig(**json.load(open(ckpt / "meta.json"))["model_config"]))
    model.load_state_dict(torch.load(ckpt / "model.pt", weights_only=True))
    losses = [json.loads(line)["loss"] for line in open(base_dir / "base" / "f" / "metrics.jsonl") if '"loss"' in line]
    assert len(losses) == 6 and losses[-1] < losses[0]
