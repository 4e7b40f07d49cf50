"""
Complete a prompt with a trained checkpoint.

    python scripts/sample.py --prompt="The capital of France is" --temperature=0.8 --top_k=50
    python scripts/sample.py --stage=base --run_name=d4 --step=-1 --prompt="def add(a, b):"
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import sys

import torch

from nanotrain.checkpoint import load_model
from nanotrain.common import autodetect_device_type, run_script
from nanotrain.configurator import configure
from nanotrain.engine import Engine, TextStream

stage = "base"  # which training stage's checkpoints: base | mid | sft
run_name = ""  # run name; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
prompt = "The capital of France is"  # text to complete (a BOS token is put in front)
max_tokens = 64  # tokens to generate
temperature = 0.8  # 0 is greedy
top_k = 50  # sample among the k most likely tokens; 0 means all
seed = 42  # sampling seed
device_type = ""  # cuda | mps | cpu; "" autodetects
config = configure(globals())  # also checks max_tokens >= 1, temperature >= 0, top_k >= 1 or 0 (RULES)


def main():
    device = torch.device(device_type or autodetect_device_type())
    model, tokenizer, path, _ = load_model(stage, run_name, step, device)
    ids = tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id())
    print(f"checkpoint: {path}", file=sys.stderr)
    print(prompt, end="", flush=True)
    stream = TextStream(tokenizer)  # never half a character on the terminal
    engine = Engine(model, tokenizer)  # its sampler (nanotrain.engine.sample_next); stops at <|bos|> or <|assistant_end|>
    for tok in engine.generate_stream(ids, max_tokens, temperature, top_k or None, seed):
        print(stream.add([tok]), end="", flush=True)
    print(stream.add([], final=True))


if __name__ == "__main__":
    run_script(main)
