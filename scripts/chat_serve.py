"""
Talk to a trained model from a browser or any OpenAI-compatible client: an HTTP server (FastAPI on uvicorn) with
OpenAI's chat completions API and a chat page.

    python scripts/chat_serve.py                                   # the latest stage's newest checkpoint
    python scripts/chat_serve.py --source=sft --run_name=cpu --port=8000
    # then open http://127.0.0.1:8000, or: OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")

Endpoints:
  POST /v1/chat/completions  OpenAI's request and response schema: messages (system, user, assistant), max_tokens or
                             max_completion_tokens (absent: up to the end of the context, at most --max_tokens when
                             set), temperature (below 1e-6 greedy), top_k and ignore_eos (extensions, as vLLM's), seed,
                             stop (the reply ends before the first stop string; text that may begin one is held
                             back until it cannot), stream, stream_options. Streaming answers Server-Sent Events in OpenAI's chunk format (the first
                             chunk carries the role, the last finish_reason "stop" or "length", then with
                             stream_options.include_usage one with the usage, then `data: [DONE]`); a chunk carries
                             what was decoded since the one before (one token unless the client reads slower than
                             the engine decodes), never half a character. Otherwise one JSON object with usage. A leading system message is folded into the first user message, as the chat
                             format has no system role (nanotrain.tokenizer.render_conversation). The calculator runs
                             inside generation; its call reaches the client as readable text, as chat_cli shows it.
  POST /v1/completions       prompt (a string, token ids, or a list of either), max_tokens (0 with echo), temperature,
                             top_k, seed, echo, logprobs (the top n per token, at most 5): text completion with the
                             log-probability of every token, so lm-evaluation-harness's `local-completions` model
                             scores log-likelihood tasks on the native checkpoint (a text prompt starts with <|bos|>).
  GET /v1/models, GET /health (503 once an engine's process has died), GET / (the chat page, scripts/chat_serve.html: no build step, nothing from a CDN).
Requests are decoded together with continuous batching (nanotrain.serve.batch_engine: a request joins the running
batch at the next decode step, --max_batch rows at most (by default what the KV cache's memory allows, at most 64 on a CPU and
256 on a GPU: printed at start), --max_queue more waiting, beyond that 429; a long prompt is prefilled
--prefill_chunk tokens per step between decode steps; on CUDA the decode step is a CUDA graph), in a process of its own
(nanotrain.serve.engine_process.EngineProcess: the model's forward never waits for the HTTP loop's GIL); with --num_gpus=N
one engine process per GPU, each request going to the least loaded (requests submitted and not finished); a client that goes away
mid-stream frees its row within one decode step (a non-streamed request's too), and a slow reader holds only its own request. Errors are OpenAI error objects ({"error": {"message", "type",
"param", "code"}}) with the status: 400 (a bad field, max_tokens beyond the context or a prompt that fills it: code
"context_length_exceeded", on which the chat page drops the conversation's oldest turns; temperature or top_k out
of range, n other than 1, JSON nested too deep or a number over 4300 digits), 401 (--api_key set and no matching
`Authorization: Bearer`, compared in constant time), 403 (a Host header naming another site: DNS rebinding; see
--allowed_hosts), 404, 405, 413 (a body over --max_body_bytes, chunked or not: reading stops at the limit), 415 (a
/v1/ POST that is not Content-Type: application/json, so a page on another site cannot post a form to it), 422 (not
JSON), 429 (the queue is full), 503 (the engine's process died). The guards are nanotrain.serve.http_guard's.
Connections: one open with no request in progress (not yet sent its headers, or idle between keep-alive requests)
is closed after --idle_timeout seconds, and one beyond --max_connections closes the longest-idle one, so idle
sockets cannot use up the server's open files (uvicorn's limit_concurrency is not used: it counts idle connections
too and would answer every request 503). Behind a proxy (nginx, Caddy) these limits may live there instead. It binds
127.0.0.1 unless --host says otherwise.
"""

import asyncio
import contextlib
import functools
import json
import os
import time
import uuid

import torch

import nanotrain.interrupt  # noqa: F401 (Ctrl-C: one line, exit 130)
from nanotrain.checkpoint import find_run_dir, load_model
from nanotrain.common import autodetect_device_type, run_script
from nanotrain.configurator import configure, ints
from nanotrain.errors import UserError
from nanotrain.serve.batch_engine import QueueFull
from nanotrain.serve.engine_process import EngineProcess
from nanotrain.serve.http_guard import Guard, guarded_protocol, install_error_handlers, until_gone
from nanotrain.serve.reply import Reply
from nanotrain.serve.request import APIError, GenerationRequest, chat_request, sampling
from nanotrain.tokenizer import get_tokenizer

