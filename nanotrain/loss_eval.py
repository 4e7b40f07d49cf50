"""
Bits per byte: the validation metric of pretraining, independent of the tokenizer's vocabulary size
(as in nanochat's loss_eval; the per-token byte lengths come from nanotrain.tokenizer.get_token_bytes).
"""

import math
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanotrain.common import eval_mode, is_distributed, synchronize


@torch.no_grad()
def evaluate_bpb(model, batches, steps, token_bytes, autocast_ctx=None, stop=None, log_eta=None):
    """
    Validation bits per byte over `steps` batches from the iterator `batches` of (inputs, targets) int64 (B, T).

    bpb = sum of per-token losses in nats / (ln 2 * sum of the UTF-8 byte lengths of the target tokens), where
    targets that are special tokens (byte length 0) or -1 are left out of both sums. The sums are all-reduced over
    ranks, so every rank returns the same float. Sums (not means) make the result independent of the batch size.
    token_bytes: int64 (vocab_size,) on the model's device. Restores model.train() mode if it was on.
    stop: optional callable, asked before each batch (every rank asks it equally often, so it may be collective):
    when it returns True the evaluation is abandoned and None is returned (a stop request during a long evaluation).
    log_eta: optional print function; with 3 or more steps it is called once, after the second batch, with the time
    the rest will take (the second batch's time between two device syncs, times the batches left: the first batch
    may include compilation).
    """
    device = token_bytes.device
    total_nats = torch.zeros((), dtype=torch.float64, device=device)
    total_bytes = torch.zeros((), dtype=torch.float64, device=device)
    with eval_mode(model):
        for i in range(steps):
            if log_eta is not None and steps >= 3 and i in (1, 2):  # the second batch's time: two syncs per evaluation
                synchronize(device)
                if i == 1:
                    t_batch = time.perf_counter()
                else:
                    eta = (time.perf_counter() - t_batch) * (steps - 2)
                    log_eta(f"val: {steps - 2} of {steps} batches left, ETA {eta:.0f} s")
            if stop is not None and stop():
                return None
            x, y = next(batches)
            with autocast_ctx if autocast_ctx is not None else nullcontext():
                loss = model(x, y, loss_reduction="none")
            y = y.reshape(-1)
            nbytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], torch.zeros_like(y))
            counted = nbytes > 0
            total_nats += (loss.reshape(-1).double() * counted).sum()
            total_bytes += nbytes.double().sum()
    if is_distributed():  # nats and bytes in one all-reduce
        both = torch.stack([total_nats, total_bytes])
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        total_nats, total_bytes = both[0], both[1]
    return float("inf") if total_bytes.item() == 0 else (total_nats / (math.log(2) * total_bytes)).item()
