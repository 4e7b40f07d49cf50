"""
Continuous batching for the server (scripts/chat_serve.py): requests that arrive at different times share one decode
batch. One thread owns the model and a KVCache of max_batch rows in its per-row mode (nanotrain.attention.KVCache):
a new request is prefilled into a free row (its prompt alone, KVCache.rows / set_rows) at the next step and then
decodes with the others, one token per row per step, each row at its own position and attending to its own tokens
only; a request leaves its row when it stops (<|assistant_end|> or <|bos|>), reaches its max_tokens or is cancelled
(a client gone), and the row is free for the next one at the following step. Temperature, top_k, seed and max_tokens
are per request (each request samples with its own torch.Generator). With greedy decoding a request gets the tokens
it would get alone through nanotrain.engine.Engine (the same per-row masking as Engine's mixed-length batches: equal
up to floating-point reduction order). The calculator tool runs per row as in Engine (ToolState). Requests beyond the
free rows wait in a bounded queue (max_queue); submit() refuses more with QueueFull. The continuous-batching idea is
Orca's (Yu et al. 2022, "Orca: A Distributed Serving System for Transformer-Based Generative Models").
"""

import queue
import threading

import torch
import torch.nn.functional as F

from nanotrain.attention import KVCache
from nanotrain.engine import ToolState
from nanotrain.errors import UserError


def rows_view(cache, hi):
    """A per-row KVCache over rows 0..hi-1 of `cache` (per-row mode), sharing its keys, values and lengths (a forward
    with it advances those rows' lengths in `cache` too); its pos is the longest of those rows."""
    view = KVCache.__new__(KVCache)
    view.k_cache, view.v_cache = cache.k_cache[:, :hi], cache.v_cache[:, :hi]
    view.n_layer, view.max_len, view.lengths = cache.n_layer, cache.max_len, cache.lengths[:hi]
    view.pos = int(view.lengths.max())
    view.prev_embedding = None if cache.prev_embedding is None else cache.prev_embedding[:hi]
    return view


class QueueFull(Exception):
    """submit() found max_queue requests waiting already."""


class Request:
    """
    One submitted generation. Iterating it yields its new token ids (int) as they are decoded (the tool's forced
    tokens included), ending before the stop token; `finish_reason` is then "stop" or "length". cancel() frees its
    row at the next step (what a server does when the client goes away). Raises in the iterating thread what the
    engine's thread raised for it.
    """

    def __init__(self, prompt, max_tokens, temperature, top_k, seed, tool):
        self.prompt, self.max_tokens, self.temperature, self.top_k = list(prompt), max_tokens, temperature, top_k
        self.seed, self.tool = seed, tool
        self.tokens = queue.Queue()  # ints, then None at the end, or an exception
        self.cancelled = threading.Event()
        self.finish_reason = None

    def cancel(self):
        self.cancelled.set()

    def __iter__(self):
        while True:
            item = self.tokens.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item


