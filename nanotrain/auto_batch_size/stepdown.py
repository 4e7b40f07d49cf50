"""
The out-of-memory step-down during training: a step at the discovered device_batch_size that runs out of memory on
any rank is redone on the same rows in smaller micro-batches (the next smaller candidate), so the tokens per optimizer
step and the result stay the same; the discovery's record and cache learn of it.
"""

import torch.distributed as dist

from nanotrain.auto_batch_size.cache import drop_cached
from nanotrain.common import atomic_write_json, is_distributed, print0
from nanotrain.errors import UserError
from nanotrain.fsdp import is_fsdp
from nanotrain.training import forward_backward, micro_batches


def next_smaller_candidate(candidates, batch_size):
    """The largest candidate strictly smaller than batch_size, or None: the step-down after an out-of-memory step
    (halving, as Composer's auto microbatching does, may break divisibility)."""
    return max((c for c in candidates if c < batch_size), default=None)


class OOMStepDown:
    """Training steps at a discovered device_batch_size, stepping down when memory runs out. record: the record of
    discover_device_batch_size (reads "candidates", "cache_key"; gets "step_downs"); record_path: its JSON file (None:
    none); device_batch_size (int attribute): the micro-batch size in use now; log: print-like."""

    def __init__(self, record, record_path, device_batch_size, log=print0):
        self.record, self.record_path, self.device_batch_size, self.log = record, record_path, device_batch_size, log

    def forward_backward(self, model, inputs, targets, autocast_ctx, step):
        """
        nanotrain.training.forward_backward of inputs, targets (int64 (N, T), N a multiple of the candidates up to
        device_batch_size) in micro-batches of self.device_batch_size rows, with catch_oom=True: if any rank runs out
        of memory, every rank drops the gradients, steps down to the next smaller candidate and calls it again on the
        same rows in more micro-batches (same tokens, same result). After a step-down, rank 0 drops the cache entry,
        every rank appends [step, old_size, new_size] to record["step_downs"], rank 0 rewrites record_path, and
        self.device_batch_size is the new size (the caller recomputes what depends on it). Returns the mean loss over
        the N rows (detached 0-dim tensor). Raises UserError if the smallest candidate runs out of memory or the model
        is sharded with FSDP2 (a rank failing inside its all-gathers cannot leave the others); non-OOM errors
        propagate.
        """
        if is_fsdp(model):
            raise UserError("--fsdp=True: the out-of-memory step-down of --auto_batch_size is not available under FSDP "
                            "(collectives inside forward/backward); use forward_backward")
        micro_batch_size = self.device_batch_size
        while True:
            loss = forward_backward(model, micro_batches(inputs, targets, micro_batch_size), autocast_ctx,
                                    catch_oom=True)
            if loss is not None:
                break
            smaller = next_smaller_candidate(self.record["candidates"], micro_batch_size)
            if smaller is None:
                raise UserError(f"out of memory at device_batch_size={micro_batch_size}, the smallest candidate; use "
                                f"a smaller --max_seq_len or a smaller model")
            self.log(f"out of memory at device_batch_size={micro_batch_size}: stepping down to {smaller} "
                     f"(grad_accum_steps {inputs.size(0) // micro_batch_size} -> {inputs.size(0) // smaller}) and "
                     f"redoing this step")
            micro_batch_size = smaller
        if micro_batch_size != self.device_batch_size:
            self.record.setdefault("step_downs", []).append([step, self.device_batch_size, micro_batch_size])
            self.device_batch_size = micro_batch_size
            if not is_distributed() or dist.get_rank() == 0:
                drop_cached(self.record["cache_key"])
                if self.record_path is not None:
                    atomic_write_json(self.record_path, self.record)
        return loss
