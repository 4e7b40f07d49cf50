"""
Continuous batching for the server (scripts/chat_serve.py): requests that arrive at different times share one decode
batch. One thread owns the model and a KVCache of max_batch rows in its per-row mode (nanotrain.attention.KVCache,
which owns its rows: rows / set_rows, move_row, free_row, head / merge): a new request is prefilled into a free row
(its prompt alone) at the next step and then decodes with the others, one token per row per step, each row at its own
position and attending to its own tokens only; a request leaves its row when it stops (<|assistant_end|> or <|bos|>,
unless it asked ignore_eos), reaches its max_tokens or is cancelled (a client gone), and the row is free for the next
one at the following step. Busy rows are kept at the bottom (the highest one moves into a freed row below it), so a
step computes exactly the busy rows.

Prefill between decode steps: each step prefills at most prefill_chunk prompt tokens before its decode. Prompts that
fit are prefilled whole, several in one forward; a longer prompt is prefilled prefill_chunk tokens per step into a
row kept aside (the top row) and joins the decode batch with its last chunk, so a long prompt delays the running
streams' next token by at most one chunk's forward (the chunked prefill of Sarathi-Serve, Agrawal et al. 2024, as
vLLM and SGLang do it), one such prompt at a time.

Each request is a nanotrain.serve.request.GenerationRequest, sampled with its own torch.Generator through
nanotrain.engine.sample_next. With greedy decoding a request gets the tokens it would get alone through
nanotrain.engine.Engine (the same per-row masking as Engine's mixed-length batches: equal up to floating-point
reduction order; a chunked prompt's keys too). The calculator tool runs per row as in Engine (ToolState). A failure
that belongs to one request (its seed, its sampling, its prompt's prefill, its tool) fails that request alone; the
others go on. Requests beyond the free rows wait in a bounded queue (max_queue); submit() refuses more with QueueFull.
A reader either iterates a Request (blocking, a thread per request) or, as the server does, takes what has come with
Request.drain() when the engine's `notify` callback names it (called once per decode step with every request that
got something: one wake-up per step, not per token). The server runs it in a process of its own
(nanotrain.serve.engine_process). The continuous-batching idea is Orca's (Yu et al. 2022, "Orca: A Distributed
Serving System for Transformer-Based Generative Models").
"""

import concurrent.futures
import os
import queue
import sys
import threading

import torch

from nanotrain.attention import KVCache
from nanotrain.engine import MIN_TEMPERATURE, ToolState, sample_next
from nanotrain.serve.decode import compiled_decode


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


KV_MEMORY_SHARE = {"cuda": 0.5, "cpu": 0.25}  # of the free memory after the model is loaded, the KV cache's at most
MAX_BATCH_CAP = {"cuda": 256, "cpu": 64}  # default max_batch at most: a CPU's decode step grows with each row


