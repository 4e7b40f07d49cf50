"""
The gpu tier: the CUDA paths of training and chat, one test per path, each naming the path it pins ("Pins:") and the
wrong implementation it catches. Skipped without CUDA. The oracles are the CPU paths (pinned in the default tier)
or an independent formula. Paths pinned elsewhere in the gpu tier: flash-attn against SDPA, the KV-cache path
under bf16 and fused AdamW + bf16 Muon running (test_gpt.py::test_cuda_bf16_paths), flash-attn's varlen kernel on
packed rows (test_packing.py), bf16 autocast keeping fp32 master weights, gradients and optimizer state on CUDA
(test_precision.py), a real allocator OOM and 20 training steps at a found size under the margin
(test_auto_batch_size.py). runs/gpu_check.sh runs this tier and the depth-20 run on a real card.
"""

import contextlib
import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import rel, tiny_model
from test_engine import prompts_for, random_model, tok, tool_model  # noqa: F401 (tok, tool_model: fixtures)

import nanotrain.attention as attention_module
from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.probe import GiB
from nanotrain.auto_batch_size.search import discover_device_batch_size
from nanotrain.auto_batch_size.stepdown import OOMStepDown
from nanotrain.common import compute_init
from nanotrain.dataloader import TokenLoader
from nanotrain.engine import Engine
from nanotrain.export.safetensors_file import export_safetensors, load_safetensors
from nanotrain.fsdp import shard_model
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.kernels import linear_cross_entropy
from nanotrain.optim import setup_optimizers
from nanotrain.training import forward_backward, micro_batches, optimizer_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def autocast(dtype):
    """base_train's autocast context for "bf16" on CUDA, or none for "fp32"."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if dtype == "bf16" else contextlib.nullcontext()


@pytest.fixture(autouse=True)
def full_fp32_matmuls(monkeypatch):
    """fp32 matmuls in full fp32 (TF32 off) whatever an earlier test's compute_init turned on: the fp32 tolerances
    below are fp32's, not TF32's (10-bit mantissa)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


