"""
scripts/chat_serve.py as a client sees it: the server started in a subprocess on an ephemeral 127.0.0.1 port
(--port=0, the bound port read from its first line), talked to with the official `openai` SDK and raw HTTP, on a
tiny base model trained for 3 steps; greedy replies compared with nanotrain.engine.Engine's on the same checkpoint.
"""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from helpers import REPO, TINY_TRAIN, run_script

pytestmark = pytest.mark.smoke
openai = pytest.importorskip("openai")


def start_server(base, run_name, *args):
    """chat_serve.py on `base`'s base run `run_name` (api key "k", an ephemeral port, the extra `args`): returns
    (the process, its URL) once it prints its serving line."""
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "chat_serve.py"), "--source=base",
                          f"--run_name={run_name}", "--port=0", "--api_key=k", *args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    seen = []
    for line in p.stdout:  # the settings it overrides, then "serving ... on http://127.0.0.1:PORT"
        seen.append(line)
        if line.startswith("serving"):
            break
    else:
        p.kill()
        pytest.fail(f"the server did not start: {''.join(seen)[-3000:]}")
    port = int(line.split("http://127.0.0.1:")[1].split()[0])
    threading.Thread(target=p.stdout.read, daemon=True).start()  # keep its pipe drained
    p.seen = "".join(seen)  # what it printed before serving (its max_batch line among it)
    return p, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def server(shared_base_dir, tmp_path_factory):
    """A 3-step base run with the CPU recipe's context (max_seq_len 256) and chat_serve.py serving it with two
    engines (--num_gpus=2: on a CPU both share the cores) and a context of 640; yields (base_url, base dir); stops it
    after."""
    base = tmp_path_factory.mktemp("serve")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    r = run_script("base_train.py", *TINY_TRAIN, "--max_seq_len=256", "--device_batch_size=2", "--num_iterations=3",
                   "--run_name=tiny", base_dir=base)
    assert r.returncode == 0, r.stderr[-3000:]
    p, url = start_server(base, "tiny", "--max_batch=4", "--max_queue=12", "--max_body_bytes=20000",
                          "--context_len=640", "--num_gpus=2")
    try:
        yield url, base
    finally:
        p.terminate()
        p.wait(timeout=30)


@pytest.fixture(scope="module")
def server256(server):
    """chat_serve.py on the same checkpoint with every default but the CPU (the model's context of 256 tokens,
    --max_batch from the KV cache's memory: 64 on a CPU, one engine); yields (base_url, base dir, what it printed before serving)."""
    _, base = server
    p, url = start_server(base, "tiny", "--device_type=cpu")
    try:
        yield url, base, p.seen
    finally:
        p.terminate()
        p.wait(timeout=30)


def engine_reply(base, messages, max_tokens):
    """The greedy reply of the served checkpoint through Engine directly, decoded, and its token count."""
    os.environ["NANOTRAIN_BASE_DIR"] = str(base)
    from nanotrain.checkpoint import load_model
    from nanotrain.engine import Engine
    model, tok, _, _ = load_model("base", "tiny", -1, torch.device("cpu"))
    ids = tok.render_for_completion({"messages": messages})
    out = Engine(model, tok).generate([ids], max_tokens, temperature=0.0, tool=True)[0]
    return tok.decode(out), len(out)


def readable(text):
    """A reply as the client reads it: a calculator call <|python_start|>e<|python_end|><|output_start|>r<|output_end|>
    shown as "[calculator: e -> r]" (as chat_cli shows it)."""
    for token, shown in (("<|python_start|>", "[calculator: "), ("<|python_end|>", ""), ("<|output_start|>", " -> "),
                         ("<|output_end|>", "]")):
        text = text.replace(token, shown)
    return text