# ----------------------------------------------------------------------------- settings
source = ""  # which stage's checkpoint: rl | sft | mid | base; "" is the latest stage that has one (rl, sft, mid)
run_name = ""  # run name; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
host = "127.0.0.1"  # the address to bind; 0.0.0.0 exposes the server to the network
port = 8000  # the TCP port; 0 picks a free one (printed)
api_key = ""  # require `Authorization: Bearer <api_key>`; "" reads NANOTRAIN_API_KEY, and none of both means no key
max_tokens = 0  # new tokens at most of a reply whose request does not say; 0: up to the end of the context
context_len = 0  # tokens a request may hold (prompt + reply); 0 is the model's max_seq_len (at most 10x it)
max_batch = 0  # requests decoded together at most (KV cache rows); 0: from the KV cache's memory, <= 64 on a CPU, 256 on a GPU
max_queue = 0  # requests waiting for a free row at most, more are answered 429; 0: 2 x max_batch
prefill_chunk = 256  # prompt tokens prefilled per decode step at most: a longer prompt goes in chunks between steps
compile_decode = True  # on CUDA, the decode step through torch.compile(mode="reduce-overhead") (CUDA graphs)
max_body_bytes = 1_000_000  # the largest request body; larger is answered 413
max_messages = 64  # messages per request at most
allowed_hosts = ""  # more Host names to answer, comma-separated (e.g. myserver.lan); "*" answers any Host (only behind a proxy that checks it). Always answered: localhost, 127.0.0.1, [::1], --host, and any IP address when --host is 0.0.0.0 or ::
idle_timeout = 10  # seconds a connection may stay open with no request in progress (before its first request's headers are in, or between keep-alive requests; then it is closed), and that a request's body may take to arrive after its headers (then 408)
max_connections = 0  # open connections at most; one more closes the longest-idle one (or itself when none is idle). 0: min(1024, half the open-file limit, ulimit -n)
num_gpus = 1  # engines, one per GPU (cuda:0..N-1), each request to the least loaded; on a CPU N engines share the cores
tool = True  # run the calculator tool when the model calls it
device_type = ""  # cuda | mps | cpu; "" autodetects
cpu_threads = 0  # torch's threads when serving on a CPU; 0: every core but one (the HTTP loop's)
config = configure(globals(), rules={"max_tokens": ints(0, note="0: up to the end of the context")})
# -----------------------------------------------------------------------------

HTML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_serve.html")