class BatchEngine:
    """
    Continuous batching over `model` (a nanotrain.gpt.GPT in eval mode) and `tokenizer`: at most max_batch requests
    decode together, at most max_queue wait; a daemon thread runs the steps. context_len: the most tokens a row may
    hold (prompt + new tokens), default the model's max_seq_len.
    """

    def __init__(self, model, tokenizer, max_batch=8, max_queue=16, context_len=None):
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        self.context_len = context_len or model.config.max_seq_len
        self.stop_ids = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
        self.waiting = queue.Queue(maxsize=max_queue)
        self.rows = [None] * max_batch  # per row: the request decoding there, or None
        self.wake = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="nanotrain-batch-engine").start()

    def active(self):
        """How many rows are decoding now (int)."""
        return sum(r is not None for r in self.rows)

    def submit(self, prompt, max_tokens, temperature=0.0, top_k=None, seed=42, tool=False):
        """
        Queues a generation of up to max_tokens new tokens after `prompt` (list[int]); returns its Request. Raises
        UserError for an empty prompt, max_tokens < 1, a negative temperature or a prompt + max_tokens over
        context_len; QueueFull when max_queue requests are waiting.
        """
        if not prompt or max_tokens < 1 or temperature < 0:
            raise UserError("submit: expected a non-empty prompt, max_tokens >= 1 and temperature >= 0")
        if len(prompt) + max_tokens > self.context_len:
            raise UserError(f"submit: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                            f"of {self.context_len} tokens")
        req = Request(prompt, max_tokens, temperature, top_k, seed, tool)
        try:
            self.waiting.put_nowait(req)
        except queue.Full:
            raise QueueFull(f"{self.waiting.maxsize} requests are waiting") from None
        self.wake.set()
        return req

    # ------------------------------------------------------------------------- the engine's thread
    def _loop(self):
        model = self.model
        device = model.wte.weight.device
        c = model.config
        cache = KVCache(self.max_batch, c.n_kv_head, model.head_dim, c.n_layer, self.context_len, device,
                        model.wte.weight.dtype)
        last = torch.zeros(self.max_batch, 1, dtype=torch.long, device=device)  # each row's last token
        while True:
            if self.active() == 0 and self.waiting.empty():
                self.wake.wait()
                self.wake.clear()
                continue
            try:
                with torch.inference_mode():
                    self._step(cache, last)
            except Exception as e:  # noqa: BLE001 - every active request gets the error; the engine goes on
                for r, req in enumerate(self.rows):
                    if req is not None:
                        req.tokens.put(e)
                        self.rows[r] = None
                cache.reset()

    def _step(self, cache, last):
        """Admits waiting requests into free rows (prefill: their first token), then one decode step of every
        active row (a fresh row feeds its first token); each row's token goes to its request."""
        for r in range(self.max_batch):
            if self.rows[r] is not None or self.waiting.empty():
                continue
            req = self.waiting.get_nowait()
            if req.cancelled.is_set():
                req.tokens.put(None)
                continue
            req.rng = torch.Generator(device=cache.k_cache.device).manual_seed(req.seed)
            req.state = ToolState(self.tokenizer) if req.tool else None
            req.count = 0
            sub = cache.rows(r, r + 1)
            ids = torch.tensor([req.prompt], dtype=torch.long, device=last.device)
            logits = self.model(ids, kv_cache=sub, last_only=True)[:, -1, :]
            cache.set_rows(r, sub)
            self.rows[r] = req
            self._emit(r, req, logits[0], cache, last)
        decoding = [r for r, req in enumerate(self.rows) if req is not None]
        if decoding:
            hi = decoding[-1] + 1  # rows 0..hi-1 only: requests take the lowest free rows, the rest stay idle
            view = rows_view(cache, hi)
            logits = self.model(last[:hi], kv_cache=view, last_only=True)[:, -1, :]  # (hi, vocab) fp32
            if view.prev_embedding is not None:  # smear keeps each row's last embedding
                if cache.prev_embedding is None:
                    cache.prev_embedding = view.prev_embedding.new_zeros(self.max_batch, *view.prev_embedding.shape[1:])
                cache.prev_embedding[:hi] = view.prev_embedding
            for r in range(hi):  # free rows took a token too: they hold nothing of use
                if self.rows[r] is None:
                    cache.lengths[r] = 0
            for r in decoding:
                self._emit(r, self.rows[r], logits[r], cache, last)
        cache.pos = int(cache.lengths.max()) if cache.lengths is not None else 0

    def _emit(self, r, req, logits, cache, last):
        """Picks row r's next token from its logits (vocab,) (or the tool's forced one), hands it to the request and
        frees the row when the request is done."""
        forced = req.state.next_forced() if req.state is not None else None
        if forced is not None:
            tok = forced
        elif req.temperature == 0:
            tok = int(logits.argmax())
        else:
            scaled = logits / req.temperature
            if req.top_k and req.top_k < scaled.numel():
                kth = torch.topk(scaled, req.top_k).values[-1]
                scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            tok = int(torch.multinomial(F.softmax(scaled, dim=-1), 1, generator=req.rng))
        if req.state is not None:
            req.state.feed(tok)
        last[r, 0] = tok
        if req.cancelled.is_set() or tok in self.stop_ids:
            req.finish_reason = "stop"
        else:
            req.tokens.put(tok)
            req.count += 1
            if req.count >= req.max_tokens:
                req.finish_reason = "length"
        if req.finish_reason is not None:
            req.tokens.put(None)
            self.rows[r] = None
            cache.lengths[r] = 0
