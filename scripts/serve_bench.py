"""
Inference benchmark of an OpenAI-compatible server (scripts/chat_serve.py or any other): N concurrent streaming clients
(httpx, each chunk parsed with json.loads: a lean load generator, as vLLM's benchmark_serving uses aiohttp, since on a
small machine the client shares the cores with the server; the openai SDK's typed chunks cost ~3x the CPU) send the same prompts with greedy decoding and a fixed max_tokens every round, at each
N of --concurrency, with ignore_eos (the server's extension, as vLLM's: every reply max_tokens long); reported per
N: time to first token (ttft) p50 and p90 in seconds, per-stream decode tokens/s
(the completion's tokens after the first over the time after the first piece), aggregate tokens/s (every stream's
completion tokens over the round's wall time); median, min and max over --rounds. Tokens are the server's own count (the usage
chunk of stream_options.include_usage): a server may send several tokens in one chunk. With --source set, the same
prompts also go through nanotrain.engine.Engine directly as one static batch on that checkpoint (the ceiling the
server's batching aims at), and with --hf also through transformers' continuous-batching manager (started once and
kept running, as a server would; greedy, no stop token) on the --format=hf export of the same checkpoint: per round a
server round, then Engine's, then transformers' (interleaved, so all see the same machine; one warm-up round of each
first, not counted), on --threads torch
threads in this process (give the server the same with its --cpu_threads). One JSON object on stdout.

    python scripts/chat_serve.py --source=rl --run_name=cpu --cpu_threads=1 &          # a server
    python scripts/serve_bench.py --url=http://127.0.0.1:8000/v1 --source=rl --run_name=cpu --hf=True --threads=1 \
        --concurrency=1,4,16,32 --rounds=5
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
concurrency = "1,4,16,32"  # comma-separated numbers of concurrent streams
max_tokens = 64  # new tokens per request (greedy)
ignore_eos = True  # every reply max_tokens tokens (the server's ignore_eos extension); False: a reply may stop earlier
rounds = 3  # rounds per concurrency (medians reported)
source = ""  # rl | sft | mid | base: also time Engine's static batch of the same prompts on this checkpoint
run_name = ""  # with --source: the run ("" the newest)
hf = False  # with --source: also time transformers' continuous-batching manager on the checkpoint's --format=hf export
threads = 0  # torch threads of this process's Engine and transformers runs; 0 keeps torch's default
config = configure(globals())
# -----------------------------------------------------------------------------

PROMPTS = ["What is 17 + 25?", "Name a colour.", "Spell the word cat.", "Who are you?", "What is 9 * 8?",
           "Say hello.", "Count to five.", "What is 100 - 37?"]


async def one_stream(client, prompt):
    """(ttft seconds, completion tokens, decode seconds after the first piece) of one streaming request: its
    Server-Sent Events read line by line and each `data:` chunk parsed with json.loads (OpenAI's chunk format)."""
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    t0 = time.perf_counter()
    first, tokens = None, None
    async with client.stream("POST", url.rstrip("/") + "/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise UserError(f"--url={url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise UserError(f"--url={url}: the stream ended with an error: {chunk['error']}")
            choices = chunk.get("choices")
            if choices and choices[0]["delta"].get("content") and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if tokens is None:
        raise UserError(f"--url={url}: the stream sent no usage chunk (stream_options.include_usage)")
    return (first or end) - t0, tokens, end - (first or end)


async def one_round(n):
    import httpx
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {api_key}"}, timeout=600,
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n)) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one_stream(client, PROMPTS[i % len(PROMPTS)]) for i in range(n)))
        wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    per_stream = [(p - 1) / d for _, p, d in results if p > 1 and d > 0]
    return {"ttft_p50": statistics.median(ttfts), "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
            "stream_tok_s": statistics.median(per_stream) if per_stream else None,
            "aggregate_tok_s": sum(r[1] for r in results) / wall}


