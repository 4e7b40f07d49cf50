"""
Continuous batching for the server (scripts/chat_serve.py): requests that arrive at different times share one decode
batch. One thread owns the model and a KVCache of max_batch rows in its per-row mode (nanotrain.attention.KVCache):
a new request is prefilled into a free row (its prompt alone, KVCache.rows / set_rows) at the next step and then
decodes with the others, one token per row per step, each row at its own position and attending to its own tokens
only; a request leaves its row when it stops (<|assistant_end|> or <|bos|>), reaches its max_tokens or is cancelled
(a client gone), and the row is free for the next one at the following step. Busy rows are kept at the bottom (the
highest one moves into a freed row below it, keys and values copied), so a step computes exactly the busy rows. Temperature, top_k, seed and max_tokens
are per request (each request samples with its own torch.Generator). With greedy decoding a request gets the tokens
it would get alone through nanotrain.engine.Engine (the same per-row masking as Engine's mixed-length batches: equal
up to floating-point reduction order). The calculator tool runs per row as in Engine (ToolState). Requests beyond the
free rows wait in a bounded queue (max_queue); submit() refuses more with QueueFull. A reader either iterates a
Request (blocking, a thread per request) or, as the server does, takes what has come with Request.drain() when the
engine's `notify` callback names it (called once per decode step with every request that got something: one wake-up
per step, not per token). The server runs it in a process of its own (nanotrain.engine_process). The
continuous-batching idea is Orca's (Yu et al. 2022, "Orca: A Distributed Serving
System for Transformer-Based Generative Models").
"""

import concurrent.futures
import queue
import threading

import torch
import torch.nn.functional as F

from nanotrain.attention import KVCache
from nanotrain.engine import ToolState
from nanotrain.errors import UserError


def rows_view(cache, hi):
    """A KVCache over rows 0..hi-1 of `cache` (per-row mode), sharing its keys and values: per-row too, sharing the
    lengths (a forward with it advances those rows' lengths in `cache`), its pos the longest of those rows; for one
    row, a uniform cache at that row's length (no mask: the one-prompt path of Engine; the caller copies its pos
    back into the row's length)."""
    view = KVCache.__new__(KVCache)
    view.k_cache, view.v_cache = cache.k_cache[:, :hi], cache.v_cache[:, :hi]
    view.n_layer, view.max_len = cache.n_layer, cache.max_len
    view.lengths = cache.lengths[:hi] if hi > 1 else None
    view.pos = int(cache.lengths[:hi].max())
    view.prev_embedding = None if cache.prev_embedding is None else cache.prev_embedding[:hi]
    return view


def score_tokens(model, ids, k):
    """
    The log-probability of every token of `ids` (list[int], at least 2) given the ones before it, from one forward
    of `model`: (token_logprobs, top) with token_logprobs list[float] (len(ids) - 1: ids[1:]) and top a list of the
    k most likely (token id, log-probability) pairs at each of those positions, most likely first.
    """
    device = model.wte.weight.device
    lp = torch.log_softmax(model(torch.tensor([ids], device=device))[0, :-1], -1)  # (T - 1, vocab) fp32
    token_lp = lp.gather(1, torch.tensor(ids[1:], device=device)[:, None])[:, 0].tolist()
    values, idx = lp.topk(max(1, k), dim=-1)
    return token_lp, [list(zip(i, v)) for i, v in zip(idx.tolist(), values.tolist())]


def check_request(prompt, max_tokens, temperature, context_len):
    """Raises UserError for an empty prompt, max_tokens < 1, a negative temperature or a prompt + max_tokens over
    context_len."""
    if not prompt or max_tokens < 1 or temperature < 0:
        raise UserError("submit: expected a non-empty prompt, max_tokens >= 1 and temperature >= 0")
    if len(prompt) + max_tokens > context_len:
        raise UserError(f"submit: prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the context "
                        f"of {context_len} tokens")


class QueueFull(Exception):
    """submit() found max_queue requests waiting already."""


