"""
Tests of nanotrain/osft.py: the SVD bases, and that no update of Muon or AdamW (weight decay on) ever enters the
frozen directions; the bases in the checkpoint (exact resume), 2 gloo ranks equal to 1.
"""

from contextlib import nullcontext

import pytest
import torch
from helpers import tiny_model

from nanotrain.errors import UserError
from nanotrain.optim import setup_optimizers
from nanotrain.osft import OSFT, project
from nanotrain.training import forward_backward, optimizer_step

pytestmark = pytest.mark.unit


def batches(seed, n=2):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randint(0, 64, (2, 16), generator=g), "y": torch.randint(0, 64, (2, 16), generator=g)}
            for _ in range(n)]


def train(model, optimizers, steps, seed=0):
    for s in range(steps):
        forward_backward(model, batches(seed + s), nullcontext())
        optimizer_step(model, optimizers, 1.0, 0.95, 1.0)


def setup(rank_ratio, matrices="attn,mlp,lm_head", attach=True):
    """A tiny GPT with weight decay on in both optimizers (AdamW's lm_head and Muon's cautious decay), OSFT on."""
    model = tiny_model()
    optimizers = setup_optimizers(model, weight_decay=0.1, muon_weight_decay=0.1, unembedding_lr=0.05)
    osft = OSFT(model, rank_ratio, matrices)
    if attach:
        osft.attach(optimizers)
    return model, optimizers, osft


def test_the_bases_are_the_top_singular_vectors():
    """
    U S V^T of each chosen matrix (from the full SVD the bases come from) rebuilds W to fp32 roundoff, the bases are
    orthonormal, k = floor(r * min(m, n)), and they span the top directions: ||U_h^T W V_h|| holds the k largest
    singular values. Catches bases cut from the wrong end (the smallest singular values) or transposed.
    """
    model = tiny_model()
    osft = OSFT(model, 0.5, "attn,mlp,lm_head")
    assert set(osft.bases) == {n for n, _ in model.named_parameters()
                               if n.endswith(("c_q.weight", "c_k.weight", "c_v.weight", "c_proj.weight",
                                              "c_fc.weight")) or n == "lm_head.weight"}
    for name, (u, v) in osft.bases.items():
        w = dict(model.named_parameters())[name].detach()
        U, S, Vh = torch.linalg.svd(w, full_matrices=False)
        assert torch.allclose(U @ torch.diag(S) @ Vh, w, atol=1e-5 * w.abs().max())
        k = int(0.5 * min(w.shape))
        assert u.shape == (w.shape[0], k) and v.shape == (w.shape[1], k)
        assert torch.allclose(u.T @ u, torch.eye(k), atol=1e-5) and torch.allclose(v.T @ v, torch.eye(k), atol=1e-5)
        top = torch.linalg.svdvals(u.T @ w @ v)
        assert torch.allclose(top, S[:k], rtol=1e-4), name


@pytest.mark.parametrize("attach", [True, False], ids=["projected", "projection removed"])
def test_muon_and_adamw_with_weight_decay_never_move_the_frozen_directions(attach):
    """
    Five steps of Muon (the blocks' matrices, cautious weight decay) and AdamW (lm_head, decoupled weight decay):
    the frozen component U_h^T W V_h of every chosen matrix is unchanged to 1e-6 relative, and U_h^T dW and dW V_h
    are at most 1e-5 ||dW||; the free part did move. The same run with the projection removed (the hooks not
    attached) fails these checks: the test can tell.
    """
    model, optimizers, osft = setup(0.5, attach=attach)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, optimizers, 5)
    ok = True
    for name, (u, v) in osft.bases.items():
        w0, w1 = before[name], dict(model.named_parameters())[name].detach()
        dw = w1 - w0
        assert dw.norm() > 1e-3 * w0.norm(), name  # it trained
        frozen = (u.T @ w1 @ v - u.T @ w0 @ v).norm() / (u.T @ w0 @ v).norm()
        left, right = (u.T @ dw).norm() / dw.norm(), (dw @ v).norm() / dw.norm()
        ok &= bool(frozen <= 1e-6 and left <= 1e-5 and right <= 1e-5)
        if attach:
            assert frozen <= 1e-6 and left <= 1e-5 and right <= 1e-5, (name, frozen, left, right)
    assert ok == attach


