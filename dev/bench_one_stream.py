"""
One stream through a running chat_serve.py, read with a plain http.client reader (no SDK: the server's own cost),
against Engine.generate of the same prompt on the same checkpoint, interleaved, 17 rounds each (the first 2 dropped
as warm-up): median (min-max) time to the first content chunk and per request, and Engine's time per generate.

    python scripts/chat_serve.py --source=rl --run_name=cpu --port=8125 &
    python dev/bench_one_stream.py rl cpu 8125
"""
import http.client
import json
import statistics
import sys
import time

import torch

from nanotrain.checkpoint import load_model
from nanotrain.engine import Engine

ROUNDS, WARMUP = 17, 2


def one_request(port, body):
    """(seconds to the first content chunk, seconds to [DONE], completion tokens from the usage chunk)."""
    conn = http.client.HTTPConnection("127.0.0.1", port)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    response = conn.getresponse()
    first, tokens = None, None
    while True:
        line = response.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {"):
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - t0
    total = time.perf_counter() - t0
    conn.close()
    return first, total, tokens


def shown(values):
    v = values[WARMUP:]
    return f"{1000 * statistics.median(v):.1f} ms ({1000 * min(v):.1f}-{1000 * max(v):.1f})"


def main():
    source, run_name, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    model, tok, _, _ = load_model(source, run_name, -1, torch.device("cpu"))
    engine = Engine(model, tok)
    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    ids = tok.render_for_completion({"messages": messages})
    body = json.dumps({"model": "m", "messages": messages, "max_tokens": 64, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    ttft, server, local = [], [], []
    for _ in range(ROUNDS):
        first, total, tokens = one_request(port, body)
        ttft.append(first)
        server.append(total)
        t0 = time.perf_counter()
        out = engine.generate([ids], 64, tool=True)[0]
        local.append(time.perf_counter() - t0)
    ratio = statistics.median(local[WARMUP:]) / statistics.median(server[WARMUP:])
    print(f"tokens: server {tokens}, Engine {len(out)}; server ttft {shown(ttft)}; server request {shown(server)}; "
          f"Engine {shown(local)}; Engine / server (medians) {ratio:.3f}")


if __name__ == "__main__":
    main()
