"""
Inference benchmark of an OpenAI-compatible server (scripts/chat_serve.py or any other): N concurrent streaming clients
(the `openai` SDK's AsyncOpenAI) send the same prompts with greedy decoding and a fixed max_tokens every round, at each
N of --concurrency; reported per N: time to first token (ttft) p50 and p90 in seconds, per-stream decode tokens/s
(the completion's tokens after the first over the time after the first piece), aggregate tokens/s (every stream's
completion tokens over the round's wall time); median, min and max over --rounds. Tokens are the server's own count (the usage
chunk of stream_options.include_usage): a server may send several tokens in one chunk. With --source set, the same prompts also go through nanotrain.engine.Engine
directly as one static batch on that checkpoint (the ceiling the server's batching aims at), one Engine round after
each server round (interleaved, so both see the same machine). One JSON object on
stdout.

    python scripts/chat_serve.py --source=rl --run_name=cpu &          # a server
    python scripts/serve_bench.py --url=http://127.0.0.1:8000/v1 --source=rl --run_name=cpu --rounds=5
"""

import asyncio
import json
import statistics
import time

import torch

from nanotrain.common import run_script
from nanotrain.configurator import configure
from nanotrain.errors import UserError

# ----------------------------------------------------------------------------- settings
url = "http://127.0.0.1:8000/v1"  # the server's OpenAI base URL
api_key = "none"  # sent as the bearer token
concurrency = "1,4,16"  # comma-separated numbers of concurrent streams
max_tokens = 64  # new tokens per request (greedy; a reply may stop earlier)
rounds = 3  # rounds per concurrency (medians reported)
source = ""  # rl | sft | mid | base: also time Engine's static batch of the same prompts on this checkpoint
run_name = ""  # with --source: the run ("" the newest)
config = configure(globals())
# -----------------------------------------------------------------------------

PROMPTS = ["What is 17 + 25?", "Name a colour.", "Spell the word cat.", "Who are you?", "What is 9 * 8?",
           "Say hello.", "Count to five.", "What is 100 - 37?"]


async def one_stream(client, prompt):
    """(ttft seconds, completion tokens, decode seconds after the first piece) of one streaming request."""
    t0 = time.perf_counter()
    first, tokens = None, None
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=0, stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    if tokens is None:
        raise UserError(f"--url={url}: the stream sent no usage chunk (stream_options.include_usage)")
    return (first or end) - t0, tokens, end - (first or end)


async def one_round(n):
    import openai
    client = openai.AsyncOpenAI(base_url=url, api_key=api_key, max_retries=0, timeout=600)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one_stream(client, PROMPTS[i % len(PROMPTS)]) for i in range(n)))
    wall = time.perf_counter() - t0
    await client.close()
    ttfts = sorted(r[0] for r in results)
    per_stream = [(p - 1) / d for _, p, d in results if p > 1 and d > 0]
    return {"ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "stream_tok_s": statistics.median(per_stream) if per_stream else None,
            "aggregate_tok_s": sum(r[1] for r in results) / wall}


def engine_static(n):
    """A function timing Engine.generate on the same n prompts as one static batch (greedy, max_tokens, the tool on
    as the server runs it): each call returns its tokens/s."""
    from nanotrain.checkpoint import load_model
    from nanotrain.engine import Engine
    model, tok, _, _ = load_model(source, run_name, -1, torch.device("cpu"))
    engine = Engine(model, tok)
    prompts = [tok.render_for_completion({"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]})
               for i in range(n)]

    def once():
        t0 = time.perf_counter()
        out = engine.generate(prompts, max_tokens, temperature=0.0, tool=True)
        return sum(map(len, out)) / (time.perf_counter() - t0)
    return once


def summary(values):
    """{"median", "min", "max"} of the non-None values, or None."""
    values = sorted(v for v in values if v is not None)
    return {"median": statistics.median(values), "min": values[0], "max": values[-1]} if values else None


def main():
    try:
        ns = [int(x) for x in concurrency.split(",") if x]
    except ValueError:
        raise UserError(f"--concurrency={concurrency}: expected comma-separated integers, e.g. 1,4,16") from None
    if not ns or min(ns) < 1:
        raise UserError(f"--concurrency={concurrency}: expected integers >= 1")
    out = {"url": url, "max_tokens": max_tokens, "rounds": rounds, "by_concurrency": {}}
    for n in ns:
        engine = engine_static(n) if source else None
        rs, statics = [], []
        for _ in range(rounds):  # interleaved: a server round, then (with --source) Engine's static batch
            try:
                rs.append(asyncio.run(one_round(n)))
            except Exception as e:  # noqa: BLE001 - a server that cannot be reached is one line
                raise UserError(f"--url={url}: {type(e).__name__}: {e}") from None
            if engine is not None:
                statics.append(engine())
        row = {k: summary(r[k] for r in rs) for k in rs[0]}
        if engine is not None:
            row["engine_static_tok_s"] = summary(statics)
        out["by_concurrency"][str(n)] = row
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    run_script(main)
