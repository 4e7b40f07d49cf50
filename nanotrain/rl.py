"""
The arithmetic of the RL stage (scripts/chat_rl.py), written once and tested on its own: rollout seeds, advantages,
the training rows of a step's samples, and pass@k.

The objective is on-policy REINFORCE with a per-prompt mean baseline (nanochat's chat_rl, which calls it a
simplified GRPO: no KL term, no reference model, no ratio or clipping because every sample comes from the current
weights, no division by the reward's standard deviation). For the samples s of one step, each a prompt's sampled
tokens t with log-probability log p(t), reward r_s and advantage A_s = r_s - mean(r of that prompt's samples):

    loss = -(1 / N) * sum_s sum_{t in s, mask 1} A_s * log p(t)

where N counts every sampled (mask 1) token of the step on every rank, counted before the backward passes. Dividing
by that global count, not by each micro-batch's own count (nanochat divides per micro-batch, so its gradient changes
with how the samples are split into micro-batches and ranks), makes the gradient independent of the split.
Tokens the calculator tool forced (mask 0) are neither trained nor counted. A prompt whose samples all got the same
reward has A = 0 for all of them: it contributes nothing to the gradient (its tokens still count in N).
"""

import math
import zlib

import torch

from nanotrain.sft_data import IGNORE_INDEX


def rollout_seed(seed, step, prompt_index):
    """The sampling seed (int in [0, 2**31)) of prompt `prompt_index` (its index among the step's prompts, the same on
    every rank) at optimizer step `step`: a fixed hash, so samples do not depend on the number of ranks, on which
    prompts share a batch, or on a resume."""
    return zlib.crc32(f"{seed}:{step}:{prompt_index}".encode()) & 0x7FFFFFFF


def group_advantages(rewards):
    """The advantages of one prompt's samples: rewards (list of float) minus their mean. Returns list[float]."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def rl_rows(prompt, samples, advantages):
    """
    The training rows of one prompt's samples. prompt: list[int]; samples: list of (ids, mask) as
    nanotrain.engine.Engine.sample returns them (ids may end with the stop token, which is trained like any sampled
    token); advantages: one float per sample. Returns a list of dicts, one per sample:
    {"x": list[int] (prompt + ids)[:-1], "y": list[int] (prompt + ids)[1:] with IGNORE_INDEX on the prompt and on
     forced tokens, "advantage": float, "targets": int (trained tokens: the sample's mask-1 tokens)}.
    A sample with no token yields "targets" 0.
    """
    rows = []
    for (ids, mask), adv in zip(samples, advantages):
        seq = list(prompt) + list(ids)
        y = [IGNORE_INDEX] * (len(prompt) - 1) + [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
        rows.append({"x": seq[:-1], "y": y, "advantage": float(adv), "targets": sum(1 for m in mask if m)})
    return rows


def rl_micro_batches(rows, device_batch_size, pad_id, device):
    """
    Micro-batches for nanotrain.training.forward_backward of the rows (rl_rows) that carry a gradient (a non-zero
    advantage and at least one trained token), device_batch_size rows each, right-padded to the longest row of the
    micro-batch: dicts {"x", "y": int64 (B, T), "weights": fp32 (B, T), the row's advantage at its trained targets,
    0 elsewhere}. Rows keep their order. Returns a list (empty when no row carries a gradient).
    """
    live = [r for r in rows if r["advantage"] != 0 and r["targets"] > 0]
    out = []
    for i in range(0, len(live), device_batch_size):
        chunk = live[i:i + device_batch_size]
        T = max(len(r["x"]) for r in chunk)
        x = torch.full((len(chunk), T), pad_id, dtype=torch.long)
        y = torch.full((len(chunk), T), IGNORE_INDEX, dtype=torch.long)
        w = torch.zeros((len(chunk), T), dtype=torch.float32)
        for j, r in enumerate(chunk):
            n = len(r["x"])
            x[j, :n] = torch.tensor(r["x"])
            y[j, :n] = torch.tensor(r["y"])
            w[j, :n] = (y[j, :n] != IGNORE_INDEX).float() * r["advantage"]
        out.append({"x": x.to(device), "y": y.to(device), "weights": w.to(device)})
    return out


def empty_micro_batch(pad_id, device):
    """A micro-batch with nothing to train (weights 0): what a rank with fewer micro-batches than the others runs, so
    every rank takes part in every gradient all-reduce."""
    return {"x": torch.full((1, 2), pad_id, dtype=torch.long, device=device),
            "y": torch.full((1, 2), pad_id, dtype=torch.long, device=device),
            "weights": torch.zeros((1, 2), dtype=torch.float32, device=device)}


def pass_at_k(n, c, k):
    """
    The unbiased estimate of pass@k from n samples of which c are correct (Chen et al. 2021, "Evaluating Large
    Language Models Trained on Code", eq. 1): 1 - C(n - c, k) / C(n, k). Raises ValueError unless 0 <= c <= n and
    1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)