def default_max_batch(model, context_len):
    """
    The rows of a KV cache of context_len tokens each that fit KV_MEMORY_SHARE of the free memory of `model`'s device
    (CUDA: torch.cuda.mem_get_info; else the available RAM), at most MAX_BATCH_CAP of the device type (MPS: a CPU's),
    at least 1. Returns (max_batch, a line saying how it was chosen).
    """
    device = model.wte.weight.device
    kind = "cuda" if device.type == "cuda" else "cpu"
    c = model.config
    row = 2 * c.n_layer * c.n_kv_head * model.head_dim * context_len * model.wte.weight.element_size()  # bytes
    if kind == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # not Linux: assume room for the cap
            free = row * MAX_BATCH_CAP[kind] / KV_MEMORY_SHARE[kind]
    fit = int(free * KV_MEMORY_SHARE[kind] // row)
    n = max(1, min(fit, MAX_BATCH_CAP[kind]))
    return n, (f"max_batch {n}: a KV cache row of {context_len} tokens is {row / 2**20:.1f} MiB, "
               f"{KV_MEMORY_SHARE[kind]:.0%} of the {free / 2**30:.1f} GiB free on {device} holds {fit} rows, "
               f"at most {MAX_BATCH_CAP[kind]} on a {kind.upper()}")


class QueueFull(Exception):
    """submit() found max_queue requests waiting already."""


class Request:
    """
    One submitted generation: gen, its GenerationRequest. Iterating it yields its new token ids (int) as they are
    decoded (the tool's forced tokens included), ending before the stop token; `finish_reason` is then "stop" or
    "length". cancel() frees its row at the next step (what a server does when the client goes away). Raises in the
    iterating thread what the engine's thread raised for it.
    """

    def __init__(self, gen, tag=None):
        self.gen, self.tag = gen, tag  # tag: the caller's (EngineProcess: the request's id)
        self.tokens = queue.Queue()  # ints, then None at the end, or an exception
        self.cancelled = threading.Event()
        self.finish_reason = None

    def cancel(self):
        self.cancelled.set()

    def fail(self, error):
        """Ends the request with `error` (an exception) for its reader."""
        self.tokens.put(error)

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
    hold (prompt + new tokens), default the model's max_seq_len. prefill_chunk: prompt tokens prefilled per step at
    most (the module docstring). compile: the decode step through torch.compile(mode="reduce-overhead") (CUDA graphs;
    nanotrain.serve.decode), for CUDA. notify: None, or a callable the engine's thread calls after each step with the
    list of Requests that got tokens or ended in it (it must not block; a server hands it to its event loop). It may
    be set after construction.
    """

    def __init__(self, model, tokenizer, max_batch=8, max_queue=16, context_len=None, notify=None, prefill_chunk=256,
                 compile=False):
        self.model, self.tokenizer, self.max_batch, self.max_queue = model, tokenizer, max_batch, max_queue
        self.notify = notify
        self.context_len, self.prefill_chunk = context_len or model.config.max_seq_len, max(1, prefill_chunk)
        self.stop_ids = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}
        self.decode = compiled_decode(model, max_batch) if compile else None
        self.waiting = queue.Queue(maxsize=max_queue)
        self.jobs = queue.Queue()  # (function of the model, Future) run by the engine's thread between steps
        self.rows = [None] * max_batch  # per row: the request decoding there, or None
        self.next = None  # a request taken from `waiting` that did not fit this step's prefill yet
        self.filling = None  # the request whose long prompt is prefilled chunk by chunk into the top row
        self.steps = 0  # decode steps run (a test counts them)
        self.wake = threading.Event()
        threading.Thread(target=self._loop, daemon=True, name="nanotrain-batch-engine").start()

    def active(self):
        """How many rows are decoding now (int)."""
        return sum(r is not None for r in self.rows)

    def queued(self):
        """How many requests wait for a row (int), the one being prefilled in chunks included."""
        return self.waiting.qsize() + (self.next is not None) + (self.filling is not None)

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

    def submit(self, gen, tag=None):
        """
        Queues the generation `gen` (a nanotrain.serve.request.GenerationRequest); returns its Request (tag kept on
        it). Raises UserError as gen.check(context_len) does; QueueFull when max_queue requests are waiting.
        """
        gen.check(self.context_len)
        req = Request(gen, tag)
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
            if self.load() == 0:
                self.wake.wait()
                self.wake.clear()
                continue
            touched = []
            try:
                with torch.inference_mode():
                    self._step(cache, last, touched)
            except Exception as e:  # noqa: BLE001 - the shared decode forward failed: each request in it gets it
                for r, req in enumerate(self.rows):
                    if req is not None:
                        req.fail(e)
                        touched.append(req)
                        self.rows[r] = None
                if self.filling is not None:
                    self.filling.fail(e)
                    touched.append(self.filling)
                    self.filling = None
                cache.reset()
            if self.notify is not None and touched:
                self.notify(touched)

    def _take(self, touched):
        """The next waiting request that is not cancelled (self.next, else from the queue), left in self.next; or
        None. A cancelled one ends here (appended to `touched`)."""
        while self.next is None:
            try:
                req = self.waiting.get_nowait()
            except queue.Empty:
                return None
            if req.cancelled.is_set():
                req.finish_reason = "stop"
                req.tokens.put(None)
                touched.append(req)
                continue
            self.next = req
        return self.next

    def _start(self, req, device, touched):
        """Gives `req` its generator and tool state; True, or False when that fails (the request fails alone)."""
        try:
            req.rng = torch.Generator(device=device).manual_seed(req.gen.seed)
            req.state = ToolState(self.tokenizer) if req.gen.tool else None
            req.count = 0
            return True
        except Exception as e:  # noqa: BLE001 - e.g. a seed torch cannot take
            req.fail(e)
            touched.append(req)
            return False

    def _step(self, cache, last, touched):
        """Prefills up to prefill_chunk prompt tokens (the chunked prompt's next chunk first, then waiting prompts
        that fit whole, or a long one starting its chunks), then one decode step of every busy row (a fresh row
        feeds its first token); each row's token goes to its request, and every request that got something is
        appended to `touched`."""
        self._compact(cache, last)
        device = last.device
        if self.filling is not None and self.filling.cancelled.is_set():  # its client left during its chunks
            req, self.filling = self.filling, None
            cache.free_row(self.max_batch - 1)
            req.finish_reason = "stop"
            req.tokens.put(None)
            touched.append(req)
        budget = self.prefill_chunk - (self._fill(cache, last, self.prefill_chunk, touched) if self.filling else 0)
        admitted = []
        while self.active() + len(admitted) + (self.filling is not None) < self.max_batch and budget > 0:
            req = self._take(touched)
            if req is None:
                break
            n = len(req.gen.prompt)
            if n > budget and (n <= self.prefill_chunk or self.filling is not None):
                break  # fits a later step whole, or waits for the chunked one to finish
            self.next = None
            if not self._start(req, device, touched):
                continue
            if n <= budget:
                admitted.append(req)
                budget -= n
            else:
                req.filled, self.filling = 0, req
                budget -= self._fill(cache, last, budget, touched)
        if admitted:
            self._prefill(admitted, cache, last, touched)
            touched.extend(admitted)
        self._compact(cache, last)
        n = self.active()  # rows 0..n-1 decode, the rest are free: requests always sit in the lowest rows
        if n:
            self.steps += 1
            logits = None
            if self.decode is not None:
                try:
                    logits = self.decode(last, cache, n)
                except Exception as e:  # noqa: BLE001 - a compile that fails here: the eager step from now on
                    print(f"warning: the compiled decode step failed ({type(e).__name__}: {e}); decoding eagerly",
                          file=sys.stderr, flush=True)
                    self.decode = None
            if logits is None:
                view = cache.head(n)
                logits = self.model(last[:n], kv_cache=view, last_only=True)[:, -1, :]  # (n, vocab) fp32
                cache.merge(view)
            greedy = sample_next(logits, 0.0)[:, 0].tolist()  # one argmax for every row; sampled rows draw their own
            for r in range(n):
                touched.append(self.rows[r])
                self._emit(r, self.rows[r], logits[r], greedy[r], cache, last)

    def _fill(self, cache, last, budget, touched):
        """Prefills the next chunk (at most `budget` tokens) of the chunked prompt into the top row; after its last
        chunk the row moves down to the first free row and decodes from the next step on. Returns the tokens
        prefilled. A failure fails that request alone."""
        req, top = self.filling, self.max_batch - 1
        prompt, done = req.gen.prompt, req.filled
        k = min(budget, len(prompt) - done)
        try:
            sub = cache.rows(top, top + 1, pos=done)
            ids = torch.tensor([prompt[done:done + k]], dtype=torch.long, device=last.device)
            logits = self.model(ids, kv_cache=sub, last_only=True)[:, -1, :]  # (1, vocab) fp32
            cache.set_rows(top, sub)
        except Exception as e:  # noqa: BLE001 - this prompt's failure, not the batch's
            self.filling = None
            cache.free_row(top)
            req.fail(e)
            touched.append(req)
            return k
        req.filled += k
        if req.filled == len(prompt):
            self.filling, r = None, self.active()
            cache.move_row(top, r)
            self.rows[r] = req
            touched.append(req)
            self._emit(r, req, logits[0], None, cache, last)
        return k

    def _prefill(self, admitted, cache, last, touched):
        """
        Prefills the admitted requests' prompts into the free rows lo.. (lo = the busy rows' count), a group of them
        per forward: the group's prompts right-padded to its longest, from position 0, causal, so a row's logits at
        its last prompt token see its own tokens only (the pad's keys sit past the row's length, which is then set
        to the prompt's: masked out from there on and overwritten by the row's next tokens). The pad repeats the
        prompt's last token, so the embedding the cache keeps of the last token fed (smear's) is the row's own.
        Groups: the prompts by length, a new group when a prompt is over twice the group's shortest + 32 tokens
        (bounded padding). A group whose forward fails is prefilled one request at a time, so only a request that
        fails alone fails. Emits each request's first token.
        """
        groups = []
        for req in sorted(admitted, key=lambda r: len(r.gen.prompt)):
            n = len(req.gen.prompt)
            if groups and n <= 2 * len(groups[-1][0].gen.prompt) + 32:
                groups[-1].append(req)
            else:
                groups.append([req])
        for group in groups:
            try:
                self._prefill_group(group, cache, last)
            except Exception as e:  # noqa: BLE001
                if len(group) == 1:
                    group[0].fail(e)
                    touched.append(group[0])
                    continue
                for req in group:
                    self._prefill([req], cache, last, touched)

    def _prefill_group(self, group, cache, last):
        """One forward of `group`'s right-padded prompts into the rows from self.active() on (see _prefill)."""
        lo, device = self.active(), last.device
        lens = [len(r.gen.prompt) for r in group]
        ids = torch.tensor([r.gen.prompt + [r.gen.prompt[-1]] * (lens[-1] - n) for r, n in zip(group, lens)],
                           dtype=torch.long, device=device)  # (k, longest) int64, right-padded
        sub = cache.rows(lo, lo + len(group))
        at = torch.tensor(lens, device=device) - 1
        logits = self.model(ids, kv_cache=sub, logits_at=at)[:, 0, :]  # (k, vocab) fp32
        cache.set_rows(lo, sub, lens)
        for i, req in enumerate(group):
            self.rows[lo + i] = req
            self._emit(lo + i, req, logits[i], None, cache, last)

    def _compact(self, cache, last):
        """Moves the highest busy rows into the free rows below them (KVCache.move_row, last token, request), so
        that the busy rows are 0..active-1 and a decode step computes only those: a request that ends early does
        not leave a hole that the others' steps pay for. The top row of a chunked prompt is not a busy row."""
        lo, hi = 0, self.max_batch - 1
        while True:
            while lo < self.max_batch and self.rows[lo] is not None:
                lo += 1
            while hi >= 0 and self.rows[hi] is None:
                hi -= 1
            if lo >= hi:
                return
            cache.move_row(hi, lo)
            last[lo] = last[hi]
            self.rows[lo], self.rows[hi] = self.rows[hi], None

    def _emit(self, r, req, logits, greedy, cache, last):
        """Picks row r's next token from its logits (vocab,) (or the tool's forced one; greedy: the argmax already
        taken, or None), hands it to the request and frees the row when the request is done. What fails here fails
        this request alone: its row is freed and its reader gets the exception."""
        gen = req.gen
        try:
            forced = req.state.next_forced() if req.state is not None else None
            if forced is not None:
                tok = forced
            elif gen.temperature < MIN_TEMPERATURE and greedy is not None:
                tok = greedy
            else:
                tok = int(sample_next(logits, gen.temperature, gen.top_k, req.rng))
            if req.state is not None:
                req.state.feed(tok)
        except Exception as e:  # noqa: BLE001 - this request's failure, not the batch's
            req.fail(e)
            self.rows[r] = None
            cache.free_row(r)
            return
        last[r, 0] = tok
        if req.cancelled.is_set() or (tok in self.stop_ids and not gen.ignore_eos):
            req.finish_reason = "stop"
        else:
            req.tokens.put(tok)
            req.count += 1
            if req.count >= gen.max_tokens:
                req.finish_reason = "length"
        if req.finish_reason is not None:
            req.tokens.put(None)
            self.rows[r] = None
            cache.free_row(r)
