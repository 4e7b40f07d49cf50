"""
The RL stage's arithmetic (nanotrain/rl.py through nanotrain.training.forward_backward, as scripts/chat_rl.py runs
it) on real tiny models: advantages and the loss against hand-worked values, the gradient independent of the split
into micro-batches and ranks (nanochat's per-micro-batch normalisation as the counter-example that fails), zero
gradient for a prompt whose samples agree, pass@k, and chat_rl's exact resume after SIGTERM (slow).
"""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers import REPO, TINY_TRAIN, free_port, grads, rel, run_script, same, spawn_ranks, tiny_model

from nanotrain.common import exit_process
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.rl import empty_micro_batch, group_advantages, pass_at_k, rl_micro_batches, rl_rows, rollout_seed
from nanotrain.sft_data import IGNORE_INDEX, token_loss_scale
from nanotrain.training import forward_backward

S = 15 * math.tanh(2 / 15)
NLL_00 = math.log(math.exp(S) + 2) - S  # the hand model's loss of target 0 after input 0 (test_oracles.py)


def hand_model():
    """test_oracles.py's hand model: vocab 3, input 0 gives logits [s, 0, 0], inputs 1 and 2 give [0, 0, 0]."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=3, n_layer=1, n_head=1, n_kv_head=1, model_dim=2))
    model.init_weights()
    with torch.no_grad():
        model.wte.weight.copy_(torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0]]))
        model.lm_head.weight.copy_(torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    return model


def step_rows(groups):
    """rl_rows of every (prompt, samples, rewards) group, with group_advantages."""
    rows = []
    for prompt, samples, rewards in groups:
        rows += rl_rows(prompt, samples, group_advantages(rewards))
    return rows


def rl_backward(model, rows, device_batch_size, world_size=1):
    """chat_rl's backward: rl_micro_batches, then forward_backward scaled by world size / the global token count
    (count given for the whole step; under DDP every rank passes the same number of micro-batches)."""
    batches = rl_micro_batches(rows, device_batch_size, pad_id=0, device="cpu")
    count = sum(r["targets"] for r in rows)
    return forward_backward(model, batches, nullcontext(), loss_scale=token_loss_scale(count, world_size)), batches


@pytest.mark.unit
def test_advantages_and_loss_are_the_hand_values():
    """
    Two prompts of two samples on the hand model (worked by hand):
      prompt [1]: sample [0, 0] (both sampled, reward 1), sample [2, 1] (the 1 forced by the tool, reward 0)
        -> advantages +0.5, -0.5; trained targets: 1->0 (ln 3) and 0->0 (NLL_00); 1->2 (ln 3); the forced 1 is not
      prompt [2]: samples [1] and [0, 2], both reward 0 -> advantages 0, 0; 3 trained targets, no gradient
      N = 6 sampled tokens, loss = (0.5 (ln 3 + NLL_00) - 0.5 ln 3) / 6 = NLL_00 / 12.
    Catches a baseline other than the group mean, a forced token trained or counted, the prompt trained, a
    denominator without the zero-advantage samples' tokens (NLL_00 / 6), and a sign error.
    """
    groups = [([1], [([0, 0], [1, 1]), ([2, 1], [1, 0])], [1.0, 0.0]),
              ([2], [([1], [1]), ([0, 2], [1, 1])], [0.0, 0.0])]
    assert group_advantages([1.0, 0.0]) == [0.5, -0.5] and group_advantages([1.0, 1.0, 1.0, 0.0]) == \
        [0.25, 0.25, 0.25, -0.75]
    rows = step_rows(groups)
    assert [r["targets"] for r in rows] == [2, 1, 1, 2]
    assert rows[1]["y"] == [2, IGNORE_INDEX]  # the forced token is ignored
    loss, batches = rl_backward(hand_model(), rows, device_batch_size=4)
    assert len(batches) == 1 and batches[0]["x"].size(0) == 2  # the zero-advantage samples are not run
    assert loss.item() == pytest.approx(NLL_00 / 12, rel=1e-6)


def sampled_rows(vocab=64, seed=5):
    """A step of 3 prompts x 4 samples on tiny_model's vocab: random prompts, lengths, tool masks and 0/1 rewards,
    one prompt whose samples all agree (no gradient), trained-token counts from 1 to 13."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for rewards in ([1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]):
        prompt = torch.randint(0, vocab, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        samples = []
        for _ in rewards:
            n = int(torch.randint(1, 13, (1,), generator=g))
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            mask = [0 if (i % 5 == 3) else 1 for i in range(n)]  # a forced tool token here and there
            samples.append((ids, mask))
        groups.append((prompt, samples, rewards))
    return groups


def reference_grad(model, groups):
    """The gradient of -(1/N) sum A log p(token), computed without nanotrain.rl: each sample alone through the model's
    logits and log_softmax, N counted from the masks."""
    model.zero_grad(set_to_none=True)
    n = sum(sum(m) for _, samples, _ in groups for _, m in samples)
    total = 0.0
    for prompt, samples, rewards in groups:
        mean = sum(rewards) / len(rewards)
        for (ids, mask), r in zip(samples, rewards):
            seq = torch.tensor([prompt + ids])
            logp = torch.log_softmax(model(seq[:, :-1]).float(), dim=-1)[0]
            for j, (t, m) in enumerate(zip(ids, mask)):
                if m:
                    total = total - (r - mean) * logp[len(prompt) - 1 + j, t]
    (total / n).backward()
    return grads(model)


def naive_backward(model, rows, device_batch_size):
    """nanochat's normalisation (the wrong one): each micro-batch's -sum(A log p) over its own valid tokens, divided
    by the number of micro-batches."""
    batches = rl_micro_batches(rows, device_batch_size, pad_id=0, device="cpu")
    for b in batches:
        nll = model(b["x"], b["y"], loss_reduction="none")
        loss = (nll * b["weights"].reshape(-1)).sum() / (b["y"] >= 0).sum()
        (loss / len(batches)).backward()


@pytest.mark.unit
@pytest.mark.parametrize("device_batch_size", [1, 2, 3, 8])
def test_gradient_does_not_depend_on_micro_batches(device_batch_size):
    """
    The gradient of chat_rl's loss for micro-batches of 1, 2, 3 or 8 samples equals the reference gradient (each
    sample alone, N counted from the masks) within fp32 round-off (1e-5 relative). nanochat's per-micro-batch
    normalisation, run on the same rows, misses by more than 1e-2 for every split (with one micro-batch it divides by
    the live samples' tokens only, not by every sampled token of the step).
    """
    groups = sampled_rows()
    ref = reference_grad(tiny_model(), groups)
    model = tiny_model()
    rl_backward(model, step_rows(groups), device_batch_size)
    assert rel(grads(model), ref) <= 1e-5
    model.zero_grad(set_to_none=True)
    naive_backward(model, step_rows(groups), device_batch_size)
    assert rel(grads(model), ref) > 1e-2


@pytest.mark.unit
def test_a_group_whose_samples_agree_gives_zero_gradient():
    """All samples of every prompt got the same reward: no micro-batch at all; and a zero-advantage row forced
    through forward_backward (as a rank's filler micro-batch is) leaves every gradient exactly 0."""
    groups = [(p, s, [1.0] * len(r)) for p, s, r in sampled_rows()]
    rows = step_rows(groups)
    assert all(r["advantage"] == 0 for r in rows)
    assert rl_micro_batches(rows, 4, pad_id=0, device="cpu") == []
    model = tiny_model()
    forward_backward(model, [empty_micro_batch(0, "cpu")], nullcontext(), loss_scale=1.0)
    assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in model.parameters())


