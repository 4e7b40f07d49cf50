"""
Benchmark of Engine (nanotrain.engine) against transformers' generate on the --format=hf export of the same checkpoint:
greedy decoding of a fixed number of new tokens (no stop token ends a row, so both decode exactly max_tokens) for
batches of chat prompts of different lengths (Engine: one per-row KV cache; transformers: left padding with an
attention_mask, its DynamicCache). The two are timed in turn, `reps` times after one warm-up round; prints one JSON
object with, per batch size, the medians and min..max of the wall times and of the ratio transformers / Engine (above
1: Engine is ahead), the tokens/s, and whether the two produced the same tokens.

    python dev/bench_hf_generate.py --source=rl --run_name=cpu     # a trained checkpoint (chosen as chat_cli does)
    python dev/bench_hf_generate.py --tiny=True --reps=3           # a tiny random model and tokenizer made here

The export goes to a temporary directory, removed at the end. Needs transformers and tokenizers (requirements.txt).
"""

import json
import shutil
import statistics
import tempfile
import time

import torch

from nanotrain.checkpoint import load_model
from nanotrain.common import autodetect_device_type, run_script, synchronize
from nanotrain.configurator import configure
from nanotrain.engine import Engine
from nanotrain.errors import UserError
from nanotrain.export.hf import export_hf, require_transformers
from nanotrain.gpt import GPT, config_from_depth
from nanotrain.tokenizer import Tokenizer

source = "rl"  # which training stage's checkpoint: base | mid | sft | rl
run_name = ""  # run name; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
tiny = False  # True: a depth-2 model with random weights and a 300-token tokenizer made here (no checkpoint)
batch_sizes = "1,16"  # comma-separated numbers of prompts decoded together
max_tokens = 64  # new tokens per row
reps = 5  # timed rounds (after one warm-up round); each round times Engine, then transformers, per batch size
attn_implementation = "sdpa"  # transformers' attention for the export: sdpa | eager
seed = 0
config = configure(globals())

QUESTIONS = ["Hi!", "What is 12 + 30?", "Tell me a short story about a cat who learns to swim.", "Why is the sky blue?",
             "Name three colours.", "Write a haiku about the sea at night, with the moon on the water.",
             "What is the capital of France?", "How do I boil an egg?", "Count from one to ten.",
             "Explain gravity to a child in two sentences.", "What day comes after Monday?", "Say hello in French.",
             "Give me a list of four fruits and their colours, one per line.", "Is 17 a prime number?",
             "What do bees make?", "Summarise the plot of a fairy tale you like in one paragraph."]


def spread(xs, digits=4):
    """{"median", "min", "max"} of a list of numbers, rounded."""
    return {"median": round(statistics.median(xs), digits), "min": round(min(xs), digits),
            "max": round(max(xs), digits)}


def tiny_model(device):
    """A depth-2 GPT (random weights from init_weights plus N(0, 0.02^2) noise on every parameter, so its greedy
    tokens vary) and a tokenizer trained here on the questions: (model in eval mode, tokenizer)."""
    tokenizer = Tokenizer.train_from_iterator(iter(QUESTIONS * 20), 256 + 9 + 40)
    torch.manual_seed(seed)
    model = GPT(config_from_depth(2, tokenizer.get_vocab_size(), 256)).to(device)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval(), tokenizer


def timed(device, fn):
    """(seconds, result) of fn(), with the device synchronised before and after."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def main():
    require_transformers()
    from transformers import AutoModelForCausalLM
    try:
        sizes = [int(b) for b in str(batch_sizes).split(",") if b]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or max_tokens < 1 or reps < 1:
        raise UserError(f"--batch_sizes={batch_sizes!r}, --max_tokens={max_tokens}, --reps={reps}: expected "
                        f"positive integers (batch sizes comma-separated)")
    device = torch.device(autodetect_device_type())
    if tiny:
        model, tokenizer = tiny_model(device)
        where = "tiny random model"
    else:
        model, tokenizer, where, _ = load_model(source, run_name, step, device.type)
    engine = Engine(model, tokenizer)
    out_dir = tempfile.mkdtemp(prefix="bench_hf_")
    try:
        export_hf(model, tokenizer, f"{out_dir}/hf")
        hf = AutoModelForCausalLM.from_pretrained(f"{out_dir}/hf", trust_remote_code=True, dtype=torch.float32,
                                                  attn_implementation=attn_implementation).to(device).eval()
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    hf.generation_config.eos_token_id = None  # fixed length, as for Engine
    prompts = [tokenizer.render_for_completion({"messages": [{"role": "user", "content": q}]}) for q in QUESTIONS]
    pad = hf.generation_config.pad_token_id

    def hf_generate(batch):
        n = max(map(len, batch))
        ids = torch.tensor([[pad] * (n - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False)
        return out[:, n:].tolist()

    times = {b: {"engine": [], "transformers": [], "ratio": []} for b in sizes}
    same = {}
    for rep in range(reps + 1):  # round 0 warms up and is not counted
        for b in sizes:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            t_engine, want = timed(device, lambda: engine.generate(batch, max_tokens, ignore_eos=True))
            t_hf, got = timed(device, lambda: hf_generate(batch))
            same[b] = sum(g == w for g, w in zip(got, want))
            if rep > 0:
                times[b]["engine"].append(t_engine)
                times[b]["transformers"].append(t_hf)
                times[b]["ratio"].append(t_hf / t_engine)
    result = {"checkpoint": where, "device": device.type, "threads": torch.get_num_threads(),
              "attn_implementation": attn_implementation, "max_tokens": max_tokens, "reps": reps,
              "params": model.num_params(), "batches": {}}
    for b in sizes:
        t = times[b]
        result["batches"][str(b)] = {
            "engine_s": spread(t["engine"]), "transformers_s": spread(t["transformers"]),
            "ratio_transformers_over_engine": spread(t["ratio"], 3),
            "engine_tokens_per_s": round(b * max_tokens / statistics.median(t["engine"]), 1),
            "transformers_tokens_per_s": round(b * max_tokens / statistics.median(t["transformers"]), 1),
            "rows_with_equal_tokens": f"{same[b]}/{b}"}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    run_script(main)