def test_projection_is_the_orthogonal_complement():
    """project(x) is idempotent, orthogonal to the bases on both sides, and leaves a matrix already in the
    complement unchanged. Catches a one-sided projection (only I - U U^T)."""
    g = torch.Generator().manual_seed(0)
    u = torch.linalg.qr(torch.randn(12, 4, generator=g))[0]
    v = torch.linalg.qr(torch.randn(8, 3, generator=g))[0]
    x = torch.randn(12, 8, generator=g)
    px = project(x, u, v)
    assert torch.allclose(project(px, u, v), px, atol=1e-6)
    assert (u.T @ px).abs().max() < 1e-5 and (px @ v).abs().max() < 1e-5
    assert not torch.allclose(x - u @ (u.T @ x), px, atol=1e-3)


def test_resume_with_the_saved_bases_is_exact():
    """
    3 + 3 steps, the second three with a new OSFT built from state_dict() (as a resume loads it) and the optimizer
    states carried over, equal 6 straight steps bit for bit. Catches a resume that recomputes the SVD from the
    trained weights (other bases: the result differs).
    """
    model, optimizers, osft = setup(0.5)
    train(model, optimizers, 6)
    straight = {n: p.detach().clone() for n, p in model.named_parameters()}

    model, optimizers, osft = setup(0.5)
    train(model, optimizers, 3)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = [o.state_dict() for o in optimizers]
    saved = osft.state_dict()
    for fresh_bases in (False, True):
        model2 = tiny_model()
        model2.load_state_dict(weights)
        opts2 = setup_optimizers(model2, weight_decay=0.1, muon_weight_decay=0.1, unembedding_lr=0.05)
        for o, s in zip(opts2, states):
            o.load_state_dict(s)
        osft2 = OSFT(model2, 0.5, "attn,mlp,lm_head", state=None if fresh_bases else saved)
        osft2.attach(opts2)
        train(model2, opts2, 3, seed=3)
        same = all(torch.equal(straight[n], p) for n, p in model2.named_parameters())
        assert same == (not fresh_bases)


def test_a_state_for_other_settings_is_refused():
    model = tiny_model()
    saved = OSFT(model, 0.5).state_dict()
    with pytest.raises(UserError, match="rank_ratio"):
        OSFT(model, 0.25, state=saved)
    with pytest.raises(UserError, match="osft_matrices"):
        OSFT(model, 0.5, "attn,embeddings")


# ----------------------------------------------------------------------------- 2 gloo ranks

def _ddp_worker(rank, world, port, out_dir, mode):
    import os

    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = tiny_model()
    if mode == "fsdp":
        from nanotrain.fsdp import shard_model
        model = shard_model(model, torch.device("cpu"), torch.float32)
    optimizers = setup_optimizers(model, weight_decay=0.1, muon_weight_decay=0.1, unembedding_lr=0.05,
                                  ns_dtype="float32")
    osft = OSFT(model, 0.5, "attn,mlp,lm_head")
    osft.attach(optimizers)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if mode == "ddp" and world > 1 else model
    for s in range(3):
        rows = [b for b in batches(s, 4)][rank::world]  # rank r takes every world-th micro-batch of the step
        forward_backward(ddp, rows, nullcontext())
        optimizer_step(model, optimizers, 1.0, 0.95, 1.0)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in model.named_parameters()}
    torch.save({"bases": osft.state_dict()["bases"], "params": params},
               os.path.join(out_dir, f"{mode}_rank{rank}_of{world}.pt"))
    dist.destroy_process_group()


@pytest.mark.dist
@pytest.mark.slow  # ~15 s; the single-process projection math stays in the default tier (tests above)
@pytest.mark.timeout(300)
def test_two_gloo_ranks_equal_one_under_ddp_and_fsdp(tmp_path):
    """
    3 OSFT steps (Muon in fp32 with cautious weight decay, AdamW's lm_head with weight decay) in 1 process on all
    micro-batches, and on 2 gloo ranks (each half of them) under DDP and under FSDP2 (parameters sharded on dim 0):
    the bases are bitwise equal on every rank and mode (computed on rank 0 and broadcast; under FSDP2 from the
    gathered matrix), each mode's two replicas are bitwise equal, every run equals the 1-process weights to fp32
    roundoff, and the frozen components U_h^T W V_h are unchanged under FSDP2 too. Catches bases that differ between
    ranks, a projection applied to a gradient shard as if it were the whole matrix, and a projection before DDP's
    gradient average.
    """
    import socket

    import torch.multiprocessing as mp
    for world, mode in ((1, "one"), (2, "ddp"), (2, "fsdp")):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_ddp_worker, args=(world, port, str(tmp_path), mode), nprocs=world, join=True)
    one = torch.load(tmp_path / "one_rank0_of1.pt", weights_only=True)
    start = dict(tiny_model().named_parameters())
    for mode in ("ddp", "fsdp"):
        r0, r1 = (torch.load(tmp_path / f"{mode}_rank{r}_of2.pt", weights_only=True) for r in (0, 1))
        for name, (u, v) in r0["bases"].items():
            assert torch.equal(u, r1["bases"][name][0]) and torch.equal(v, r1["bases"][name][1]), (mode, name)
            assert torch.equal(u, one["bases"][name][0]) and torch.equal(v, one["bases"][name][1]), (mode, name)
            w0, w1 = start[name].detach(), r0["params"][name]
            assert (u.T @ (w1 - w0) @ v).norm() <= 1e-6 * (u.T @ w0 @ v).norm(), (mode, name)
        for name, p in r0["params"].items():
            assert torch.equal(p, r1["params"][name]), (mode, name)
            assert (p - one["params"][name]).norm() <= 1e-5 * p.norm(), (mode, name)


