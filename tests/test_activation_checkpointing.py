"""
Activation checkpointing (GPT.activation_checkpointing, --activation_checkpointing=none|selective|full|auto;
nanotrain.gpt): same loss and gradients under every policy, less memory (measured with the
fake-tensor MemTracker probe of nanotrain.auto_batch_size) in the order none > selective > full, selective recomputing no
matmul FLOPs (counted), plan mode's estimate against a real CPU step per policy, a larger discovered device_batch_size
under the same budget, a cache entry of its own, auto's choice, and the same losses in base_train.
"""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import TINY_TRAIN, run_script

from nanotrain.attention import KVCache
from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.probe import GiB, measure_fake_peak
from nanotrain.auto_batch_size.search import discover_device_batch_size
from nanotrain.gpt import GPT, GPTConfig, config_from_depth

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
@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "doc_ids"])
def test_same_loss_and_gradients(packed, policy):
    """
    Checkpointed (full and selective) and plain training steps give the same fp32 loss and gradients (max
    relative difference <= 1e-6 per parameter), with plain rows and with doc_ids packing (the block-diagonal mask and
    per-segment rotary positions must be the ones of the recomputation too). Catches a checkpoint wrapper that
    detaches the block input: its loss is identical but the gradients of the embedding and all lower blocks vanish;
    the test runs that variant and asserts it fails the same tolerance.
    """
    idx, targets, doc_ids = batch()
    doc_ids = doc_ids if packed else None
    model = tiny_model()
    loss0, g0 = loss_and_grads(model, model, idx, targets, doc_ids)
    model.activation_checkpointing = policy
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
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_same_gradients_under_torch_compile(policy):
    """
    torch.compile(fullgraph=True) of the checkpointed model with packed rows (dynamo traces torch.utils.checkpoint
    into its checkpoint higher-order op, with selective checkpointing's context_fn; aot_eager runs AOT autograd's
    joint graph and partitioner without the slow C++ codegen) gives the eager gradients within 1e-6. Catches a graph
    break or an error on the checkpoint path (the reentrant variant, use_reentrant=True, is not traceable by dynamo
    in one graph, nor is a context_fn that is not create_selective_checkpoint_contexts) and a recomputation that sees
    other inputs than the forward.
    """
    idx, targets, doc_ids = batch()
    model = tiny_model()
    loss0, g0 = loss_and_grads(model, model, idx, targets, doc_ids)
    model.activation_checkpointing = policy
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
    model.activation_checkpointing = "full"
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
    With activation_checkpointing="full", a forward with a KV cache (here even in training mode with grad enabled)
    still fills and reads the cache: prefill + one decode step give the logits of the full forward, and eval/
    no_grad forwards equal the plain ones. Catches checkpointing that passes kv_cache=None to the blocks (the
    cache stays empty and the decode step sees no prefix).
    """
    model = tiny_model()
    idx, _, _ = batch()
    idx = idx[:1, :9]
    full = model(idx).detach()
    model.activation_checkpointing = "full"
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
    step, 1 micro-step) at depth 4, max_seq_len 256, device_batch_size 8: full at most 65% of the plain step's
    (measured ~60% at vocab 512; 55% without value embeddings, smear, backout and lambdas), selective in between,
    below 90% of the plain step's (the elementwise activations it drops: norms, rotary, casts, ReLU^2) and above
    full's (the matmul outputs it keeps). Catches a flag that the builder ignores (the probes would measure the
    plain model), checkpointing that still saves the blocks' inner activations (e.g. checkpoint only around the
    attention), and a selective policy that keeps everything (no saving) or nothing (full's memory).
    """
    config = config_from_depth(4, 512, 256)
    peaks = {ac: measure_fake_peak(gpt_builder(config, activation_checkpointing=ac), 8, max_seq_len=256,
                                   vocab_size=512) for ac in ("none", "selective", "full")}
    assert peaks["full"] <= 0.65 * peaks["none"], peaks
    assert peaks["full"] < peaks["selective"] <= 0.9 * peaks["none"], peaks


