"""
Records the reference loss curve that tests/test_convergence.py compares against (loss-curve regression):

    python dev/record_loss_curve.py            # writes tests/data/loss_curve_tiny.json

Re-record only on purpose, when a change is meant to alter the numerics (model, init, optimizer, schedule), and say
so in the commit message. The curve is 50 optimizer steps of a tiny GPT (2 layers, model_dim 64, vocab 128, 32 tokens
per row, 8 rows per step in 2 micro-batches) trained with nanotrain's own pieces (GPT init on the meta device as in
base_train, setup_optimizers, forward_backward, lr_multiplier, muon_momentum, optimizer_step), fp32 on one CPU
thread, Muon's Newton-Schulz pinned to fp32 (its default picks bf16 on CPUs with fast bf16 matmuls, which would change
the curve).
The data is a fixed bigram chain generated with Python's random module, so it depends on neither torch's RNG nor the
tokenizer or the corpus.
"""

import json
import os
import random
import sys
from contextlib import nullcontext

import torch

from nanotrain.common import seed_everything
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers
from nanotrain.training import forward_backward, lr_multiplier, micro_batches, muon_momentum, optimizer_step

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "loss_curve_tiny.json")
COMMAND = "python dev/record_loss_curve.py"
CONFIG = dict(max_seq_len=32, vocab_size=128, n_layer=2, n_head=2, n_kv_head=2, model_dim=64)
SETTINGS = dict(steps=50, rows=8, micro_batch=4, seed=42, warmup_ratio=0.1, warmdown_ratio=0.2, final_lr_frac=0.0,
                grad_clip=1.0, data_seed=1234)


def bigram_rows(step, rows, length, vocab, data_seed):
    """int64 (rows, length) token ids of optimizer step `step`: a chain where each token is followed by one of 4 fixed
    successors 90% of the time and by a uniform token otherwise (learnable, loss floor ~2 nats)."""
    table = random.Random(data_seed)
    succ = [[table.randrange(vocab) for _ in range(4)] for _ in range(vocab)]
    rng = random.Random(data_seed * 100_003 + step)
    out = []
    for _ in range(rows):
        t = rng.randrange(vocab)
        row = [t]
        for _ in range(length - 1):
            t = rng.choice(succ[t]) if rng.random() < 0.9 else rng.randrange(vocab)
            row.append(t)
        out.append(row)
    return torch.tensor(out, dtype=torch.long)


def train_curve(seed=SETTINGS["seed"], steps=SETTINGS["steps"], lrm_fn=lr_multiplier, reseed=True):
    """
    The training losses (list of `steps` floats, nats per token, measured before each update) of the tiny config.
    lrm_fn(step, total_steps, warmup_ratio, warmdown_ratio, final_lr_frac) gives the lr multiplier (tests pass wrong
    variants); reseed=False skips seeding the RNGs before the weight init (a wrong variant for determinism tests).
    Runs on one CPU thread and restores the thread count.
    """
    s = SETTINGS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if reseed:
            seed_everything(seed)
        with torch.device("meta"):
            model = GPT(GPTConfig(**CONFIG))
        model.to_empty(device="cpu")
        model.init_weights()
        optimizers = setup_optimizers(model, ns_dtype="float32")  # not chosen per CPU: the curve is machine-independent
        losses = []
        for step in range(steps):
            rows = bigram_rows(step, s["rows"], CONFIG["max_seq_len"] + 1, CONFIG["vocab_size"], s["data_seed"])
            x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
            loss = forward_backward(model, micro_batches(x, y, s["micro_batch"]), nullcontext())
            losses.append(loss.item())
            lrm = lrm_fn(step, steps, s["warmup_ratio"], s["warmdown_ratio"], s["final_lr_frac"])
            optimizer_step(model, optimizers, lrm, muon_momentum(step), s["grad_clip"])
        return losses
    finally:
        torch.set_num_threads(threads)


def main():
    losses = train_curve()
    record = {"command": COMMAND, "config": CONFIG, "settings": SETTINGS, "torch": torch.__version__,
              "python": sys.version.split()[0], "losses": losses}
    os.makedirs(os.path.dirname(PATH), exist_ok=True)
    tmp = PATH + ".tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    os.replace(tmp, PATH)
    print(f"wrote {PATH}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}")


if __name__ == "__main__":
    main()
