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
per step, not per token). The continuous-batching idea is Orca's (Yu et al. 2022, "Orca: A Distributed Serving
System for Transformer-Based Generative Models").
"""

import concurrent.futures
import os
import queue
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

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


# ----------------------------------------------------------------------------- an engine in a process of its own
class RemoteRequest(Request):
    """A Request of an EngineProcess: its tokens arrive from the engine's process; cancel() tells that process."""

    def __init__(self, engine, rid, *args):
        super().__init__(*args, tag=rid)
        self.engine = engine

    def cancel(self):
        if not self.cancelled.is_set():
            self.cancelled.set()
            self.engine.send(("cancel", self.tag))


class EngineProcess:
    """
    A BatchEngine in a Python process of its own (`python -m nanotrain.batch_engine`, fed over two pipes), so that
    the model's forward never waits on the server's Python for the GIL (a thread holding the GIL a third of the time
    slows the forward by a third or more: dev/LOG.md). The same interface as BatchEngine for a server: submit,
    active, queued, load, score, context_len, notify (called by this process's reader thread, once per decode step
    of the engine, with the requests that got something). load: a picklable callable returning (model, tokenizer,
    checkpoint path, meta) in the engine's process, e.g. functools.partial(nanotrain.checkpoint.load_model, ...);
    threads: torch's threads there (0 keeps torch's default). The constructor returns once the model is loaded;
    raises UserError with the engine process's one line when it cannot load (e.g. no checkpoint), or when it exits.
    submit raises QueueFull when max_batch + max_queue requests are outstanding. If the engine's process dies,
    every open request gets a RuntimeError and later submits are refused with UserError.
    """

    def __init__(self, load, max_batch=8, max_queue=16, context_len=0, threads=0):
        commands_r, commands_w = os.pipe()
        events_r, events_w = os.pipe()
        self.process = subprocess.Popen([sys.executable, "-m", "nanotrain.batch_engine", str(commands_r),
                                         str(events_w)], pass_fds=(commands_r, events_w))
        os.close(commands_r)
        os.close(events_w)
        self.commands, self.events = Connection(commands_w, readable=False), Connection(events_r, writable=False)
        self.send_lock, self.next_id, self.requests, self.scores = threading.Lock(), 0, {}, {}
        self.max_batch, self.max_queue, self.notify, self.counts, self.dead = max_batch, max_queue, None, (0, 0), None
        self.send((load, max_batch, max_queue, context_len, threads))
        try:
            kind, *info = self.events.recv()
        except EOFError:
            raise UserError(f"the engine process exited with code {self.process.wait()} before loading the model"
                            ) from None
        if kind == "error":
            self.process.wait()
            raise UserError(info[0])
        self.path, self.meta, self.context_len = info
        threading.Thread(target=self._read, daemon=True, name="nanotrain-engine-events").start()

    def send(self, message):
        with self.send_lock:
            try:
                self.commands.send(message)
            except OSError:  # the engine's process is gone: _read fails its requests
                pass

    def active(self):
        """Rows decoding in the engine's process after its last step (int)."""
        return self.counts[0]

    def queued(self):
        """Requests waiting for a row there after its last step (int)."""
        return self.counts[1]

    def load(self):
        """Requests submitted and not finished (int), known at once: what the least-loaded choice compares."""
        return len(self.requests)

    def submit(self, prompt, max_tokens, temperature=0.0, top_k=None, seed=42, tool=False):
        """As BatchEngine.submit (the same checks and errors); returns a RemoteRequest."""
        check_request(prompt, max_tokens, temperature, self.context_len)
        if self.dead is not None:
            raise UserError(self.dead)
        with self.send_lock:
            if len(self.requests) >= self.max_batch + self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting")
            rid, self.next_id = self.next_id, self.next_id + 1
            req = self.requests[rid] = RemoteRequest(self, rid, prompt, max_tokens, temperature, top_k, seed, tool)
        self.send(("submit", rid, list(prompt), max_tokens, temperature, top_k, seed, tool))
        return req

    def score(self, ids, k):
        """score_tokens(the model, ids, k), computed in the engine's process between two decode steps."""
        future = concurrent.futures.Future()
        with self.send_lock:
            rid, self.next_id = self.next_id, self.next_id + 1
            self.scores[rid] = future
        self.send(("score", rid, list(ids), k))
        return future.result()

    def _read(self):
        while True:
            try:
                message = self.events.recv()
            except (EOFError, OSError):
                self.dead = f"the engine process exited with code {self.process.wait()}"
                error = RuntimeError(self.dead)
                for req in list(self.requests.values()):
                    req.tokens.put(error)
                for future in list(self.scores.values()):
                    future.set_exception(error)
                if self.notify is not None and self.requests:
                    self.notify(list(self.requests.values()))
                self.requests.clear()
                return
            if message[0] == "scored":
                _, rid, result, error = message
                future = self.scores.pop(rid)
                future.set_result(result) if error is None else future.set_exception(RuntimeError(error))
                continue
            _, items, active, queued = message
            touched = []
            for rid, tokens, finish_reason, error in items:
                req = self.requests.get(rid)
                if req is None:
                    continue
                for tok in tokens:
                    req.tokens.put(tok)
                if error is not None or finish_reason is not None:
                    req.finish_reason = finish_reason
                    req.tokens.put(RuntimeError(error) if error is not None else None)
                    del self.requests[rid]
                touched.append(req)
            self.counts = (active, queued)
            if self.notify is not None and touched:
                self.notify(touched)