@pytest.mark.unit
def test_pass_at_k_and_rollout_seeds():
    """pass@k literal values (n = 4: c = 0 -> 0, c = 1 -> k / 4 for k = 1, 1 - C(3,2)/C(4,2) = 0.5 for k = 2, c = 4
    -> 1); rollout seeds differ across steps and prompts and do not depend on anything else."""
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 4, 1) == 1.0 and pass_at_k(4, 2, 1) == 0.5
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    seeds = {rollout_seed(42, s, p) for s in range(10) for p in range(8)}
    assert len(seeds) == 80 and rollout_seed(42, 3, 1) == rollout_seed(42, 3, 1)


# ----------------------------------------------------------------------------- 2 ranks on gloo

def _dist_worker(rank, world_size, port, out_dir):
    """One rank: its prompts (strided, as chat_rl takes them), its micro-batches padded to the ranks' maximum with
    empty ones, DDP, forward_backward scaled by world size / the global count."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    groups = sampled_rows()
    count = sum(r["targets"] for r in step_rows(groups))
    mine = step_rows(groups[rank::world_size])
    model = tiny_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    batches = rl_micro_batches(mine, 2, pad_id=0, device="cpu")
    n = torch.tensor(len(batches))
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    batches += [empty_micro_batch(0, "cpu") for _ in range(int(n) - len(batches))]
    forward_backward(ddp, batches, nullcontext(), loss_scale=token_loss_scale(count, world_size))
    torch.save({"grad": grads(model)}, os.path.join(out_dir, f"rank{rank}.pt"))
    exit_process(0)


@pytest.mark.slow  # the default run keeps test_gradient_does_not_depend_on_micro_batches (the same normalisation)
@pytest.mark.dist
@pytest.mark.timeout(180)
def test_two_gloo_ranks_give_the_one_process_gradient():
    """2 gloo ranks under DDP (unequal micro-batch counts, a filler micro-batch) give the reference gradient within
    1e-5 relative, identical on both ranks. Catches a rank-local count and a missing world-size factor."""
    ref = reference_grad(tiny_model(), sampled_rows())
    with tempfile.TemporaryDirectory() as out_dir:
        spawn_ranks(_dist_worker, (2, free_port(), out_dir))
        r = [torch.load(os.path.join(out_dir, f"rank{i}.pt"), weights_only=True) for i in range(2)]
    assert torch.equal(r[0]["grad"], r[1]["grad"])
    assert rel(r[0]["grad"], ref) <= 1e-5


# ----------------------------------------------------------------------------- chat_rl end to end

SFT = ["--dtype=float32", "--examples_per_step=8", "--max_tokens_per_device=256", "--eval_examples=16",
       "--keep_last=0", "--num_iterations=20", "--init_lr_frac=1.0"]
RL = ["--dtype=float32", "--examples_per_step=4", "--num_samples=4", "--max_new_tokens=8", "--eval_problems=8",
      "--eval_every=-1", "--save_every=-1", "--keep_last=0", "--num_iterations=8", "--source_run_name=s"]


@pytest.fixture(scope="module")
def sft_base(shared_base_dir, tmp_path_factory):
    """A base dir with a 3-step base run and an SFT run 's' on a yes/no task, where samples often disagree (so RL has
    a gradient); returns (base dir, the task's JSONL path)."""
    base = tmp_path_factory.mktemp("rl")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    jsonl = base / "yesno.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Say {w}."},
                                                      {"role": "assistant", "content": w}]}) + "\n"
                             for w in ["yes", "no"] * 40))
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=3", "--run_name=s", base_dir=base)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_script("chat_sft.py", *SFT, f"--tasks=jsonl:{jsonl}", "--source=base", "--source_run_name=s",
                   "--run_name=s", base_dir=base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base, jsonl