def post(url, body, key="k", raw=None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"}
                                                                                   if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def health(url):
    """The server's /health object."""
    with urllib.request.urlopen(url + "/health", timeout=10) as r:
        return json.loads(r.read())


def nothing_decoding_within(url, seconds):
    """True once /health shows no row decoding, polled every 50 ms; False after `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        if health(url)["decoding"] == 0:
            return True
        time.sleep(0.05)
    return False


def test_sdk_streaming_and_not_equal_engines_greedy_reply(server):
    """
    The openai SDK, non-streaming and streaming (temperature 0, max_tokens 12): the text equals Engine's greedy tokens
    decoded (chat_serve shows the calculator's tokens readably; this tiny model may call it), finish_reason is
    "length" exactly when max_tokens new tokens came, usage counts the prompt and the reply, the streamed deltas
    joined equal the non-streamed text, the first chunk carries the role and the last the finish_reason. Catches a
    reply decoded token by token (split characters), wrong usage counts and a stream missing its role or finish.
    """
    url, base = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="k")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0)
    want, n = engine_reply(base, messages, 12)
    assert r.choices[0].message.content == readable(want)
    assert r.choices[0].finish_reason == ("length" if n >= 12 else "stop")
    assert r.usage.completion_tokens == n and r.usage.total_tokens == r.usage.prompt_tokens + n
    chunks = list(client.chat.completions.create(model="m", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert [m.id for m in client.models.list().data] and "nanotrain-base-tiny-3" in client.models.list().data[0].id


def test_bad_requests_get_an_error_object_and_the_server_goes_on(server):
    """
    Each bad input gets its status and one OpenAI error object naming the field, and the server answers a good
    request afterwards: no key (401), a body over --max_body_bytes (413), not JSON (422), no messages, a bad role,
    max_tokens beyond the context, temperature 3, top_k -1, a stop list of 5 (400). Catches a 500 or a traceback for
    bad input, and a server that stops after one.
    """
    url, _ = server
    good = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
    cases = [
        (dict(good), None, "", 401, None),
        (None, b'{"messages": "' + b"x" * 30000 + b'"}', "k", 413, None),
        (None, b"{not json", "k", 422, None),
        ({"max_tokens": 2}, None, "k", 400, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, None, "k", 400, "messages[0].role"),
        (dict(good, max_tokens=10**6), None, "k", 400, "max_tokens"),
        (dict(good, temperature=3), None, "k", 400, "temperature"),
        (dict(good, top_k=-1), None, "k", 400, "top_k"),
        (dict(good, stop=["a", "b", "c", "d", "e"]), None, "k", 400, "stop"),
    ]
    for body, raw, key, status, param in cases:
        got, obj = post(url, body, key=key, raw=raw)
        assert got == status and set(obj) == {"error"} and obj["error"]["message"], (status, obj)
        assert obj["error"]["param"] == param, obj
    status, obj = post(url, good)
    assert status == 200 and obj["choices"][0]["message"]["role"] == "assistant"


def test_16_concurrent_streams_each_equal_their_solo_reply(server):
    """
    16 streaming requests of different lengths at once against 4 rows of continuous batching (12 more may wait):
    each streams exactly its solo greedy reply (Engine on the same checkpoint), and /health answers meanwhile.
    Catches replies mixed between rows, a request that joins the batch at the wrong position, and lost waiters.
    """
    url, base = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    prompts = [f"Count to {i}." for i in range(16)]
    results = [None] * len(prompts)

    def one(i):
        chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompts[i]}],
                                                max_tokens=3 + i, temperature=0, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in chunks)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    assert health(url)["status"] == "ok"
    for t in threads:
        t.join(timeout=120)
    for i in range(len(prompts)):
        assert results[i] == readable(engine_reply(base, [{"role": "user", "content": prompts[i]}], 3 + i)[0]), i


def test_the_defaults_decode_16_streams_together_each_equal_its_solo_reply(server256):
    """
    The server with every default (a CPU: --max_batch from the KV cache's memory, at most 64, printed at start with
    max_queue) and 16 streaming requests at once: the start-up line says max_batch 64, /health sees more than 8
    decoding at once, and each request streams exactly its solo greedy reply (Engine on the same checkpoint).
    Catches the old default of 8 rows (half of them wait), a default not printed, and rows mixed at that width.
    """
    url, base, seen = server256
    assert "max_batch 64" in seen and "max_queue 128" in seen, seen
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    prompts = [f"Name {i} things." for i in range(16)]
    results, busiest = [None] * 16, [0]

    def one(i):
        chunks = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompts[i]}],
                                                max_tokens=40, temperature=0, stream=True)
        results[i] = "".join(c.choices[0].delta.content or "" for c in chunks)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        busiest[0] = max(busiest[0], health(url)["decoding"])
        time.sleep(0.01)
    assert busiest[0] > 8, busiest
    for i in range(16):
        assert results[i] == readable(engine_reply(base, [{"role": "user", "content": prompts[i]}], 40)[0]), i


def test_no_max_tokens_replies_to_the_end_of_the_context(server256):
    """
    On the CPU recipe's context (256 tokens), a request without max_tokens (the chat page's, the openai SDK's
    default) is answered: finish_reason "length" with prompt + reply exactly 256 tokens, or "stop" before that, the
    text the solo greedy reply of that length; with max_tokens 1000 it is a 400 naming max_tokens, code
    context_length_exceeded. Catches a default of 256 new tokens (every request without max_tokens a 400 on a
    256-token model) and a default that overruns the context.
    """
    url, base, _ = server256
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    status, obj = post(url, {"messages": messages, "temperature": 0})
    assert status == 200, obj
    usage, choice = obj["usage"], obj["choices"][0]
    assert (choice["finish_reason"] == "length" and usage["total_tokens"] == 256) or \
        (choice["finish_reason"] == "stop" and usage["total_tokens"] < 256), obj
    want, n = engine_reply(base, messages, 256 - usage["prompt_tokens"])
    assert choice["message"]["content"] == readable(want) and usage["completion_tokens"] == n
    status, obj = post(url, {"messages": messages, "max_tokens": 1000})
    assert status == 400 and obj["error"]["param"] == "max_tokens" and obj["error"]["code"] == "context_length_exceeded"



def test_a_tiny_temperature_beside_other_streams_is_greedy(server):
    """
    temperature 1e-300 (it passes the range check) sent while other requests decode: it answers 200 with the greedy
    reply, and so do the others. Catches a sampler that divides by it (inf / NaN, an exception inside the shared
    decode step: every request of the batch answered 500).
    """
    url, base = server
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    want = readable(engine_reply(base, messages, 10)[0])
    out = [None] * 4

    def one(i):
        out[i] = post(url, {"messages": messages, "max_tokens": 10, "temperature": 1e-300 if i % 2 else 0})
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert [status for status, _ in out] == [200] * 4, out
    assert all(obj["choices"][0]["message"]["content"] == want for _, obj in out)


def test_a_client_gone_mid_stream_frees_its_row(server):
    """
    A streaming request of 600 tokens whose client closes the connection after two chunks: its row is free within
    a second (/health: nothing decoding) and the next request is served. Catches a generation that runs on for a
    client that left (the row held for 600 steps, seconds on this model).
    """
    url, base = server
    messages = [{"role": "user", "content": "Tell a story."}]
    assert engine_reply(base, messages, 600)[1] == 600  # alone, it would decode all 600 tokens
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=600, temperature=0, stream=True)
    it = iter(stream)
    next(it), next(it)
    stream.close()
    assert nothing_decoding_within(url, 1), "the row of the closed stream is still decoding"
    status, obj = post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 200


def test_requests_go_to_the_least_loaded_engine(server):
    """
    Two engines (--num_gpus=2 on a CPU): a long stream holds one engine; a second request started while it runs goes
    to the other (/health: one decoding on each), and once both end nothing decodes anywhere. Catches every request
    sent to the first engine (both on one, the other idle) and a load that forgets requests that left.
    """
    url, _ = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    streams = []
    for _ in range(2):
        s = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Tell a story."}],
                                           max_tokens=600, temperature=0, stream=True)
        it = iter(s)
        next(it), next(it)  # decoding now
        streams.append(s)
    engines = health(url)["engines"]
    for s in streams:
        s.close()
    assert [e["decoding"] for e in engines] == [1, 1], engines
    assert nothing_decoding_within(url, 2), "a closed stream's row is still decoding"


def test_an_engine_process_that_cannot_load_or_dies_is_one_line(server, tmp_path, monkeypatch):
    """
    nanotrain.serve.engine_process.EngineProcess: a checkpoint that does not exist is the engine process's one line
    (UserError), not a hang or a traceback; an engine process killed mid-request fails that request with a
    RuntimeError naming the exit and refuses later submits (UserError). Catches a server that waits forever on an
    engine that never became ready, and requests left waiting on a dead engine.
    """
    import functools

    from nanotrain.checkpoint import load_model
    from nanotrain.errors import UserError
    from nanotrain.serve.engine_process import EngineProcess
    from nanotrain.serve.request import GenerationRequest
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    with pytest.raises(UserError, match="no base checkpoint found"):
        EngineProcess(functools.partial(load_model, "base", "", -1, "cpu"))
    _, base = server
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(base))
    engine = EngineProcess(functools.partial(load_model, "base", "tiny", -1, "cpu"), context_len=640)
    req = engine.submit(GenerationRequest([1, 2, 3], 600))
    it = iter(req)
    next(it)
    engine.process.kill()
    with pytest.raises(RuntimeError, match="engine process exited"):
        list(it)
    with pytest.raises(UserError, match="engine process exited"):
        engine.submit(GenerationRequest([1, 2, 3], 4))


def emoji_checkpoint(base):
    """
    A base checkpoint "emoji" beside "tiny" whose greedy reply to any chat prompt is CHAIN_TEXT, built by hand from
    the tiny one: every block's output projections zeroed (each block adds nothing), the chain's tokens embedded as
    one-hot vectors and the head mapping each to the next (<|assistant_start|> -> the text's tokens ->
    <|assistant_end|>). Returns the text's token ids (the emoji among them split over several tokens).
    """
    os.environ["NANOTRAIN_BASE_DIR"] = str(base)
    from nanotrain.checkpoint import load_model, save_checkpoint
    model, tok, path, meta = load_model("base", "tiny", -1, torch.device("cpu"))
    ids = tok.encode(CHAIN_TEXT)
    chain = [tok.encode_special("<|assistant_start|>")] + ids + [tok.encode_special("<|assistant_end|>")]
    assert len(set(chain)) == len(chain) and len(chain) <= model.config.model_dim
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.zero_()
        model.wte.weight.zero_()
        model.lm_head.weight.zero_()
        for i, (t, nxt) in enumerate(zip(chain, chain[1:])):
            model.wte.weight[t, i] = 1.0
            model.lm_head.weight[nxt, i] = 1.0
    run_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(path))), "emoji")
    meta = {k: v for k, v in meta.items() if k not in ("step", "version", "git_commit")}
    save_checkpoint(run_dir, 1, model, [], meta, {})
    return ids


CHAIN_TEXT = "Hi \U0001F600 ok"  # an emoji is 4 UTF-8 bytes: a byte-level tokenizer this small splits it


def test_an_emoji_split_across_tokens_arrives_whole(server):
    """
    A checkpoint whose greedy reply is "Hi <grinning face> ok", the emoji spread over several tokens (each of its
    tokens alone decodes to U+FFFD): streamed, no chunk carries half a character (no U+FFFD anywhere) and the
    chunks joined are the reply; not streamed, the same text. Catches a stream that decodes token by token (the
    emoji arrives as replacement characters) and one that drops the held-back bytes.
    """
    _, base = server
    ids = emoji_checkpoint(base)
    from nanotrain.tokenizer import get_tokenizer
    tok = get_tokenizer()
    assert sum("\ufffd" in tok.decode([t]) for t in ids) >= 2  # the emoji really is split
    p, url = start_server(base, "emoji")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        messages = [{"role": "user", "content": "Say hi."}]
        chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="m", messages=messages, max_tokens=32, temperature=0, stream=True)]
        whole = client.chat.completions.create(model="m", messages=messages, max_tokens=32, temperature=0)
    finally:
        p.terminate()
        p.wait(timeout=30)
    assert not any("\ufffd" in c for c in chunks) and "".join(chunks) == CHAIN_TEXT, chunks
    assert whole.choices[0].message.content == CHAIN_TEXT and whole.choices[0].finish_reason == "stop"


def test_a_reader_that_reads_nothing_stalls_no_one(server):
    """
    A client that sends a 600-token streaming request and then reads nothing (a 1 KB receive buffer: its ~100 KB of
    events wait on the server's side): another client's request is answered meanwhile, the unread request's row
    still decodes to its end (/health: nothing decoding), and when the client finally reads, every event is there
    up to finish_reason "length" and [DONE]. Catches a decode step that waits for a reader to take its chunk, and
    tokens dropped for a reader that fell behind.
    """
    import socket
    url, _ = server
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 600,
                       "temperature": 0, "stream": True}).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    slow.connect(("127.0.0.1", port))
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        deadline = time.time() + 20
        while health(url)["decoding"] == 0 and time.time() < deadline:  # the unread request has its row
            time.sleep(0.02)
        t0 = time.time()
        status, obj = post(url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
        assert status == 200 and time.time() - t0 < 10
        assert nothing_decoding_within(url, 20), "the unread stream's row never finished decoding"  # read or not
        slow.settimeout(10)
        received = b""
        while b"data: [DONE]" not in received:  # every event is still delivered, to the end
            part = slow.recv(1 << 16)
            assert part, received[-500:]
            received += part
        assert b'"finish_reason": "length"' in received
    finally:
        slow.close()


def test_completions_logprobs_are_the_models(server):
    """
    POST /v1/completions with token ids, echo, logprobs 1 and max_tokens 1, as lm-evaluation-harness's
    local-completions asks for a log-likelihood: token_logprobs is None first, then for every later token the model's
    own log-softmax of it given its prefix (one forward of the checkpoint here, to 1e-4), top_logprobs' best value is
    at least each token's, and the one new token is the greedy one. A text prompt starts with <|bos|>. Catches
    logprobs shifted by one position, of the wrong token, or from the soft-capped logits of another position.
    """
    url, base = server
    os.environ["NANOTRAIN_BASE_DIR"] = str(base)
    from nanotrain.checkpoint import load_model
    model, tok, _, _ = load_model("base", "tiny", -1, torch.device("cpu"))
    ids = tok.encode("The capital of France is", prepend=tok.get_bos_token_id())
    req = urllib.request.Request(url + "/v1/completions", method="POST", headers={
        "Content-Type": "application/json", "Authorization": "Bearer k"}, data=json.dumps(
        {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=60) as r:
        choice = json.loads(r.read())["choices"][0]
    lp = choice["logprobs"]
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    want = torch.log_softmax(logits, -1)
    greedy = int(logits[-1].argmax())
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 1
    for i in range(1, len(ids)):
        assert abs(lp["token_logprobs"][i] - float(want[i - 1, ids[i]])) < 1e-4, i
        assert max(lp["top_logprobs"][i].values()) >= lp["token_logprobs"][i] - 1e-6
    assert lp["tokens"][-1] == tok.decode([greedy]) and choice["text"] == tok.decode(ids + [greedy])
    status, obj = post(url, None, raw=b"")  # the chat route still answers after: a bad body is its 422
    assert status == 422


def test_serve_bench_runs_against_the_server(server):
    """scripts/serve_bench.py against the running server at 1 and 2 concurrent streams with ignore_eos, and Engine's
    static batch on the same checkpoint: one JSON object with ttft, per-stream and aggregate tokens/s per concurrency,
    every stream 6 tokens long (the server's usage: ignore_eos decodes past the stop tokens). Catches a benchmark
    that cannot talk to the server it measures (a wrong route, auth not sent) and a server that ignores
    ignore_eos (a reply stopping early would give fewer tokens)."""
    url, base = server
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "serve_bench.py"), f"--url={url}/v1",
                        "--api_key=k", "--concurrency=1,2", "--max_tokens=6", "--rounds=1", "--source=base",
                        "--run_name=tiny", "--threads=1"], capture_output=True,
                       text=True, timeout=120, env=dict(os.environ, NANOTRAIN_BASE_DIR=str(base)), cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert set(out["by_concurrency"]) == {"1", "2"} and out["threads"] == 1 and out["ignore_eos"]
    for row in out["by_concurrency"].values():
        assert 0 < row["ttft_p50"]["median"] <= row["ttft_p90"]["max"] and row["aggregate_tok_s"]["min"] > 0
        assert row["engine_static_tok_s"]["min"] > 0
    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"


def test_the_chat_page_is_served(server):
    """GET / is the chat page: one HTML file that posts to /v1/chat/completions with stream on and loads nothing
    from another host. Catches a page that is missing or pulls a script from a CDN."""
    url, _ = server
    with urllib.request.urlopen(url + "/", timeout=10) as r:
        html = r.read().decode()
    assert r.status == 200 and "/v1/chat/completions" in html and "stream: true" in html
    assert "http://" not in html and "https://" not in html


@pytest.mark.slow  # a real browser: Debian's chromium (installed by .ci/run) driven by Playwright
def test_the_chat_page_in_chromium(server256):
    """
    The page in headless Chromium on the CPU recipe's context (256 tokens; the page sends no max_tokens, so a reply
    may run to the end of the context): a message typed and sent gets a reply that grows over at least two updates
    (the stream reaches the page piece by piece); the second turn sends the first one along (its request's messages
    hold the first user turn and reply); as the conversation outgrows the context, the page drops the oldest turns
    (a 400 with code context_length_exceeded, sent again without them), says so in a note, and every turn gets a
    reply, never an error. Catches a page that waits for the whole reply, one that forgets the conversation, and a
    page whose every message fails on a 256-token model.
    """
    import shutil
    sync_api = pytest.importorskip("playwright.sync_api")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium on this machine (.ci/run installs Debian's)")
    url, _, _ = server256
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page()
        page.route("**/v1/chat/completions", lambda route: route.continue_(
            headers={**route.request.headers, "authorization": "Bearer k"}))
        sent = []
        page.on("request", lambda r: sent.append(r.post_data) if r.url.endswith("/v1/chat/completions") else None)
        page.goto(url + "/")
        page.evaluate("""() => { window.sizes = []; const log = document.getElementById('log');
            new MutationObserver(() => { const a = log.querySelectorAll('.assistant');
              if (a.length) window.sizes.push(a[a.length - 1].textContent.length); })
            .observe(log, {subtree: true, childList: true, characterData: true}); }""")
        turns = ["Hello there", "And again, tell me more about it please"]
        for turn in range(6):  # until the conversation has outgrown the context (a note), at most 6 turns
            page.fill("#input", turns[turn] if turn < 2 else f"Turn {turn}: and then what happened next?")
            page.click("#send")
            page.wait_for_function(f"() => document.querySelectorAll('.assistant').length == {turn + 1} && "
                                   "!document.getElementById('send').disabled", timeout=120000)
            if turn == 0:
                sizes = page.evaluate("window.sizes")
            if turn >= 1 and page.query_selector(".note") is not None:
                break
        replies = page.eval_on_selector_all(".assistant", "els => els.map(e => e.textContent)")
        errors = page.query_selector_all(".error")
        note = page.inner_text(".note") if page.query_selector(".note") else ""
        browser.close()
    assert replies[0] and len(set(sizes)) >= 2, sizes
    second = json.loads(sent[1])["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"] and second[0]["content"] == "Hello there"
    assert "no longer fit the model's context" in note and not errors and all(replies), (note, replies)