def make_app(engines, tokenizer, model_id, key):
    """The FastAPI app serving `engines` (nanotrain.serve.engine_process.EngineProcess or batch_engine.BatchEngine
    objects of one checkpoint, one per device; each request goes to the least loaded). key: the bearer token required, or
    ""."""
    from fastapi import FastAPI, Request
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

    loop = None  # the server's event loop, known once it runs

    @contextlib.asynccontextmanager
    async def lifespan(app):
        nonlocal loop
        loop = asyncio.get_running_loop()
        for engine in engines:
            engine.notify = woken
        yield

    app = FastAPI(title="nanotrain", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    # Host, API key, JSON content type, body size, the body parsed once (request.state.json): nanotrain.serve.http_guard
    app.add_middleware(Guard, bound_host=host, allowed_hosts=allowed_hosts.split(","), key=key,
                       max_body_bytes=max_body_bytes, body_timeout=idle_timeout)
    install_error_handlers(app)
    context_len = engines[0].context_len

    def least_loaded():
        live = [e for e in engines if not getattr(e, "dead", None)]
        if not live:
            raise APIError(503, "; ".join(e.dead for e in engines), None, "server_error")
        return min(live, key=lambda e: e.load())

    def counts(prompt_tokens, completion_tokens):
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def error(e):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(APIError)
    async def api_error(request, e):
        return error(e)

    @app.get("/health")
    async def health():
        dead = [getattr(e, "dead", None) for e in engines]
        if any(dead):
            return error(APIError(503, "; ".join(d for d in dead if d), None, "server_error"))
        per = [{"decoding": e.active(), "waiting": e.queued()} for e in engines]
        return {"status": "ok", "model": model_id, "decoding": sum(p["decoding"] for p in per),
                "waiting": sum(p["waiting"] for p in per), "engines": per}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "nanotrain"}]}

    @app.get("/", response_class=HTMLResponse)
    async def page():
        with open(HTML, encoding="utf-8") as f:
            return f.read()

    def woken(reqs):  # the engine's thread, once per decode step: wake the handlers of the requests it touched
        loop.call_soon_threadsafe(wake, reqs)

    def wake(reqs):
        for r in reqs:
            event = getattr(r, "event", None)
            if event is not None:
                event.set()

    async def replies(req):
        """Yields (text delta, None) as the request's tokens come (its stop strings applied: Reply), coalescing what
        came since the last wake-up into one delta, then ("", (finish_reason, completion_tokens)); raises what the
        engine raised for it. Cancels the request when left early (a client gone) or at a stop string."""
        reply = Reply(tokenizer, req.gen.stop)
        try:
            while True:
                await req.event.wait()
                req.event.clear()
                tokens, done = req.drain()
                delta, stopped = reply.add(tokens, final=done)
                if stopped:
                    req.cancel()
                    if delta:
                        yield delta, None
                    yield "", ("stop", reply.count)
                    return
                if delta:
                    yield delta, None
                if done:
                    yield "", (req.finish_reason or "stop", reply.count)
                    return
        finally:
            req.cancel()

    def complete(request, echo, logprobs, submitted=None):
        """One completion choice of `request` (a GenerationRequest; max_tokens 0: none): the new tokens (through the
        batch engine), and with echo or logprobs the log-probabilities of every token from one forward of prompt +
        completion. submitted: a list the engine's request is appended to (whoever holds it may cancel it)."""
        batch = least_loaded()
        ids, n = request.prompt, request.max_tokens
        req = batch.submit(request) if n > 0 else []
        if submitted is not None and n > 0:
            submitted.append(req)
        new = list(req)
        full = ids + new
        first = 0 if echo else len(ids)
        choice = {"text": tokenizer.decode(full[first:]), "finish_reason": "length" if len(new) >= n else "stop",
                  "logprobs": None, "completion_tokens": len(new)}
        if logprobs is not None:
            scores, tops = batch.score(full, logprobs) if len(full) > 1 else ([], [])
            tokens = [tokenizer.decode([t]) for t in full]
            token_lp = [None] + scores
            top = [None] + [{tokenizer.decode([j]): v for j, v in pairs} for pairs in tops]
            offsets, pos = [], 0
            for t in tokens[first:]:
                offsets.append(pos)
                pos += len(t)
            choice["logprobs"] = {"tokens": tokens[first:], "token_logprobs": token_lp[first:],
                                  "top_logprobs": top[first:], "text_offset": offsets}
        return choice

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = request.state.json  # read, size-checked and parsed by the Guard middleware
        if not isinstance(body, dict):
            return error(APIError(400, "the request body must be a JSON object"))
        prompt = body.get("prompt")
        is_ids = lambda p: isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)  # noqa: E731
                                                              and 0 <= t < tokenizer.get_vocab_size() for t in p)
        if isinstance(prompt, str) or is_ids(prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            prompts = prompt
        else:
            return error(APIError(400, "prompt: expected a string, a list of token ids, or a list of either", "prompt"))
        bos = tokenizer.get_bos_token_id()
        prompts = [tokenizer.encode(p, prepend=bos) if isinstance(p, str) else list(p) for p in prompts]
        echo, logprobs = body.get("echo", False), body.get("logprobs")
        n = body.get("max_tokens", 16)
        if not isinstance(echo, bool):
            return error(APIError(400, "echo: expected true or false", "echo"))
        if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool) or
                                     not 0 <= logprobs <= 5):
            return error(APIError(400, "logprobs: expected an integer in [0, 5]", "logprobs"))
        if not isinstance(n, int) or isinstance(n, bool) or n < (0 if echo else 1):
            return error(APIError(400, "max_tokens: expected an integer >= 1 (>= 0 with echo)", "max_tokens"))
        if len(prompts) > max_messages or max(map(len, prompts)) + n > context_len:
            return error(APIError(400, f"prompt: at most {max_messages} prompts of at most {context_len} tokens with "
                                       f"max_tokens", "prompt"))
        try:
            temperature, top_k, seed = sampling(body)
        except APIError as e:
            return error(e)
        loop, submitted = asyncio.get_running_loop(), []

        async def run():
            return [await loop.run_in_executor(None, complete, GenerationRequest(ids, n, temperature, top_k, seed), echo,
                                               logprobs, submitted) for ids in prompts]
        finished = False
        try:
            finished, choices = await until_gone(request, run())
        except QueueFull:
            return error(APIError(429, f"{engines[0].max_queue} requests are waiting already; try again later",
                                  None, "rate_limit_error"))
        finally:
            for req in submitted if not finished else []:  # a client gone (or an error): its generations stop
                req.cancel()
        if not finished:
            return error(APIError(499, "the client closed the connection"))
        used = sum(c.pop("completion_tokens") for c in choices)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model_id, "choices": [dict(c, index=i) for i, c in enumerate(choices)],
                "usage": {"prompt_tokens": sum(map(len, prompts)), "completion_tokens": used}}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = request.state.json  # read, size-checked and parsed by the Guard middleware
        try:
            gen, stream, usage = chat_request(body, tokenizer, context_len, max_messages, max_tokens)
        except APIError as e:
            return error(e)
        gen.tool = tool
        try:
            req = least_loaded().submit(gen)
        except QueueFull:
            return error(APIError(429, f"{engines[0].max_queue} requests are waiting already; try again later",
                                  None, "rate_limit_error"))
        req.event = asyncio.Event()  # before any await: the engine's wake-ups run on this loop, after it
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(delta, finish=None):
            return "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                          "model": model_id, "choices": [{"index": 0, "delta": delta,
                                                                          "finish_reason": finish}]}) + "\n\n"
        if stream:
            async def events():
                yield chunk({"role": "assistant", "content": ""})
                try:
                    async for delta, end in replies(req):
                        if end is None:
                            yield chunk({"content": delta})
                    yield chunk({}, end[0])
                    if usage:
                        yield "data: " + json.dumps({"id": rid, "object": "chat.completion.chunk", "created": created,
                                                     "model": model_id, "choices": [],
                                                     "usage": counts(len(gen.prompt), end[1])}) + "\n\n"
                except Exception as e:  # noqa: BLE001 - reaches the client as an error event, the server goes on
                    yield "data: " + json.dumps(APIError(500, str(e), None, "server_error").body()) + "\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        async def collect():
            parts, end = [], None
            async for delta, end in replies(req):
                parts.append(delta)
            return parts, end
        try:
            finished, got = await until_gone(request, collect())  # a client gone: cancelled, its row freed
        except Exception as e:  # noqa: BLE001 - the engine's process died mid-reply: 503, as for the requests after
            status = 503 if getattr(getattr(req, "engine", None), "dead", None) else 500
            return error(APIError(status, str(e), None, "server_error"))
        if not finished:
            return error(APIError(499, "the client closed the connection"))
        parts, end = got
        return {"id": rid, "object": "chat.completion", "created": created, "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                             "finish_reason": end[0]}],
                "usage": counts(len(gen.prompt), end[1])}

    return app


