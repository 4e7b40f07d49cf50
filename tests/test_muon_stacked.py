"""
nanotrain.muon by shape: the stacked step against a per-matrix reference written out here, eager and compiled; one
compilation per shape while the schedule moves; the finite gate (no host read); the work shared across 2 and 3 gloo
ranks (plain tensors as under DDP, and DTensors as under FSDP2) equal to one process's step.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
from helpers import free_port, spawn_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from nanotrain.muon import NS_COEFFS, POLAR_EXPRESS_COEFFS, Muon
from nanotrain.optim import compile_optimizer_step

# two stacks of 3 and 2, a tall and a wide matrix, and one alone; scales 1e-3..1e3 within a stack
SHAPES = [(16, 8), (16, 8), (16, 8), (8, 24), (8, 24), (6, 32)]
SCALES = [1.0, 1e3, 1e-3, 1.0, 50.0, 1.0]
HYPER = [(0.05, 0.9, 0.3), (0.03, 0.95, 0.1), (0.02, 0.85, 0.5)]  # (lr, momentum, weight decay) of each step
KW = dict(ns_dtype="float32", polar_express=True, beta2=0.9)


def reference_step(w, g, state, lr, momentum, wd, beta2, polar_express, nesterov=True, steps=5):
    """Muon on one matrix, written from the formulas (Jordan 2024; Amsel et al. 2025; Li et al. 2025; Chen et al.
    2025), in float64: EMA momentum, Nesterov look-ahead, quintic iteration on the normalised wide orientation, NorMuon
    along the longer side, cautious weight decay, the step lr * sqrt(max(1, rows / cols)). Returns the new w."""
    w, g = w.double(), g.double()
    buf = momentum * state.get("buf", torch.zeros_like(g)) + (1 - momentum) * g
    state["buf"] = buf
    u = (1 - momentum) * g + momentum * buf if nesterov else buf
    x = u.T if u.shape[0] > u.shape[1] else u
    x = x / (torch.linalg.matrix_norm(x) * (1.01 if polar_express else 1.0) + 1e-7)
    for a, b, c in (POLAR_EXPRESS_COEFFS[:steps] if polar_express else [NS_COEFFS] * steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    u = x.T if u.shape[0] > u.shape[1] else x
    if beta2 > 0:
        axis = 1 if u.shape[0] >= u.shape[1] else 0
        v = beta2 * state.get("v", 0.0) + (1 - beta2) * (u ** 2).mean(axis, keepdim=True)
        state["v"] = v
        scaled = u / v.clamp_min(1e-10).sqrt()
        u = scaled * torch.linalg.matrix_norm(u) / torch.linalg.matrix_norm(scaled).clamp_min(1e-10)
    s = lr * math.sqrt(max(1.0, w.shape[0] / w.shape[1]))
    return w - s * wd * w * ((u * w) > 0) - s * u


def weights_and_grads(steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ws = [torch.randn(s, generator=gen) for s in SHAPES]
    gs = [[torch.randn(s, generator=gen) * k for s, k in zip(SHAPES, SCALES)] for _ in range(steps)]
    return ws, gs


def run_muon(ws, gs, compiled=None, **kw):
    """Muon (KW) on copies of ws, one step per entry of gs with HYPER's settings. Returns (params, optimizer)."""
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = Muon(params, **{**KW, **kw})
    if compiled:
        assert compile_optimizer_step([opt], "cpu", backend=compiled, log=lambda *a: None)
    for (lr, m, wd), grads in zip(HYPER, gs):
        opt.param_groups[0].update(lr=lr, momentum=m, weight_decay=wd)
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    return params, opt