def final_weights(base, run, name="model.pt"):
    ckpts = sorted(os.listdir(os.path.join(base, "rl", run, "checkpoints")))
    return torch.load(os.path.join(base, "rl", run, "checkpoints", ckpts[-1], name), weights_only=True)


@pytest.mark.slow  # the default run keeps the math above; this is the whole script three times
@pytest.mark.smoke
def test_chat_rl_resumes_exactly_after_sigterm(sft_base):
    """
    chat_rl stopped by SIGTERM once it has logged step 3, then --resume=True: the final parameters are bitwise equal
    to an uninterrupted run's, so are the saved Python, NumPy and torch RNG states, and the run really updated the
    weights (some step had a gradient). Catches a resume that re-seeds the rollouts, loses the prompt cursor or the
    optimizer state, or replays a step, and one that restores the RNG states before the set-up that draws from them.
    """
    sft_base, jsonl = sft_base
    rl = [*RL, f"--tasks=jsonl:{jsonl}"]
    r = run_script("chat_rl.py", *rl, "--run_name=straight", base_dir=sft_base)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("no update") < 8, r.stdout  # some step had a gradient
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(sft_base), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "chat_rl.py"), *rl, "--run_name=cut"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith("step 00003/"):
            p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0, "".join(lines)[-3000:]
    assert any("Stopped at step" in ln for ln in lines), "".join(lines)[-3000:]
    r = run_script("chat_rl.py", *rl, "--run_name=cut", "--resume=True", base_dir=sft_base)
    assert r.returncode == 0, r.stderr[-3000:]
    a, b = final_weights(sft_base, "straight"), final_weights(sft_base, "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (final_weights(sft_base, run, "rank_00000.pt")["rng"] for run in ("straight", "cut"))
    assert sorted(ra) == ["numpy", "python", "torch"] and same(ra, rb)  # the RNG states too
    src = torch.load(os.path.join(sft_base, "sft", "s", "checkpoints", "step_000020", "model.pt"), weights_only=True)
    assert any(not torch.equal(a[k], src[k]) for k in a)


@pytest.mark.slow  # the default run keeps test_configurator's --help tests (the same code path for every script)
@pytest.mark.smoke
def test_chat_rl_help_lists_its_settings():
    """--help exits 0 and lists the RL settings with their comments."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "chat_rl.py"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for name in ("num_samples", "examples_per_step", "temperature", "init_lr_frac", "tool", "source_run_name"):
        assert name in r.stdout