@pytest.mark.unit
def test_recompute_flops_are_counted(monkeypatch):
    """
    recompute_flops (torch.utils.flop_counter on fake tensors, depth 2, max_seq_len 64): selective recomputes no
    matmul or attention FLOP (exactly 0 extra), full recomputes the blocks' forward: 2 of the 6 FLOPs per weight of
    the blocks' matmuls plus the attention's forward, which at this size is between 20% and 33% of the step (33% if
    the head were recomputed too; hand count: blocks 2 x 12 d^2 weights, head 2 x 512 d, T = 64). The wrong variant,
    a selective policy that keeps no matmul output (SAVED_ATEN_OPS emptied), must count full's recomputation.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    import nanotrain.gpt as recompute

    def count(policy):
        with FakeTensorMode():
            model = GPT(config_from_depth(2, 512, 64))
            model.init_weights()
            model.activation_checkpointing = policy
            return recompute.recompute_flops(model, 2, 64)

    (sel, base), (full, base_full) = count("selective"), count("full")
    assert sel == 0.0 and base == base_full > 0
    d = 128
    blocks, head = 2 * 12 * d * d, 512 * d
    attention = 2 * 2 * 64 * d  # per token and layer: scores and values, 2 FLOPs per multiply-add, causal not halved
    assert abs(full - (2 * blocks + 2 * attention) / (6 * (blocks + head) + 6 * attention)) < 0.02, full
    monkeypatch.setattr(recompute, "SAVED_ATEN_OPS", frozenset())
    wrong, _ = count("selective")
    assert wrong == pytest.approx(full)


@pytest.mark.unit
@pytest.mark.parametrize("policy", ["selective", pytest.param("none", marks=pytest.mark.slow),
                                    pytest.param("full", marks=pytest.mark.slow)])
# slow cells: the default run keeps selective here and test_auto_batch_size's test_fake_peak_equals_a_real_cpu_step
def test_plan_estimate_matches_a_real_cpu_step(policy):
    """
    Plan mode's estimate (measure_fake_peak: FakeTensorMode, bf16 autocast, as scripts/auto_batch_plan.py measures)
    is within 10% of the peak of the same step run for real on the CPU (RealProbe: real tensors, the MemTracker
    accounting the project uses for CPU steps, test_auto_batch_size's test_fake_peak_equals_a_real_cpu_step), for
    each policy (measured: equal to the byte). Catches a fake path in which selective checkpointing caches other
    tensors than a real run (e.g. a policy that sees different ops under FakeTensorMode) or the builder's policy not
    reaching the model.
    """
    from nanotrain.auto_batch_size.probe import RealProbe
    config = config_from_depth(2, 256, 64)
    build = gpt_builder(config, activation_checkpointing=policy)
    torch.manual_seed(0)
    fake = measure_fake_peak(build, 4, max_seq_len=64, vocab_size=256, amp_dtype=torch.bfloat16)
    with RealProbe(build, "cpu", 64, 256, torch.bfloat16, 1, log=lambda *a: None) as probe:
        real, oom, _ = probe.measure(4)
    assert not oom and abs(fake - real) <= 0.1 * real, (fake, real)


@pytest.mark.unit
def test_policy_names():
    """The names pass; auto only where allowed; True/False (the setting's old bool meaning, removed) and anything else
    is one UserError line naming the flag."""
    from nanotrain.errors import UserError
    from nanotrain.gpt import policy_name
    assert [policy_name(v) for v in ("none", "selective", "full")] == ["none", "selective", "full"]
    assert policy_name("auto", allow_auto=True) == "auto"
    for bad, kwargs in (("auto", {}), ("partial", {}), (1, {}), ("Selective", {"allow_auto": True}), (True, {}),
                        ("False", {})):
        with pytest.raises(UserError, match="--activation_checkpointing=.*expected none|selective|full"):
            policy_name(bad, **kwargs)


@pytest.mark.unit
def test_auto_choice_rule():
    """choose_policy by hand, with the plan-mode sizes of depths 12 and 20 on 80 GB. A wished size (discovery): the
    cheapest policy recomputing <= 15% that reaches it, else the largest size among those (cheapest on a tie), else
    the cheapest that fits at all; a required size (given device_batch_size): the cheapest reaching it, at any
    cost. Catches "largest size wins" (full, 128 rows for 27% more FLOPs at depth 20; 256 at depth 12 for 21%) and
    "cheapest that fits wins" (none, 16 rows, where selective gives 32 at no extra FLOP)."""
    from nanotrain.auto_batch_size.policy import choose_policy
    d20 = {"none": (16, 0.0), "selective": (32, 0.0), "full": (128, 0.27)}
    d12 = {"none": (64, 0.0), "selective": (64, 0.0), "full": (256, 0.21)}
    assert choose_policy(d20, 256) == "selective" and choose_policy(d20, 128) == "selective"
    assert choose_policy(d20, 16) == "none" and choose_policy(d20, 32) == "selective"
    assert choose_policy(d12, 256) == "none"
    assert choose_policy(d20, 128, required=True) == "full" and choose_policy(d20, 256, required=True) is None
    assert choose_policy(d20, 32, required=True) == "selective"
    assert choose_policy({"none": (None, 0.0), "selective": (None, 0.0), "full": (2, 0.27)}, 256) == "full"
    assert choose_policy({"none": (None, 0.0), "selective": (None, 0.0), "full": (None, 0.27)}, 256) is None


@pytest.mark.unit
def test_auto_discovers_selective_where_none_does_not_fit(tmp_path, monkeypatch):
    """
    discover_with_policy("auto") with a budget in which device_batch_size 16 fits with selective checkpointing but
    not without (as measured first): chooses selective at 16 (the size the step needs: 16 rows per step) and stops
    there (full is never probed), records the policy, its counted recompute (0.0) and every policy tried, and
    writes the chosen discovery's record. Catches auto that returns the first discovery's policy or size, or keeps
    the last policy tried.
    """
    from nanotrain.auto_batch_size.policy import discover_with_policy
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    config = config_from_depth(2, 512, 64)
    peak16 = {ac: measure_fake_peak(gpt_builder(config, activation_checkpointing=ac), 16, max_seq_len=64,
                                    vocab_size=512) for ac in ("none", "selective")}
    assert peak16["none"] > 1.01 * peak16["selective"]
    lines = []
    record_path = str(tmp_path / "auto_batch_size.json")
    policy, size, record = discover_with_policy(
        lambda p: gpt_builder(config, activation_checkpointing=p), "auto", max_seq_len=64, vocab_size=512,
        total_batch_size=64 * 16, world_size=1, device="cpu", margin=1.0, key_fields={}, log=lines.append,
        device_memory_gb=1.005 * peak16["selective"] / GiB, record_path=record_path)
    assert (policy, size) == ("selective", 16)
    assert record["activation_checkpointing"] == "selective" and record["recompute_flops"] == 0.0
    assert record["policies"]["none"][0] < 16 and "full" not in record["policies"]
    assert record["cache_key"]["key_fields"]["activation_checkpointing"] == "selective"
    with open(record_path) as f:
        assert json.load(f)["activation_checkpointing"] == "selective"
    assert lines[-1].startswith("activation_checkpointing=auto: chose selective (device_batch_size=16")


@pytest.mark.unit
def test_selective_trains_like_none_for_100_steps():
    """
    100 optimizer steps of the tiny model (fp32, Newton-Schulz in fp32, 2 micro-batches per step, nanotrain's
    forward_backward and optimizer_step, lr warmdown) with selective checkpointing log the same losses as without,
    within 1e-5 relative at every step (fp32 roundoff: the recomputed ops are the same ops), and the loss falls.
    Catches a recomputation that reads state changed since the forward (e.g. weights updated before backward would
    not show here, but a cached matmul output reused across micro-steps would) and any drift accumulating over steps.
    """
    from nanotrain.optim import setup_optimizers
    from nanotrain.training import forward_backward, lr_multiplier, micro_batches, optimizer_step
    g = torch.Generator().manual_seed(3)
    data = [(torch.randint(0, TINY.vocab_size, (4, TINY.max_seq_len), generator=g),) * 2 for _ in range(8)]
    losses = {}
    for policy in ("none", "selective"):
        model = tiny_model()
        model.activation_checkpointing = policy
        optimizers = setup_optimizers(model, ns_dtype="float32")
        out = []
        for step in range(100):
            x, _ = data[step % len(data)]
            y = torch.roll(x, -1, dims=1)
            out.append(forward_backward(model, micro_batches(x, y, 2), torch.autocast("cpu", enabled=False)).item())
            optimizer_step(model, optimizers, lr_multiplier(step, 100), 0.95, 1.0)
        losses[policy] = out
    for a, b in zip(losses["none"], losses["selective"]):
        assert abs(a - b) <= 1e-5 * abs(a), (a, b)
    assert losses["none"][-1] < 0.5 * losses["none"][0]


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
                                    vocab_size=512) for ac in ("none", "full")}
    assert peak16["none"] > 1.01 * peak16["full"]
    gb = 1.005 * peak16["full"] / GiB
    plain, rec_plain = discover_device_batch_size(gpt_builder(config), device_memory_gb=gb, **args)
    ckpt, rec_ckpt = discover_device_batch_size(gpt_builder(config, activation_checkpointing="full"),
                                                device_memory_gb=gb, **args)
    assert plain < 16 <= ckpt, (plain, ckpt)
    assert not rec_ckpt["cache_hit"] and rec_ckpt["cache_path"] != rec_plain["cache_path"]
    assert rec_ckpt["cache_key"]["key_fields"]["activation_checkpointing"] == "full"
    assert os.path.exists(rec_plain["cache_path"]) and os.path.exists(rec_ckpt["cache_path"])


def metrics(base_dir, run):
    with open(os.path.join(base_dir, "base", run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.smoke
@pytest.mark.slow  # the same gradients in process are in the default run (test_same_gradients_*)
def test_base_train_same_losses(base_dir):
    """
    base_train for 2 steps with --activation_checkpointing=full logs the losses of the plain run (relative 1e-6);
    the checkpointed run discovers its batch size (--auto_batch_size=True, capped at the plain run's 4 rows) and
    the discovery record's cache key says activation_checkpointing=full. Catches a script that never sets the flag
    on the model (the config says True, the model runs plain) or does not pass it to the probes, and any change of
    the training numerics.
    """
    args = [a for a in TINY_TRAIN if not a.startswith("--device_batch_size=")]
    runs = [[*TINY_TRAIN, "--run_name=plain"],
            [*args, "--run_name=ac", "--activation_checkpointing=full", "--auto_batch_size=True", "--max_batch_size=4",
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
    assert record["device_batch_size"] == 4 and record["cache_key"]["key_fields"]["activation_checkpointing"] == "full"
    with open(os.path.join(base_dir, "base", "ac", "config.json")) as f:  # the setting as given
        assert json.load(f)["activation_checkpointing"] == "full"


@pytest.mark.smoke
@pytest.mark.slow  # the default run keeps test_selective_trains_like_none_for_100_steps and test_auto_discovers_*
def test_base_train_selective_and_auto(base_dir):
    """
    base_train for 2 steps with --activation_checkpointing=selective (a fixed device_batch_size) logs the losses of
    the plain run (relative 1e-6), and --activation_checkpointing=auto with --auto_batch_size=True prints its choice,
    writes it to auto_batch_size.json and trains the same losses too; a bad value is one line naming the flag, and
    no run directory.
    Catches the setting not reaching the model (a str the model cannot read, or auto passed on unresolved).
    """
    args = [a for a in TINY_TRAIN if not a.startswith("--device_batch_size=")]
    runs = [[*TINY_TRAIN, "--run_name=plain"], [*TINY_TRAIN, "--run_name=sel", "--activation_checkpointing=selective"],
            [*args, "--run_name=auto", "--activation_checkpointing=auto", "--auto_batch_size=True",
             "--max_batch_size=4", "--device_memory_gb=4"]]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda a: run_script("base_train.py", *a, "--num_iterations=2", base_dir=base_dir),
                                runs))
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    losses = [{r["step"]: r["loss"] for r in metrics(base_dir, name) if "loss" in r} for name in ("plain", "sel", "auto")]
    assert sorted(losses[0]) == [1, 2]
    for other in losses[1:]:
        assert sorted(other) == [1, 2] and all(abs(losses[0][s] - other[s]) <= 1e-6 * abs(losses[0][s]) for s in other)
    assert "activation_checkpointing=auto: chose none (device_batch_size=4" in results[2].stdout + results[2].stderr
    with open(os.path.join(base_dir, "base", "auto", "auto_batch_size.json")) as f:
        assert json.load(f)["activation_checkpointing"] == "none"
    bad = run_script("base_train.py", *TINY_TRAIN, "--activation_checkpointing=partial", "--run_name=bad",
                     base_dir=base_dir)
    assert bad.returncode != 0 and "--activation_checkpointing='partial': expected none|selective|full|auto" in bad.stderr
    assert not os.path.exists(os.path.join(base_dir, "base", "bad"))  # refused before anything is written


@pytest.mark.smoke
def test_mid_and_sft_take_the_same_policy_names(base_dir):
    """mid_train and chat_sft read --activation_checkpointing as base_train does (none|selective|full):
    a bad value is one line naming the flag and writes no run directory, in both. Catches a script whose setting is
    still a bool (the configurator would refuse 'selective') or that checks the value only once the model is built,
    after its run directory exists."""
    for script, stage in (("mid_train.py", "mid"), ("chat_sft.py", "sft")):
        bad = run_script(script, "--activation_checkpointing=partial", "--run_name=bad", base_dir=base_dir)
        assert bad.returncode == 2, bad.stderr[-2000:]
        line = bad.stderr.strip().splitlines()[-1]
        assert line.startswith("error: --activation_checkpointing='partial': expected") and "none|selective|full" in line
        assert not os.path.exists(os.path.join(base_dir, stage, "bad"))


def test_base_train_default_policy_is_auto_on_cuda_with_a_discovered_batch():
    """
    base_train's --activation_checkpointing default ("") resolves to "auto" on CUDA when the device batch size is
    discovered (the policy chosen with the batch, so depth 20 on an 80 GB card gets selective checkpointing and 32
    rows rather than 16 without), and to "none" on CUDA with a given size and on CPU (the CPU recipe unchanged); a
    given setting is kept. Catches an "auto" default on CPU (the recipe's step would change), one with a given
    --device_batch_size (probes on every run), and a default that overrides the user's setting.
    """
    from nanotrain.training import resolve_activation_checkpointing as resolve

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert resolve("", cuda, discovered=True) == "auto"
    assert resolve("", cuda, discovered=False) == "none"
    assert resolve("", cpu, discovered=True) == "none" and resolve("", cpu, discovered=False) == "none"
    assert resolve("none", cuda, discovered=True) == "none" and resolve("full", cpu, discovered=False) == "full"