@pytest.mark.unit
@pytest.mark.parametrize("compiled", [None, "aot_eager"])
def test_stacked_step_equals_the_per_matrix_reference(compiled):
    """
    3 steps of Muon (Polar Express, NorMuon, cautious weight decay, lr, momentum and decay moving every step) on two
    stacks (3 and 2 matrices), a tall, a wide and a lone matrix, whose gradients differ in scale by up to 1e6 within a
    stack, equal the per-matrix reference (float64, written out above) to fp32 roundoff: relative 2e-5 per matrix
    (measured ~1e-6), eager and compiled (aot_eager: dynamo's graph, fullgraph). Catches a normalisation by the
    stack's norm instead of each matrix's (the small matrices would not be orthogonalised), NorMuon's rescale or
    statistic taken over the stack, matrices of a stack mixed up or written back in the wrong order, and the
    sqrt(rows / cols) scale of the wrong stack.
    """
    ws, gs = weights_and_grads()
    if compiled:
        torch._dynamo.reset()
    try:
        params, opt = run_muon(ws, gs, compiled)
    finally:
        torch._dynamo.reset()
    for i, (w, p) in enumerate(zip(ws, params)):
        state, want = {}, w
        for (lr, m, wd), grads in zip(HYPER, gs):
            want = reference_step(want, grads[i], state, lr, m, wd, KW["beta2"], KW["polar_express"])
        err = ((p.detach().double() - want).abs().max() / (want - w.double()).abs().max()).item()
        assert err < 2e-5, (i, SHAPES[i], err)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), state["buf"], rtol=1e-5, atol=1e-6)
        assert opt.state[p]["second_moment"].shape == state["v"].shape


@pytest.mark.slow
def test_stacked_step_inductor_equals_the_per_matrix_reference():
    """As test_stacked_step_equals_the_per_matrix_reference with the inductor backend (C++ kernels on CPU)."""
    test_stacked_step_equals_the_per_matrix_reference("inductor")


@pytest.mark.unit
def test_compiled_once_per_shape_while_the_schedule_moves():
    """
    With the step compiled, 3 steps whose lr, momentum and weight decay all change every step compile each of
    Muon's four stack functions once per stack shape (3 shapes here: (3, 16, 8), (2, 8, 24), (1, 6, 32)): 12 graphs
    after the first step, none after.
    Catches a hyperparameter passed as a Python number (a new constant: a recompilation every step), one matrix at a
    time (a graph per matrix count, not per stack) and dynamic shapes.
    """
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    ws, gs = weights_and_grads()
    torch._dynamo.reset()
    try:
        params = [torch.nn.Parameter(w.clone()) for w in ws]
        opt = Muon(params, **KW)
        assert compile_optimizer_step([opt], "cpu", backend=counting_backend, log=lambda *a: None)
        counts = []
        for (lr, m, wd), grads in zip(HYPER, gs):
            opt.param_groups[0].update(lr=lr, momentum=m, weight_decay=wd)
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
            counts.append(len(graphs))
    finally:
        torch._dynamo.reset()
    assert counts == [12, 12, 12], counts
    assert all(fn.compiled for fn in opt.fns.values())