# ----------------------------------------------------------------------------- the stages end to end

SFT_ARGS = ["--dtype=float32", "--examples_per_step=8", "--max_tokens_per_device=256", "--eval_examples=32",
            "--keep_last=0", "--init_lr_frac=0.5", "--tasks=arith:0.3,spell:0.3,identity:0.5", "--eval_every=-1",
            "--num_iterations=12", "--osft_rank_ratio=0.5", "--osft_matrices=attn,mlp,lm_head"]


@pytest.fixture(scope="module")
def osft_base(shared_base_dir, tmp_path_factory):
    """A base dir with the shared corpus and tokenizer and a 3-step tiny base model (run "tiny")."""
    import os

    from helpers import TINY_TRAIN, run_script
    base = tmp_path_factory.mktemp("osft_base")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=3", "--run_name=tiny", base_dir=base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base


@pytest.mark.smoke
@pytest.mark.slow  # ~25 s; the same resume in-process is test_resume_with_the_saved_bases_is_exact (default tier)
def test_chat_sft_with_osft_resumes_exactly_after_sigterm(osft_base):
    """
    chat_sft with OSFT on: a straight 12-step run, and a run stopped by SIGTERM at step >= 5 then resumed with
    --resume=True, end with bitwise the same weights; the checkpoint holds osft.pt and the frozen component of the
    final weights equals the source model's; the exported state (model.pt) has exactly the plain model's tensors.
    Catches bases recomputed on resume, a checkpoint without the bases, and a model.pt carrying extra factors.
    """
    import os
    import signal
    import subprocess
    import sys

    from helpers import REPO, run_script

    from nanotrain.checkpoint import load_latest
    r = run_script("chat_sft.py", *SFT_ARGS, "--source=base", "--source_run_name=tiny", "--run_name=straight",
                   "--save_every=-1", base_dir=osft_base)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "OSFT: " in r.stdout and "frozen" in r.stdout
    cut = [*SFT_ARGS, "--source=base", "--source_run_name=tiny", "--run_name=cut", "--save_every=-1"]
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(osft_base), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "chat_sft.py"), *cut],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith("step 00005/"):
            p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0, "".join(out)[-3000:]
    assert "Stopped at step " in "".join(out)
    r = run_script("chat_sft.py", *cut, "--resume=True", base_dir=osft_base)
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_latest(str(osft_base / "sft" / "straight"), "cpu")
    b = load_latest(str(osft_base / "sft" / "cut"), "cpu")
    assert a["meta"]["step"] == b["meta"]["step"] == 12
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert b["osft"] is not None and os.path.exists(os.path.join(b["path"], "osft.pt"))
    src = load_latest(str(osft_base / "base" / "tiny"), "cpu", load_optimizer=False)
    assert set(a["model"]) == set(src["model"])  # a plain model: no factor tensors
    for name, (u, v) in a["osft"]["bases"].items():
        w0, w1 = src["model"][name].float(), a["model"][name].float()
        assert (u.T @ (w1 - w0) @ v).norm() <= 1e-5 * (u.T @ w0 @ v).norm(), name


@pytest.mark.smoke
@pytest.mark.slow  # ~6 s; the default run checks --help itself (test_configurator.py::test_script_override_and_help)
def test_the_flag_is_in_both_stages_help():
    """--help of mid_train and chat_sft lists osft_rank_ratio and osft_matrices with their ranges."""
    import subprocess
    import sys

    from helpers import REPO
    for script in ("mid_train.py", "chat_sft.py"):
        r = subprocess.run([sys.executable, f"scripts/{script}", "--help"], capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 0 and "osft_rank_ratio" in r.stdout and "osft_matrices" in r.stdout, r.stdout[-2000:]