def engine_main(commands, events):
    """The engine process (EngineProcess): reads (load, max_batch, max_queue, context_len, threads), loads the
    model, runs a BatchEngine, answers "ready" or "error"; then takes submit / cancel / score commands until the
    server's end of the pipe closes, and sends one "step" message per decode step. Ctrl-C is the server's to
    handle: ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    send_lock = threading.Lock()

    def send(message):
        with send_lock:
            events.send(message)
    load, max_batch, max_queue, context_len, threads = commands.recv()
    try:
        if threads:
            torch.set_num_threads(threads)
        model, tokenizer, path, meta = load()
        if context_len > model.rotary_len:
            raise UserError(f"--context_len={context_len}: at most {model.rotary_len} (10 x max_seq_len, the rotary "
                            f"table)")
        engine = BatchEngine(model, tokenizer, max_batch, max_queue, context_len or None)
    except UserError as e:
        send(("error", str(e)))
        return
    requests = {}

    def notify(touched):
        items = []
        for req in dict.fromkeys(touched):  # each once, in order
            try:
                tokens, done = req.drain()
                error = None
            except Exception as e:  # noqa: BLE001 - what the engine raised for this request goes to its client
                tokens, done, error = [], True, f"{type(e).__name__}: {e}"
            items.append((req.tag, tokens, req.finish_reason if done else None, error))
            if done:
                requests.pop(req.tag, None)
        send(("step", items, engine.active(), engine.queued()))
    engine.notify = notify
    send(("ready", path, meta, engine.context_len))

    def scored(rid, ids, k):
        try:
            send(("scored", rid, engine.score(ids, k), None))
        except Exception as e:  # noqa: BLE001
            send(("scored", rid, None, f"{type(e).__name__}: {e}"))
    while True:
        try:
            message = commands.recv()
        except (EOFError, OSError):
            return  # the server is gone
        if message[0] == "submit":
            _, rid, prompt, max_tokens, temperature, top_k, seed, tool = message
            try:
                requests[rid] = engine.submit(prompt, max_tokens, temperature, top_k, seed, tool, tag=rid)
            except (UserError, QueueFull) as e:
                send(("step", [(rid, [], None, str(e))], engine.active(), engine.queued()))
        elif message[0] == "cancel":
            req = requests.get(message[1])
            if req is not None:
                req.cancel()
        elif message[0] == "score":
            threading.Thread(target=scored, args=message[1:], daemon=True).start()


if __name__ == "__main__":  # an EngineProcess's process: the two pipes' file descriptors
    engine_main(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