class HostReads(TorchDispatchMode):
    """Counts the ops that read a tensor's value on the host (.item(), float(), bool(), .tolist())."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.unit
@pytest.mark.parametrize("compiled", [None, pytest.param("aot_eager", marks=pytest.mark.slow)])
def test_finite_false_leaves_everything_bit_for_bit(compiled):
    """
    After one ordinary step (state exists), a step with NaN and inf gradients and finite=torch.tensor(False) leaves
    every parameter, momentum buffer and second moment bit for bit as it was, with no host read during the eager step
    (a TorchDispatchMode counts aten._local_scalar_dense); finite=torch.tensor(True) gives the same parameters as
    finite=None. Eager and compiled. Catches a multiplicative gate on an unmasked gradient (0 * NaN = NaN in the
    momentum), a gate that skips the state, and a guard that reads the flag on the host.
    """
    ws, gs = weights_and_grads(steps=2)
    torch._dynamo.reset()
    try:
        params, opt = run_muon(ws, gs[:1], compiled)
        before = [p.detach().clone() for p in params]
        state_before = [(p, k, v.clone()) for p in params for k, v in opt.state[p].items()]
        for i, p in enumerate(params):
            p.grad = gs[1][i].clone()
            p.grad[0, 0] = float("nan") if i % 2 else float("inf")
        flag = torch.tensor(False)
        if compiled:  # a dispatch mode turns torch.compile off: counted on the eager step only
            opt.step(finite=flag)
        else:
            with HostReads() as mode:
                opt.step(finite=flag)
            assert mode.reads == []
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        assert len(state_before) == 2 * len(params)
        assert all(torch.equal(opt.state[p][k], v) for p, k, v in state_before)
        for finite in (torch.tensor(True), None):
            for p, g in zip(params, gs[1]):
                p.grad = g.clone()
            opt.step(finite=finite)
        with_flag = [p.detach().clone() for p in params]
    finally:
        torch._dynamo.reset()
    params2, opt2 = run_muon(ws, gs[:1])
    for _ in range(2):
        for p, g in zip(params2, gs[1]):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(with_flag, params2):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- shared across ranks
DIST_STEPS = 5


def dist_worker(rank, world, port, out):
    """Rank `rank` of `world`: 5 steps of Muon with process_group (plain tensors, the same gradients on every rank
    as DDP leaves them), and of Muon on DTensors sharded on dim 0 (FSDP2's layout); records the parameters and the
    batch sizes each rank orthogonalised."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from nanotrain.muon import zeropower_via_newtonschulz5
    res = {}
    for mode in ("ddp", "fsdp"):
        ws, gs = weights_and_grads(DIST_STEPS, seed=1)
        mesh = init_device_mesh("cpu", (world,)) if mode == "fsdp" else None
        wrap = (lambda t: distribute_tensor(t, mesh, [Shard(0)])) if mode == "fsdp" else (lambda t: t)
        params = [torch.nn.Parameter(wrap(w.clone())) for w in ws]
        opt = Muon(params, **KW, weight_decay=0.2, process_group=dist.group.WORLD if mode == "ddp" else None)
        sizes = []

        def spy(G, *args):
            sizes.append(G.shape)
            return zeropower_via_newtonschulz5(G, *args)
        opt.fns["zeropower"] = spy
        for step in range(DIST_STEPS):
            for p, g in zip(params, gs[step]):
                p.grad = wrap(g.clone())
            opt.step()
        res[mode] = [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in params]
        res[mode + "_sizes"] = sizes[:3]
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_shared_across_ranks_equals_one_process(tmp_path, world):
    """
    On 2 and 3 gloo ranks, 5 steps of Muon sharing its orthogonalisation (process_group: plain tensors with the same
    gradients on every rank, as under DDP; and DTensor parameters sharded on dim 0, as under FSDP2, with rows that
    do not split evenly: 16 rows over 3 ranks are 6 + 6 + 4, 8 are 3 + 3 + 2) give one process's parameters on
    every rank (fp32 roundoff: relative 1e-5, measured 1.3e-6 after 5 steps), and each rank orthogonalised ceil(n / world) matrices of each stack
    (3 + 2 + 1 matrices in 3 stacks), not all of them. Catches every rank doing the whole stack, a rank taking
    another's chunk or the gathered chunks put back in the wrong order (the matrices would swap updates), padding
    that leaks into the result, and under FSDP2 the rows gathered or cut back wrongly (uneven shards).
    """
    spawn_ranks(dist_worker, (world, free_port(), str(tmp_path)), nprocs=world, timeout_s=280)
    ws, gs = weights_and_grads(DIST_STEPS, seed=1)
    params = [torch.nn.Parameter(w.clone()) for w in ws]
    opt = Muon(params, **KW, weight_decay=0.2)
    for step in range(DIST_STEPS):
        for p, g in zip(params, gs[step]):
            p.grad = g.clone()
        opt.step()
    for rank in range(world):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for mode in ("ddp", "fsdp"):
            for i, (w, p, q) in enumerate(zip(ws, params, res[mode])):
                err = ((q - p.detach()).abs().max() / (p.detach() - w).abs().max()).item()
                assert err < 1e-5, (mode, rank, i, err)
            per = [-(-n // world) for n in (3, 2, 1)]
            assert [s[0] for s in res[mode + "_sizes"]] == per, (mode, res[mode + "_sizes"])