def gqa_model(seed=0):
    """tiny_model's sizes with 4 query heads sharing 1 key/value head (GQA) and every weight nonzero, on the CPU."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=2, n_head=4, n_kv_head=1, model_dim=64))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "c_proj" in name or "lm_head" in name:
                p.normal_(0, 0.05)
    return model


def batch(seed, rows=4, seq=16, vocab=64, device="cpu"):
    """Random (inputs, targets) int64 (rows, seq), targets the inputs shifted by one, seeded."""
    x = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return x[:, :-1].contiguous().to(device), x[:, 1:].contiguous().to(device)


def full_grads(model):
    """Every gradient as one flat CPU tensor (DTensor shards gathered)."""
    return torch.cat([(p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten().cpu()
                      for p in model.parameters()])


def full_params(model):
    return torch.cat([(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().cpu()
                      for p in model.parameters()])


def test_sdpa_on_cuda_matches_cpu_and_is_causal(monkeypatch):
    """
    Pins: SDPA on CUDA (flash-attn hidden), fp32 and bf16 autocast, with GQA (enable_gqa). The logits equal the CPU
    model's (fp32: 1e-4; bf16: bf16 rounding), and changing the last token changes no earlier position's logits.
    Catches a CUDA kernel run without the causal mask (earlier positions would see the last token), a GQA head
    mapping that differs from the CPU path's, and a (B, T, H, D) / (B, H, T, D) layout mix-up on CUDA.
    """
    monkeypatch.setattr(attention_module, "flash_attn_func", None)
    model = gqa_model()
    x, _ = batch(0)
    with torch.no_grad():
        want = model(x)
        cuda_model = copy.deepcopy(model).to(CUDA)
        x2 = x.clone()
        x2[:, -1] = (x2[:, -1] + 1) % 64
        for dtype, tol in (("fp32", 1e-4), ("bf16", 5e-2)):
            with autocast(dtype):
                got, got2 = cuda_model(x.to(CUDA)).float().cpu(), cuda_model(x2.to(CUDA)).float().cpu()
            torch.testing.assert_close(got, want, atol=tol, rtol=tol)
            torch.testing.assert_close(got2[:, :-1], got[:, :-1], atol=1e-5, rtol=0)
            assert (got2[:, -1] - got[:, -1]).abs().max() > 1e-3  # the last position does see its token


def test_compiled_model_and_step_equal_eager_on_cuda():
    """
    Pins: torch.compile of the model (dynamic=False, as base_train and bench compile it) on CUDA, forward and backward
    (the chunked head loss and the ReLU² projection's own autograd Functions traced), and base_train's step on it:
    forward_backward over 2 micro-batches under bf16 autocast, then optimizer_step (Muon + fused AdamW) on the
    uncompiled module, 3 steps. Losses and gradients equal the eager run's within bf16 rounding; the trained weights
    are compared through the loss they give (fp32, eager, on the steps' own rows), which is within a tenth of what
    training lowered it by. Not entry by entry: the first AdamW and Muon updates are sign-like, so a weight whose
    gradient lies within bf16 rounding of 0 may move by +lr in one run and -lr in the other, which changes the loss
    little (its gradient is ~0) but the weights by up to lr each. Catches a mis-traced custom autograd Function
    (wrong gradients), a compiled wrapper whose parameters are not the ones the optimizers update (the compiled run
    would not lower the loss), and a graph that drops the soft-cap.
    """
    runs = {}
    for compiled in (False, True):
        model = gqa_model().to(CUDA)
        optimizers = setup_optimizers(model)
        fwd = torch.compile(model, dynamic=False) if compiled else model
        losses, grad0 = [], None
        for step in range(3):
            x, y = batch(step, rows=4, device=CUDA)
            losses.append(forward_backward(fwd, micro_batches(x, y, 2), autocast("bf16")).item())
            grad0 = full_grads(model) if grad0 is None else grad0
            optimizer_step(model, optimizers, 1.0, 0.95, 1.0)
        runs[compiled] = losses, grad0, full_params(model)
    (le, ge, pe), (lc, gc, pc) = runs[False], runs[True]
    assert all(abs(a - b) <= 1e-2 * abs(a) for a, b in zip(le, lc)), (le, lc)
    assert rel(gc, ge) < 5e-2

    def loss_of(params):  # the mean fp32 loss of the 3 steps' rows under these weights
        model = gqa_model().to(CUDA)
        torch.nn.utils.vector_to_parameters(params.to(CUDA), model.parameters())
        with torch.no_grad():
            return sum(model(*batch(step, rows=4, device=CUDA)).item() for step in range(3)) / 3
    start, eager, compiled = loss_of(full_params(gqa_model())), loss_of(pe), loss_of(pc)
    assert start - eager > 0.05, (start, eager)
    assert abs(compiled - eager) < 0.1 * (start - eager), (start, eager, compiled)


@pytest.mark.parametrize("dtype,tol", [("fp32", 1e-4), ("bf16", 2e-2)])
def test_chunked_softcap_loss_compiled_on_cuda_equals_full_logits(dtype, tol):
    """
    Pins: nanotrain.kernels.linear_cross_entropy (the chunked linear + soft-cap cross-entropy, 128-token chunks)
    under torch.compile on CUDA, fp32 and bf16 autocast. Its loss and gradients equal F.cross_entropy of the full fp32
    logits 15·tanh(h Wᵀ / 15) (ignored targets -1) within `tol`; the same logits without the soft-cap give a loss
    farther off than that. Catches a compiled chunk loop that drops a chunk, the soft-cap's derivative or the ignored
    targets, or reduces in bf16.
    """
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 64, generator=g).to(CUDA).requires_grad_()
    weight = (0.5 * torch.randn(1000, 64, generator=g)).to(CUDA).requires_grad_()  # logits ~4: the cap matters
    targets = torch.randint(0, 1000, (300,), generator=g)
    targets[::7] = -1
    targets = targets.to(CUDA)
    fn = torch.compile(lambda h, w: linear_cross_entropy(h, w, targets, softcap=15.0, chunk_size=128), dynamic=False)
    with autocast(dtype):
        loss = fn(hidden, weight)
    got = (loss, *torch.autograd.grad(loss, (hidden, weight)))
    logits = hidden.float() @ weight.float().T
    want_loss = F.cross_entropy(15 * torch.tanh(logits / 15), targets, ignore_index=-1)
    want = (want_loss, *torch.autograd.grad(want_loss, (hidden, weight)))
    assert loss.dtype == torch.float32
    assert abs(got[0] - want[0]) <= tol * want[0] and rel(got[1], want[1]) < tol and rel(got[2], want[2]) < tol
    nocap = F.cross_entropy(logits, targets, ignore_index=-1)
    assert abs(nocap - want[0]) > 5 * tol * want[0]


@pytest.mark.parametrize("ns_dtype,tol", [("float32", 1e-3), ("", 5e-2)], ids=["ns_fp32", "ns_default_bf16"])
def test_muon_and_fused_adamw_on_cuda_step_like_cpu(ns_dtype, tol):
    """
    Pins: Muon (Polar Express Newton–Schulz on CUDA, fp32 and CUDA's default bf16) and fused AdamW (CUDA's default)
    on the same gradients as the CPU optimizers (fp32 Newton–Schulz, torch's default AdamW): every parameter's update
    equals the CPU update within `tol` relative. Catches the fused path applying weight decay or bias correction
    differently, Muon's CUDA orthogonalisation scaled or shaped differently (a transposed update for a wide matrix),
    and bf16 Newton–Schulz drifting beyond bf16 rounding.
    """
    cpu = tiny_model()
    cuda = copy.deepcopy(cpu).to(CUDA)
    x, y = batch(2)
    cpu(x, y).backward()
    for pc, pg in zip(cpu.parameters(), cuda.parameters()):
        pg.grad = pc.grad.to(CUDA)
    before = [p.detach().clone() for p in cpu.parameters()]
    cpu_opts = setup_optimizers(cpu, ns_dtype="float32", weight_decay=0.01, muon_weight_decay=0.1)
    cuda_opts = setup_optimizers(cuda, ns_dtype=ns_dtype, weight_decay=0.01, muon_weight_decay=0.1)
    assert cuda_opts[0].defaults["fused"] and cuda_opts[1].__class__.__name__ == "Muon"
    for opt in cpu_opts + cuda_opts:
        opt.step()
    moved = 0
    for (name, pc), pg, b in zip(cpu.named_parameters(), cuda.parameters(), before):
        dc, dg = pc.detach() - b, pg.detach().cpu() - b
        if dc.norm() > 0:
            moved += 1
            assert rel(dg, dc) < tol, name
    assert moved >= len(before) - 2  # (a zero-initialised gate may get no gradient at step 0)


def test_ddp_and_fsdp2_on_nccl_at_one_rank(tmp_path):
    """
    Pins: NCCL at one rank: DDP on CUDA (forward_backward's no_sync on the first micro-batch, the all-reduce on the
    last) and FSDP2 (nanotrain.fsdp.shard_model: blocks then root, fp32 policy; set_requires_gradient_sync; Muon's
    all-gather of each update) through base_train's step. Loss, gradients and the weights after optimizer_step equal
    the unwrapped model's (1e-5 relative). Catches a DDP/FSDP2 gradient divided or summed twice, a sharded Muon
    update applied to the wrong rows, and NCCL paths that only run under torchrun.
    """
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        x, y = batch(3, rows=4, device=CUDA)
        results = {}
        for kind in ("plain", "ddp", "fsdp"):
            model = tiny_model().to(CUDA)
            if kind == "fsdp":
                model = shard_model(model, CUDA, torch.float32)
            optimizers = setup_optimizers(model)
            wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0]) if kind == "ddp" else model
            loss = forward_backward(wrapped, micro_batches(x, y, 2), autocast("fp32")).item()
            g = full_grads(model)
            optimizer_step(model, optimizers, 1.0, 0.95, 1.0)
            results[kind] = loss, g, full_params(model)
        loss, g, p = results["plain"]
        for kind in ("ddp", "fsdp"):
            lk, gk, pk = results[kind]
            assert abs(lk - loss) <= 1e-5 * loss and rel(gk, g) < 1e-5 and rel(pk, p) < 1e-5, kind
        assert rel(p, full_params(tiny_model())) > 1e-3  # the step moved the weights
    finally:
        dist.destroy_process_group()


def test_real_cuda_oom_in_discovery_and_the_step_down(monkeypatch, tmp_path):
    """
    Pins: the automatic batch size on CUDA with real probes under an emulated 0.5 GiB card (the allocator capped at
    margin x budget): larger candidates hit a real torch.OutOfMemoryError (recorded "OOM") and the size found is
    below every OOM size. Then the training-time step-down, under the same cap:
    OOMStepDown.forward_backward from the largest OOM size steps down (a real OOM each time) to a size that fits and returns the loss and
    gradients of a clean forward_backward at that size on the same rows (bf16: 1e-3 relative), recording one
    [step, old, new] step-down. Catches partial gradients of the failed attempt left in .grad (they would add up),
    rows dropped on the retry, an OOM that escapes or leaves memory allocated, and a step-down that never stops.
    """
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    config = GPTConfig(max_seq_len=1024, vocab_size=8192, n_layer=4, n_head=2, n_kv_head=2, model_dim=256)
    build = gpt_builder(config)
    gb, margin = 0.5, 0.85
    found, record = discover_device_batch_size(build, max_seq_len=1024, vocab_size=8192, total_batch_size=1024 * 64,
                                               world_size=1, device=CUDA, amp_dtype=torch.bfloat16, compile=False,
                                               margin=margin, device_memory_gb=gb, use_cache=False, key_fields={})
    oom_sizes = [p["batch_size"] for p in record["probes"] if p["result"] == "OOM"]
    assert oom_sizes and found < min(oom_sizes), record["probes"]
    dev = compute_init("cuda")[4]  # cuda:<index>, as a script gets it (the memory-fraction API needs the index)
    total = torch.cuda.get_device_properties(dev).total_memory
    prev = torch.cuda.get_per_process_memory_fraction(dev)
    torch.cuda.set_per_process_memory_fraction(margin * gb * GiB / total, dev)
    try:
        model, _ = build(CUDA)
        big = max(oom_sizes)  # far over the cap even without optimizer state (none is allocated here)
        x, y = batch(5, rows=big, seq=1024, vocab=8192, device=CUDA)
        log = []
        step_down = OOMStepDown(record, None, big, log=log.append)
        loss = step_down.forward_backward(model, x, y, autocast("bf16"), step=7).item()
        small = step_down.device_batch_size
        g = full_grads(model)
        model.zero_grad(set_to_none=True)
        want = forward_backward(model, micro_batches(x, y, small), autocast("bf16")).item()
        assert small < big and record["step_downs"] == [[7, big, small]] and log
        assert abs(loss - want) <= 1e-3 * want and rel(g, full_grads(model)) < 1e-3
    finally:
        torch.cuda.set_per_process_memory_fraction(prev, dev)
        torch.cuda.empty_cache()


def test_pinned_loader_on_cuda_equals_cpu_under_gpu_load(byte_tokenizer, tmp_path):
    """
    Pins: TokenLoader on CUDA: rows in pinned host memory, one non-blocking copy each, a prefetch thread (1 batch
    ahead, the CUDA default). 60 batches equal the CPU loader's (no thread) bit for bit while the GPU is kept busy
    between them (so a copy still in flight when its host buffer is reused would show). Catches a pinned buffer
    recycled before its asynchronous copy finished, and rows or targets shifted on the CUDA path.
    """
    g = torch.Generator().manual_seed(0)
    docs = ["".join(chr(97 + int(c)) for c in torch.randint(0, 26, (int(n),), generator=g))
            for n in torch.randint(5, 200, (300,), generator=g)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    cpu = TokenLoader(byte_tokenizer, [str(path)], 8, 64, "cpu", prefetch=0)
    cuda = TokenLoader(byte_tokenizer, [str(path)], 8, 64, CUDA)
    assert cuda.prefetch == 1
    busy = torch.randn(2048, 2048, device=CUDA)
    for _ in range(60):
        busy = busy @ busy / busy.norm()  # queued work ahead of the copy
        (xg, yg), (xc, yc) = cuda.next_batch(), cpu.next_batch()
        assert xg.is_cuda and torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)
    cuda.close()
    cpu.close()


def test_kv_cache_and_calculator_tool_on_cuda(tok, tool_model):  # noqa: F811 (fixtures from test_engine)
    """
    Pins: the engine on CUDA: KV-cache generation (prefill, decode, a batch of prompts) and the calculator tool's
    forced tokens written into the CUDA cache. The tool model (trained in test_engine.py on a scripted tool call
    with a wrong output) produces on CUDA exactly the CPU engine's tokens and masks (the forced "5" with mask 0),
    and a random model's cached greedy generation equals a no-cache argmax loop on CUDA, in fp32. Catches forced
    tokens or the cache position built on the wrong device, and rotary positions or cache slots off by one on CUDA.
    """
    s, prompt_a, prompt_b, _, model = tool_model
    want = Engine(model, tok).sample([prompt_a, prompt_b], max_tokens=30, tool=True)
    got = Engine(copy.deepcopy(model).to(CUDA), tok).sample([prompt_a, prompt_b], max_tokens=30, tool=True)
    assert got == want
    forced = [s["<|output_start|>"]] + tok.encode("5") + [s["<|output_end|>"]]
    ids_a = got[0][0]
    assert any(ids_a[i:i + len(forced)] == forced for i in range(len(ids_a)))
    random = random_model(tok).to(CUDA)
    stop = {tok.encode_special("<|assistant_end|>"), tok.get_bos_token_id()}
    with torch.no_grad():
        for prompt in prompts_for(tok):
            seq, expected = list(prompt), []
            for _ in range(20):
                nxt = random(torch.tensor([seq], device=CUDA))[0, -1].argmax().item()
                if nxt in stop:
                    break
                seq.append(nxt)
                expected.append(nxt)
            assert Engine(random, tok).generate([prompt], max_tokens=20)[0] == expected


def test_export_from_cuda_reloads_with_equal_logits(tmp_path):
    """
    Pins: export of a CUDA model (through its torch.compile wrapper: "_orig_mod." names) to safetensors, and the
    reload onto CUDA: the logits equal the original's (1e-6) and the reloaded weights are on CUDA in fp32. Catches
    tensors written from device memory without the copy to the host, a wrapper's prefixes kept, and a reload that
    leaves the rotary buffers on the CPU.
    """
    model = tiny_model().to(CUDA)
    path = tmp_path / "model.safetensors"
    export_safetensors(torch.compile(model), model.config, str(path))
    loaded, _ = load_safetensors(str(path), device=CUDA)
    x, _ = batch(4, device=CUDA)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), atol=1e-6, rtol=1e-6)
    assert {(p.device.type, p.dtype) for p in loaded.parameters()} == {("cuda", torch.float32)}
    assert loaded.cos.is_cuda
