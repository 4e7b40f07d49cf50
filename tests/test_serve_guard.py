"""
scripts/chat_serve.py against what a probe of it as an attacker or a careless client would send
(nanotrain.serve.http_guard and the server's error paths): the server in a subprocess on a 1-step tiny base model,
as tests/test_serve.py starts it, its open files limited to 512 (ulimit -n) and its idle timeout 6 s.
"""

import http.client
import json
import os
import resource
import select
import socket
import threading
import time

import pytest
from helpers import TINY_TRAIN, run_script
from test_serve import health, nothing_decoding_within, start_server

pytestmark = pytest.mark.smoke
pytest.importorskip("fastapi")

LIMIT = 1_000_000  # --max_body_bytes (the default): the 490,000 `[` fit under it
IDLE = 6  # --idle_timeout
CAP = 64  # --max_connections


@pytest.fixture(scope="module")
def base(shared_base_dir, tmp_path_factory):
    """A base dir holding a 1-step tiny base run "tiny"."""
    base = tmp_path_factory.mktemp("guard")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=1", "--run_name=tiny", base_dir=base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base


@pytest.fixture(scope="module")
def server(base):
    """chat_serve.py on it (--max_batch=2 --max_queue=2, --idle_timeout=6, --max_connections=64), started with at
    most 512 open files; yields (url, its process)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))  # inherited by the server
    try:
        p, url = start_server(base, "tiny", "--max_batch=2", "--max_queue=2", "--context_len=640",
                              f"--idle_timeout={IDLE}", f"--max_connections={CAP}")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        yield url, p
    finally:
        p.terminate()
        p.wait(timeout=30)


def ask(url, method, path, body=b"", headers=None, timeout=30):
    """One request through http.client: (status, the JSON value of the answer). Headers default to a JSON body with
    the key; a given Host replaces the real one."""
    conn = http.client.HTTPConnection(url.split("//")[1], timeout=timeout)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", "Authorization": "Bearer k",
                                          **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def is_error(obj):
    """True for one OpenAI error object: {"error": {"message", "type", "param", "code"}} with a message."""
    return set(obj) == {"error"} and set(obj["error"]) == {"message", "type", "param", "code"} and \
        bool(obj["error"]["message"])


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_chunked_body_over_the_limit_is_413_before_it_ends(server, path):
    """
    A chunked upload with no Content-Length: 3 MB sent in 64 KB chunks and never ended (no last chunk). The server
    answers 413 with an error object while the body is still open, on both routes, and answers the next request.
    Catches a limit checked only on Content-Length (the completions route read and tokenized a 20 MB prompt) and one
    checked after reading the whole body (the chat route grew by 380 MB for a 200 MB body before its 413): both wait
    for a body that never ends.
    """
    url, _ = server
    port = int(url.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    try:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\nContent-Type: "
                  f"application/json\r\nTransfer-Encoding: chunked\r\n\r\n".encode())
        chunk = b'{"prompt": "' + b"x" * 65_000
        for _ in range(3 * LIMIT // len(chunk)):
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the server answered and closed: the answer is still to be read
                break
            chunk = b"x" * 65_000
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.split(b"\r\n\r\n", 1)[1]) < 40:
            part = s.recv(65536)
            assert part, answer
            answer += part
    finally:
        s.close()
    head, body = answer.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert is_error(json.loads(body[:int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])]))
    assert ask(url, "POST", "/v1/chat/completions", json.dumps(CHAT))[0] == 200


def test_a_foreign_host_and_a_cross_site_text_post_are_refused(server):
    """
    DNS rebinding and cross-site forms: a request whose Host is another site's name is refused (403) on every route,
    the page included, while localhost and 127.0.0.1 with a port are served; a text/plain POST carrying valid JSON
    (what a page on any site may send without a CORS preflight) is 415 and starts no generation. Catches a server
    that answers any Host (a rebound name drives the keyless local server) and one that parses any content type.
    """
    url, _ = server
    port = url.rsplit(":", 1)[1]
    for path in ("/v1/models", "/health", "/"):
        status, obj = ask(url, "GET", path, headers={"Host": f"attacker.example:{port}"})
        assert status == 403 and is_error(obj), (path, status, obj)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "LOCALHOST"):
        assert ask(url, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    status, obj = ask(url, "POST", "/v1/chat/completions", json.dumps(dict(CHAT, max_tokens=400)),
                      headers={"Content-Type": "text/plain"})
    assert status == 415 and is_error(obj), obj
    assert health(url)["decoding"] == 0


def test_every_malformed_request_is_an_error_object(server):
    """
    Each gets its status and an error object (never a 500 or a plain-text body): 490,000 `[` (400, Python's parser
    recursion), a 5,001-digit integer (400, int's digit limit), n = 2 on both routes (400: one choice only), an
    unknown route (404), a GET on a POST route (405), no key (401); the server answers after. Catches the
    RecursionError and the ValueError that reached the client as a 500, and n > 1 answered with one choice.
    """
    url, _ = server
    cases = [("/v1/chat/completions", b"[" * 490_000, 400, None),
             ("/v1/chat/completions", b'{"messages": [], "max_tokens": ' + b"1" * 5001 + b"}", 400, None),
             ("/v1/completions", b'{"prompt": "a", "max_tokens": ' + b"7" * 5001 + b"}", 400, None),
             ("/v1/chat/completions", json.dumps(dict(CHAT, n=2)).encode(), 400, "n"),
             ("/v1/completions", json.dumps({"prompt": "a", "n": 3}).encode(), 400, "n")]
    for path, body, want, param in cases:
        status, obj = ask(url, "POST", path, body)
        assert status == want and is_error(obj) and obj["error"]["param"] == param, (path, body[:40], status, obj)
    assert ask(url, "GET", "/v1/nothing")[0] == 404 and is_error(ask(url, "GET", "/v1/nothing")[1])
    status, obj = ask(url, "GET", "/v1/chat/completions")
    assert status == 405 and is_error(obj), obj
    status, obj = ask(url, "GET", "/v1/models", headers={"Authorization": "Bearer kk"})
    assert status == 401 and is_error(obj), obj
    assert ask(url, "POST", "/v1/chat/completions", json.dumps(CHAT))[0] == 200


def test_a_burst_beyond_the_queue_is_429_never_500(server):
    """
    24 requests at once against 2 rows and 2 waiting places: each is answered 200 or 429 (an error object), at least
    the 4 that fit are 200. Catches the engine process refusing a request the server had admitted (its own queue held
    max_queue while a burst arrived before its next step gave any a row): a 500 for that request.
    """
    url, _ = server
    got = []

    def one():
        got.append(ask(url, "POST", "/v1/chat/completions", json.dumps(dict(CHAT, max_tokens=8)), timeout=60))
    threads = [threading.Thread(target=one) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    statuses = sorted(s for s, _ in got)
    assert len(got) == 24 and set(statuses) <= {200, 429} and statuses.count(200) >= 4, statuses
    assert all(is_error(obj) and obj["error"]["type"] == "rate_limit_error" for s, obj in got if s == 429)


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 600}),
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 600})])
def test_a_client_gone_before_a_non_streamed_reply_frees_its_row(server, path, body):
    """
    A non-streamed request of 600 tokens whose client closes the connection once it decodes: its row is free
    within a second (/health: nothing decoding). Catches a reply decoded to its end for a client that left (the
    chat route awaited it, the completions route held a worker thread on it).
    """
    url, _ = server
    port = int(url.rsplit(":", 1)[1])
    data = json.dumps(dict(body, temperature=0)).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=20)
    s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
    deadline = time.time() + 20
    while health(url)["decoding"] == 0 and time.time() < deadline:
        time.sleep(0.02)
    s.close()
    assert nothing_decoding_within(url, 1), "the row of the gone client is still decoding"


def test_idle_sockets_cannot_starve_the_server(server):
    """
    600 connections that send nothing, against a server limited to 512 open files: /health still answers at once,
    the server holds at most the cap (64) and what it accepted in the last few event-loop ticks (a new connection
    closes the longest-idle one), and the oldest idle connections are the ones closed; a connection that trickles a request's headers a byte at a time is closed
    after --idle_timeout (6 s), and a body trickled after whole headers is answered 408 then. Catches a server whose
    idle sockets use up its files (accept fails; every request times out) and timeouts that any byte resets.
    """
    url, p = server
    port = int(url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(600)]
    try:
        t0 = time.time()
        assert ask(url, "GET", "/health", timeout=10)[0] == 200
        assert time.time() - t0 < 3
        sockets = 0
        for f in os.listdir(f"/proc/{p.pid}/fd"):
            try:
                sockets += os.readlink(f"/proc/{p.pid}/fd/{f}").startswith("socket:")
            except FileNotFoundError:  # closed meanwhile
                pass
        assert sockets < CAP + 4 * (512 - CAP) // 8, sockets  # uvicorn's backlog: chat_serve.main
        closed = sum(1 for s in idle[:100] if select.select([s], [], [], 0)[0] and s.recv(1) == b"")
        assert closed == 100, closed  # the oldest went first
    finally:
        for s in idle:
            s.close()
    # two trickles at once, a byte every 0.25 s: a request's headers, and a body after whole headers
    heads = socket.create_connection(("127.0.0.1", port), timeout=10)
    body = socket.create_connection(("127.0.0.1", port), timeout=10)
    heads.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
    body.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer k\r\n"
                 b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n")
    t0, ends, answer = time.time(), {}, b""
    try:
        while len(ends) < 2 and time.time() - t0 < IDLE + 8:
            for name, s in (("heads", heads), ("body", body)):
                if name in ends:
                    continue
                try:
                    s.send(b"y")
                    if select.select([s], [], [], 0)[0]:
                        part = s.recv(4096)
                        answer += part if name == "body" else b""
                        if not part or name == "body":
                            ends[name] = time.time() - t0
                except OSError:
                    ends[name] = time.time() - t0
            time.sleep(0.25)
    finally:
        heads.close()
        body.close()
    assert set(ends) == {"heads", "body"} and all(IDLE - 0.5 < t < IDLE + 4 for t in ends.values()), ends
    assert answer.startswith(b"HTTP/1.1 408") and b'"error"' in answer, answer[:300]


def test_a_dead_engine_is_503_and_nothing_hangs(base):
    """
    The engine's process killed while a non-streamed request decodes: that request, then a chat request, a
    completions request with echo, logprobs and max_tokens 0 (no generation, only a scoring forward) and /health are
    each a 503 error object within seconds. Catches the plain-text 500 of a submit to a dead engine and the scoring
    request that waited forever for a process that is gone (holding a worker thread).
    """
    p, url = start_server(base, "tiny", "--context_len=640")
    running = []
    try:
        t = threading.Thread(target=lambda: running.append(ask(url, "POST", "/v1/chat/completions", json.dumps(
            {"messages": [{"role": "user", "content": "Tell a story."}], "max_tokens": 600}))))
        t.start()
        deadline = time.time() + 20
        while health(url)["decoding"] == 0 and time.time() < deadline:
            time.sleep(0.02)
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        assert len(children) == 1
        os.kill(children[0], 9)
        deadline = time.time() + 10
        while ask(url, "GET", "/health")[0] != 503 and time.time() < deadline:
            time.sleep(0.05)
        t.join(timeout=20)
        assert running and running[0][0] == 503 and is_error(running[0][1]), running
        for path, body in (("/v1/chat/completions", CHAT),
                           ("/v1/completions", {"prompt": "a b c", "echo": True, "logprobs": 1, "max_tokens": 0}),
                           ("/health", None)):
            status, obj = ask(url, "POST" if body else "GET", path, json.dumps(body).encode() if body else b"",
                              timeout=10)
            assert status == 503 and is_error(obj) and obj["error"]["type"] == "server_error", (path, obj)
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_the_guard_compares_the_key_in_constant_time(monkeypatch):
    """nanotrain.serve.http_guard.key_matches: the bearer token goes through hmac.compare_digest (the time taken does
    not tell how many leading characters were right), and only `Bearer <key>` matches. Catches a plain `!=`."""
    from nanotrain.serve import http_guard
    seen = []
    real = http_guard.hmac.compare_digest
    monkeypatch.setattr(http_guard.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    assert http_guard.key_matches("Bearer s3cret", "s3cret") and seen
    assert not http_guard.key_matches("Bearer s3cre", "s3cret") and not http_guard.key_matches(None, "s3cret")
    assert not http_guard.key_matches("s3cret", "s3cret") and not http_guard.key_matches("Bearer s3cret\u00e9",
                                                                                        "s3cret")


def test_the_guard_knows_this_servers_names():
    """
    Guard.host_ok: bound to 127.0.0.1, the local names with or without a port (any case) and the --allowed_hosts
    names pass, another site's name or IP does not; bound to 0.0.0.0, any IP literal (v4, bracketed v6) passes but a
    name still needs listing; "*" passes anything; no Host (HTTP/1.0) passes. Catches a port or a case that
    turns a local name foreign, and a suffix match ("localhost.attacker.example").
    """
    from nanotrain.serve.http_guard import Guard
    local = Guard(None, "127.0.0.1", ["myserver.lan"])
    assert all(local.host_ok(h) for h in ["localhost", "LocalHost:8000", "127.0.0.1:1", "[::1]:8000", "[::1]",
                                          "myserver.lan:8000", None])
    assert not any(local.host_ok(h) for h in ["attacker.example", "localhost.attacker.example:8000", "10.0.0.7:80",
                                              "127.0.0.1.attacker.example", ""])
    wide = Guard(None, "0.0.0.0")
    assert wide.host_ok("10.0.0.7:8000") and wide.host_ok("[fe80::1]:8000") and wide.host_ok("0.0.0.0:8000")
    assert not wide.host_ok("attacker.example:8000")
    assert Guard(None, "127.0.0.1", ["*"]).host_ok("attacker.example")