class Request:
    """
    One submitted generation. Iterating it yields its new token ids (int) as they are decoded (the tool's forced
    tokens included), ending before the stop token; `finish_reason` is then "stop" or "length". cancel() frees its
    row at the next step (what a server does when the client goes away). Raises in the iterating thread what the
    engine's thread raised for it.
    """

    def __init__(self, prompt, max_tokens, temperature, top_k, seed, tool, tag=None):
        self.prompt, self.max_tokens, self.temperature, self.top_k = list(prompt), max_tokens, temperature, top_k
        self.seed, self.tool, self.tag = seed, tool, tag  # tag: the caller's (EngineProcess: the request's id)
        self.tokens = queue.Queue()  # ints, then None at the end, or an exception
        self.cancelled = threading.Event()
        self.finish_reason = None

    def cancel(self):
        self.cancelled.set()

    def drain(self):
        """
        Without blocking: (the token ids that have come since the last call, done). done is True once the request
        has ended (finish_reason set); raises what the engine's thread raised for it. For readers woken by the
        engine's notify instead of a blocking iteration.
        """
        tokens = []
        while True:
            try:
                item = self.tokens.get_nowait()
            except queue.Empty:
                return tokens, False
            if item is None:
                return tokens, True
            if isinstance(item, BaseException):
                raise item
            tokens.append(item)

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
    hold (prompt + new tokens), default the model's max_seq_len. notify: None, or a callable the engine's thread
    calls after each step with the list of Requests that got tokens or ended in it (it must not block; a server
    hands it to its event loop). It may be set after construction.
    """

    def __init__(self, model, tokenizer, max_batch=8, max_queue=16, context_len=None, notify=None):
        self.model, self.tokenizer, self.max_batch, self.notify = model, tokenizer, max_batch, notify
        self.context_len = context_len or model.config.max_seq_len
        self.stop_ids = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
        self.waiting = queue.Queue(maxsize=max_queue)
        self.jobs = queue.Queue()  # (function of the model, Future) run by the engine's thread between steps
        self.rows = [None] * max_batch  # per row: the request decoding there, or None
        self.wake = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="nanotrain-batch-engine").start()

    def active(self):
        """How many rows are decoding now (int)."""
        return sum(r is not None for r in self.rows)

    def queued(self):
        """How many requests wait for a row (int)."""
        return self.waiting.qsize()

    def load(self):
        """Requests decoding or waiting (int): what a server balancing several engines compares."""
        return self.active() + self.queued()

    def score(self, ids, k):
        """score_tokens(model, ids, k), run by the engine's thread between two decode steps (the model is never run
        by two threads at once); blocks until done."""
        future = concurrent.futures.Future()
        self.jobs.put((lambda model: score_tokens(model, ids, k), future))
        self.wake.set()
        return future.result()

    def submit(self, prompt, max_tokens, temperature=0.0, top_k=None, seed=42, tool=False, tag=None):
        """
        Queues a generation of up to max_tokens new tokens after `prompt` (list[int]); returns its Request (tag kept
        on it). Raises UserError for an empty prompt, max_tokens < 1, a negative temperature or a prompt +
        max_tokens over context_len; QueueFull when max_queue requests are waiting.
        """
        check_request(prompt, max_tokens, temperature, self.context_len)
        req = Request(prompt, max_tokens, temperature, top_k, seed, tool, tag)
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
            while not self.jobs.empty():
                fn, future = self.jobs.get_nowait()
                try:
                    with torch.inference_mode():
                        future.set_result(fn(model))
                except Exception as e:  # noqa: BLE001 - the caller gets it
                    future.set_exception(e)
            if self.active() == 0 and self.waiting.empty():
                self.wake.wait()
                self.wake.clear()
                continue
            touched = []
            try:
                with torch.inference_mode():
                    self._step(cache, last, touched)
            except Exception as e:  # noqa: BLE001 - every active request gets the error; the engine goes on
                for r, req in enumerate(self.rows):
                    if req is not None:
                        req.tokens.put(e)
                        touched.append(req)
                        self.rows[r] = None
                cache.reset()
            if self.notify is not None and touched:
                self.notify(touched)

    def _step(self, cache, last, touched):
        """Admits waiting requests into the free rows (prefill: their first token), then one decode step of every
        busy row (a fresh row feeds its first token); each row's token goes to its request, and every request that
        got something is appended to `touched`."""
        self._compact(cache, last)
        admitted = []
        while self.active() + len(admitted) < self.max_batch and not self.waiting.empty():
            req = self.waiting.get_nowait()
            if req.cancelled.is_set():
                req.tokens.put(None)
                touched.append(req)
                continue
            req.rng = torch.Generator(device=cache.k_cache.device).manual_seed(req.seed)
            req.state = ToolState(self.tokenizer) if req.tool else None
            req.count = 0
            admitted.append(req)
        if admitted:
            self._prefill(admitted, cache, last)
            touched.extend(admitted)
        self._compact(cache, last)
        n = self.active()  # rows 0..n-1 decode, the rest are free: requests always sit in the lowest rows
        if n:
            view = rows_view(cache, n)
            logits = self.model(last[:n], kv_cache=view, last_only=True)[:, -1, :]  # (n, vocab) fp32
            if view.lengths is None:  # one row, decoded as a uniform cache
                cache.lengths[0] = view.pos
            if view.prev_embedding is not None:  # smear keeps each row's last embedding
                if cache.prev_embedding is None:
                    cache.prev_embedding = view.prev_embedding.new_zeros(self.max_batch, *view.prev_embedding.shape[1:])
                cache.prev_embedding[:n] = view.prev_embedding
            greedy = logits.argmax(dim=-1).tolist()  # one reduction for every row; sampled rows redo their own
            for r in range(n):
                touched.append(self.rows[r])
                self._emit(r, self.rows[r], logits[r], greedy[r], cache, last)
        cache.pos = int(cache.lengths.max()) if cache.lengths is not None else 0

    def _prefill(self, admitted, cache, last):
        """
        Prefills the admitted requests' prompts into the free rows lo.. (lo = the busy rows' count), a group of them
        per forward: the group's prompts right-padded to its longest, from position 0, causal, so a row's logits at
        its last prompt token see its own tokens only (the pad's keys sit past the row's length, which is then set
        to the prompt's: masked out from there on and overwritten by the row's next tokens). The pad repeats the
        prompt's last token, so the embedding the cache keeps of the last token fed (smear's) is the row's own.
        Groups: the prompts by length, a new group when a prompt is over twice the group's shortest + 32 tokens
        (bounded padding). Emits each request's first token.
        """
        lo, device = self.active(), last.device
        groups = []
        for req in sorted(admitted, key=lambda r: len(r.prompt)):
            n = len(req.prompt)
            if groups and n <= 2 * len(groups[-1][0].prompt) + 32:
                groups[-1].append(req)
            else:
                groups.append([req])
        for group in groups:
            lens = [len(r.prompt) for r in group]
            ids = torch.tensor([r.prompt + [r.prompt[-1]] * (lens[-1] - len(r.prompt)) for r in group],
                               dtype=torch.long, device=device)  # (k, longest) int64, right-padded
            sub = cache.rows(lo, lo + len(group))
            at = torch.tensor(lens, device=device) - 1
            logits = self.model(ids, kv_cache=sub, logits_at=at)[:, 0, :]  # (k, vocab) fp32
            cache.set_rows(lo, sub)
            for i, req in enumerate(group):
                cache.lengths[lo + i] = lens[i]
                self.rows[lo + i] = req
                self._emit(lo + i, req, logits[i], None, cache, last)
            lo += len(group)

    def _compact(self, cache, last):
        """Moves the highest busy rows into the free rows below them (their keys and values up to their length,
        length, last token, smear embedding, request), so that the busy rows are 0..active-1 and a decode step
        computes only those: a request that ends early does not leave a hole that the others' steps pay for."""
        lo, hi = 0, self.max_batch - 1
        while True:
            while lo < self.max_batch and self.rows[lo] is not None:
                lo += 1
            while hi >= 0 and self.rows[hi] is None:
                hi -= 1
            if lo >= hi:
                return
            n = int(cache.lengths[hi])
            cache.k_cache[:, lo, :, :n] = cache.k_cache[:, hi, :, :n]
            cache.v_cache[:, lo, :, :n] = cache.v_cache[:, hi, :, :n]
            cache.lengths[lo], cache.lengths[hi] = n, 0
            if cache.prev_embedding is not None:
                cache.prev_embedding[lo] = cache.prev_embedding[hi]
            last[lo] = last[hi]
            self.rows[lo], self.rows[hi] = self.rows[hi], None

    def _emit(self, r, req, logits, greedy, cache, last):
        """Picks row r's next token from its logits (vocab,) (or the tool's forced one; greedy: the argmax already
        taken, or None), hands it to the request and frees the row when the request is done."""
        forced = req.state.next_forced() if req.state is not None else None
        if forced is not None:
            tok = forced
        elif req.temperature == 0:
            tok = int(logits.argmax()) if greedy is None else greedy
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
