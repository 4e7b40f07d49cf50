"""
The batch engine's decode step in static shapes, for torch.compile(mode="reduce-overhead") (CUDA graphs: one graph
replayed per step, no per-kernel launch cost). The eager step (nanotrain.serve.batch_engine) runs the busy rows over
the keys in use, shapes that change every step; a CUDA graph needs the same shapes and memory every time, so this
step runs every row of the cache over all its max_len key slots, each row masked to its own tokens (StaticRows), and
writes each row's new key and value at its own slot with an indexed copy into the cache's fixed memory (marked a
static address, as transformers' StaticCache does). Free rows compute and write garbage at their length's slot,
which the next prompt put there overwrites; lengths advance outside the graph, for the busy rows only.
"""

import torch

from nanotrain.attention import KVCache, Segments


class StaticRows(KVCache):
    """
    A per-row KVCache over all of `cache`'s rows for one token per row, with shapes that never change: insert_kv
    writes row r's key and value at slot lengths[r] and returns every slot (max_len keys); segments() masks each row
    to slots <= its length. pos stays 1 (every decoding row has tokens: smear reads prev_embedding), lengths are not
    advanced here.
    """

    def __init__(self, cache, lengths, prev_embedding):
        self.k_cache, self.v_cache, self.n_layer, self.max_len = cache.k_cache, cache.v_cache, cache.n_layer, \
            cache.max_len
        self.lengths, self.prev_embedding, self.pos = lengths, prev_embedding, 1

    def segments(self, T):
        positions = self.lengths[:, None] + torch.arange(T, device=self.lengths.device)  # (B, T)
        keys = torch.arange(self.max_len, device=self.lengths.device)
        return Segments(positions, (keys <= positions[:, :, None])[:, None], None, 0)

    def insert_kv(self, layer_idx, k, v):
        rows = torch.arange(k.size(0), device=k.device)
        self.k_cache[layer_idx][rows, :, self.lengths] = k[:, :, 0].to(self.k_cache.dtype)
        self.v_cache[layer_idx][rows, :, self.lengths] = v[:, :, 0].to(self.v_cache.dtype)
        return self.k_cache[layer_idx], self.v_cache[layer_idx]


def static_step(model, tokens, cache, lengths, prev_embedding):
    """One decode token per row of `cache` (a per-row KVCache) in static shapes: tokens int64 (max_batch, 1), lengths
    int64 (max_batch,), prev_embedding (max_batch, 1, model_dim) or None (no smear). Returns (logits fp32
    (max_batch, vocab_size), the rows' new smear embeddings or None)."""
    view = StaticRows(cache, lengths, prev_embedding)
    logits = model(tokens, kv_cache=view, last_only=True)[:, -1, :]
    return logits, view.prev_embedding


def compiled_decode(model, max_batch, compile=True):
    """
    A decode step decode(last, cache, n) -> logits (n, vocab_size) fp32 for rows 0..n-1 of `cache` (a per-row
    KVCache of max_batch rows; last: int64 (max_batch, 1), each row's last token) that advances those rows' lengths
    and smear embeddings like the eager step: static_step, through torch.compile(mode="reduce-overhead",
    dynamic=False) when `compile` (CUDA graphs on CUDA), else eager (what a CPU test checks). The cache's keys and
    values are marked static addresses on first use.
    """
    step = torch.compile(static_step, mode="reduce-overhead", dynamic=False) if compile else static_step
    marked = set()

    def decode(last, cache, n):
        if compile and id(cache.k_cache) not in marked:
            torch._dynamo.mark_static_address(cache.k_cache)
            torch._dynamo.mark_static_address(cache.v_cache)
            marked.add(id(cache.k_cache))
        if model.smear_gate is not None and cache.prev_embedding is None:
            cache.prev_embedding = torch.zeros(max_batch, 1, model.config.model_dim, device=last.device,
                                               dtype=model.wte.weight.dtype)
        logits, prev = step(model, last, cache, cache.lengths.clone(), cache.prev_embedding)
        logits = logits[:n].clone()  # a CUDA graph's output is overwritten by its next replay
        cache.lengths[:n] += 1
        if prev is not None:
            cache.prev_embedding[:n] = prev[:n]
        cache.pos = int(cache.lengths.max())
        return logits
    return decode