def main():
    import uvicorn
    device = torch.device(device_type or autodetect_device_type())
    stage = source
    if not stage:
        stage = next((s for s in ("rl", "sft", "mid") if find_run_dir(s, run_name) is not None), None)
        if stage is None:
            raise UserError("no rl, sft or mid checkpoint found; train a chat model first (python scripts/chat_sft.py),"
                            " or pass --source=base")
    if device.type == "cuda" and num_gpus > torch.cuda.device_count():
        raise UserError(f"--num_gpus={num_gpus}: this machine has {torch.cuda.device_count()} GPUs")
    devices = [torch.device("cuda", i) if device.type == "cuda" else device for i in range(num_gpus)]
    # each engine in a process of its own (the model's forward never waits for this process's GIL); on a CPU the
    # model gets every core but one, the HTTP loop the last
    threads = (cpu_threads or max(1, (os.cpu_count() or 2) - 1)) if device.type == "cpu" else 0
    sizes = dict(context_len=context_len, threads=threads, prefill_chunk=prefill_chunk, compile=compile_decode)
    first = EngineProcess(functools.partial(load_model, stage, run_name, step, devices[0]), max_batch, max_queue,
                          **sizes)
    path, meta = first.path, first.meta  # the others load the same checkpoint, even if a newer one appeared
    print(first.sizing, flush=True)  # max_batch and max_queue, and where they came from
    engines = [first] + [EngineProcess(functools.partial(load_model, stage, run_name, meta["step"], d),
                                       first.max_batch, first.max_queue, **sizes) for d in devices[1:]]
    tokenizer = get_tokenizer()  # the engines checked that it is the checkpoint's
    model_id = f"nanotrain-{stage}-{os.path.basename(os.path.dirname(os.path.dirname(path)))}-{meta['step']}"
    key = api_key or os.environ.get("NANOTRAIN_API_KEY", "")
    app = make_app(engines, tokenizer, model_id, key)
    # idle sockets cannot starve the server: nanotrain.serve.http_guard.guarded_protocol (no limit_concurrency: it
    # counts idle connections too; the requests in flight are bounded by --max_batch + --max_queue, then 429)
    import resource
    # at most half the open-file limit; asyncio accepts up to `backlog` sockets per event-loop tick, for 3-4 ticks
    # before the protocol's connection_made closes the longest-idle ones: an eighth of the rest, so that a burst of
    # connections never runs out of files
    files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    files = 1 << 20 if files == resource.RLIM_INFINITY else files
    cap = max_connections or max(8, min(1024, files // 2))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", backlog=max(16, min(
        2048, (files - cap) // 8)), timeout_keep_alive=idle_timeout, http=guarded_protocol(cap, idle_timeout)))

    async def serve():
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            bound = server.servers[0].sockets[0].getsockname()[1]
            print(f"serving {model_id} ({path}, {len(engines)} engine(s) on {', '.join(map(str, devices))}) on "
                  f"http://{host}:{bound} (Ctrl-C stops)", flush=True)
        await task
    asyncio.run(serve())


if __name__ == "__main__":
    run_script(main)
