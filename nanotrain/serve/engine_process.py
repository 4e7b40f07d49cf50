"""
A nanotrain.serve.batch_engine.BatchEngine in a Python process of its own, for the server (scripts/chat_serve.py): the
server's process keeps the HTTP loop and the tokenizer, the engine's process the model, so the model's forward never
waits on the server's Python for the GIL. EngineProcess (the server's side) starts `python -m
nanotrain.serve.engine_process` and talks to it over two pipes: submit / cancel / score commands in, one message per
decode step out (each request's new tokens, its finish reason or error, the engine's busy and waiting counts).
"""

import concurrent.futures
import os
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

import torch

from nanotrain.errors import UserError
from nanotrain.serve.batch_engine import BatchEngine, QueueFull, Request, default_max_batch


class RemoteRequest(Request):
    """A Request of an EngineProcess: its tokens arrive from the engine's process; cancel() tells that process."""

    def __init__(self, engine, rid, gen):
        super().__init__(gen, tag=rid)
        self.engine = engine

    def cancel(self):
        if not self.cancelled.is_set():
            self.cancelled.set()
            self.engine.send(("cancel", self.tag))


class EngineProcess:
    """
    A BatchEngine in a Python process of its own (`python -m nanotrain.serve.engine_process`, fed over two pipes), so
    that the model's forward never waits on the server's Python for the GIL (a thread holding the GIL a third of the
    time slows the forward by a third or more: dev/LOG.md). The same interface as BatchEngine for a server: submit,
    active, queued, load, score, context_len, max_queue, notify (called by this process's reader thread, once per
    decode step of the engine, with the requests that got something). load: a picklable callable returning (model,
    tokenizer, checkpoint path, meta) in the engine's process, e.g. functools.partial(nanotrain.checkpoint.load_model,
    ...); threads: torch's threads there (0 keeps torch's default); prefill_chunk, compile: BatchEngine's (compile on
    CUDA only); max_batch 0: default_max_batch of the loaded model; max_queue 0: 2 x max_batch. The constructor
    returns once the model is loaded (max_batch, max_queue, context_len are then the engine's, and `sizing` a line
    saying where they came from); raises UserError with the engine process's one line when it cannot load (e.g. no
    checkpoint), or when it exits.
    submit raises QueueFull when max_batch + max_queue requests are outstanding. If the engine's process dies,
    every open request gets a RuntimeError and later submits are refused with UserError.
    """

    def __init__(self, load, max_batch=0, max_queue=0, context_len=0, threads=0, prefill_chunk=256, compile=False):
        commands_r, commands_w = os.pipe()
        events_r, events_w = os.pipe()
        self.process = subprocess.Popen([sys.executable, "-m", "nanotrain.serve.engine_process", str(commands_r),
                                         str(events_w)], pass_fds=(commands_r, events_w))
        os.close(commands_r)
        os.close(events_w)
        self.commands, self.events = Connection(commands_w, readable=False), Connection(events_r, writable=False)
        self.send_lock, self.next_id, self.requests, self.scores = threading.Lock(), 0, {}, {}
        self.max_batch, self.max_queue, self.notify, self.counts, self.dead = max_batch, max_queue, None, (0, 0), None
        self.send((load, dict(max_batch=max_batch, max_queue=max_queue, context_len=context_len, threads=threads,
                              prefill_chunk=prefill_chunk, compile=compile)))
        try:
            kind, *info = self.events.recv()
        except EOFError:
            raise UserError(f"the engine process exited with code {self.process.wait()} before loading the model"
                            ) from None
        if kind == "error":
            self.process.wait()
            raise UserError(info[0])
        self.path, self.meta, self.context_len, self.max_batch, self.max_queue, self.sizing = info
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

    def submit(self, gen):
        """As BatchEngine.submit (the same checks and errors) of `gen` (a GenerationRequest); returns a
        RemoteRequest."""
        gen.check(self.context_len)
        if self.dead is not None:
            raise UserError(self.dead)
        with self.send_lock:
            if len(self.requests) >= self.max_batch + self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting")
            rid, self.next_id = self.next_id, self.next_id + 1
            req = self.requests[rid] = RemoteRequest(self, rid, gen)
        self.send(("submit", rid, gen))
        return req

    def score(self, ids, k):
        """nanotrain.serve.batch_engine.score_tokens(the model, ids, k), computed in the engine's process between two
        decode steps."""
        future = concurrent.futures.Future()
        with self.send_lock:
            rid, self.next_id = self.next_id, self.next_id + 1
            self.scores[rid] = future
        if self.dead is not None:  # checked after the future is listed: _read fails the ones listed before it died
            self.scores.pop(rid, None)
            raise UserError(self.dead)
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
    """The engine process (EngineProcess): reads (load, the BatchEngine's settings and threads), loads the
    model, runs a BatchEngine, answers "ready" or "error"; then takes submit / cancel / score commands until the
    server's end of the pipe closes, and sends one "step" message per decode step. Ctrl-C is the server's to
    handle: ignored here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    send_lock = threading.Lock()

    def send(message):
        with send_lock:
            events.send(message)
    load, settings = commands.recv()
    context_len = settings["context_len"]
    try:
        if settings["threads"]:
            torch.set_num_threads(settings["threads"])
        model, tokenizer, path, meta = load()
        if context_len > model.rotary_len:
            raise UserError(f"--context_len={context_len}: at most {model.rotary_len} (10 x max_seq_len, the rotary "
                            f"table)")
        context_len = context_len or model.config.max_seq_len
        max_batch, sizing = settings["max_batch"], f"max_batch {settings['max_batch']} (--max_batch)"
        if not max_batch:
            max_batch, sizing = default_max_batch(model, context_len)
        max_queue = settings["max_queue"] or 2 * max_batch
        sizing += f"; max_queue {max_queue}" + ("" if settings["max_queue"] else " (2 x max_batch)")
        compile = settings["compile"] and model.wte.weight.device.type == "cuda"
        # the server (EngineProcess.submit) bounds the requests outstanding to max_batch + max_queue; the engine's own
        # queue holds them all, as a burst may arrive before its next step gives any a row
        engine = BatchEngine(model, tokenizer, max_batch, max_batch + max_queue, context_len,
                             prefill_chunk=settings["prefill_chunk"], compile=compile)
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
    send(("ready", path, meta, engine.context_len, max_batch, max_queue, sizing))

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
            _, rid, gen = message
            try:
                requests[rid] = engine.submit(gen, tag=rid)
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