def prompt_ids(tok, n):
    """The token ids of the first n prompts (cycling) rendered for a chat completion."""
    return [tok.render_for_completion({"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]})
            for i in range(n)]


def engine_static(model, tok, n):
    """A function timing Engine.generate on the same n prompts as one static batch (greedy, max_tokens, the tool on
    as the server runs it, ignore_eos as set): each call returns its tokens/s."""
    from nanotrain.engine import Engine
    engine, prompts = Engine(model, tok), prompt_ids(tok, n)

    def once():
        t0 = time.perf_counter()
        out = engine.generate(prompts, max_tokens, temperature=0.0, tool=True, ignore_eos=ignore_eos)
        return sum(map(len, out)) / (time.perf_counter() - t0)
    return once


def hf_manager(model, tok):
    """transformers' continuous-batching manager on the --format=hf export of `model`, started (greedy, no stop
    token with ignore_eos): (manager, a function of n timing one round of the n prompts added at once, returning
    its tokens/s)."""
    import shutil
    import tempfile

    from transformers import AutoModelForCausalLM, GenerationConfig

    from nanotrain.export.hf import export_hf, require_transformers
    require_transformers()
    out_dir = tempfile.mkdtemp(prefix="serve_bench_hf_")
    try:
        export_hf(model, tok, f"{out_dir}/hf")
        hf_model = AutoModelForCausalLM.from_pretrained(f"{out_dir}/hf", trust_remote_code=True,
                                                        dtype=torch.float32).eval()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                              eos_token_id=-1 if ignore_eos else hf_model.generation_config.eos_token_id)
    manager = hf_model.init_continuous_batching(generation_config=config)
    manager.start()

    def once(n):
        t0 = time.perf_counter()
        ids = set(manager.add_requests(prompt_ids(tok, n), max_new_tokens=max_tokens))
        tokens = 0
        while ids:
            result = manager.get_result(timeout=600)
            if result is None:
                raise UserError("transformers' continuous-batching manager returned no result within 600 s")
            if result.request_id in ids and result.is_finished():
                ids.discard(result.request_id)
                tokens += len(result.generated_tokens)
        return tokens / (time.perf_counter() - t0)
    return manager, once


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
    if hf and not source:
        raise UserError("--hf=True needs --source (the checkpoint to export)")
    if threads:
        torch.set_num_threads(threads)
    out = {"url": url, "max_tokens": max_tokens, "ignore_eos": ignore_eos, "rounds": rounds,
           "threads": torch.get_num_threads(), "by_concurrency": {}}
    model = tok = manager = hf_round = None
    if source:
        from nanotrain.checkpoint import load_model
        model, tok, _, _ = load_model(source, run_name, -1, torch.device("cpu"))
        if hf:
            manager, hf_round = hf_manager(model, tok)
    try:
        try:  # one warm-up round of each, not counted (first-call costs: the server's, transformers' manager's)
            asyncio.run(one_round(1))
        except Exception as e:  # noqa: BLE001 - a server that cannot be reached is one line
            raise UserError(f"--url={url}: {type(e).__name__}: {e}") from None
        if source:
            engine_static(model, tok, 1)()
        if hf_round is not None:
            hf_round(1)
        for n in ns:
            engine = engine_static(model, tok, n) if source else None
            rs, statics, hfs = [], [], []
            for _ in range(rounds):  # interleaved: a server round, then Engine's static batch, then transformers'
                rs.append(asyncio.run(one_round(n)))
                if engine is not None:
                    statics.append(engine())
                if hf_round is not None:
                    hfs.append(hf_round(n))
            row = {k: summary(r[k] for r in rs) for k in rs[0]}
            if engine is not None:
                row["engine_static_tok_s"] = summary(statics)
            if hf_round is not None:
                row["transformers_cb_tok_s"] = summary(hfs)
            out["by_concurrency"][str(n)] = row
    finally:
        if manager is not None:
            manager.stop(block=True, timeout=10)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    run_script(main)
