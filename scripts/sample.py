"""
Complete a prompt with a trained checkpoint.

    python scripts/sample.py --prompt="The capital of France is" --temperature=0.8 --top_k=50
    python scripts/sample.py --stage=base --run_name=d4 --step=-1 --prompt="def add(a, b):"
"""

import sys

import torch

from nanotrain.checkpoint import find_run_dir, list_checkpoints, load_checkpoint
from nanotrain.common import UserError, autodetect_device_type, die
from nanotrain.configurator import configure

stage = "base"  # which training stage's checkpoints: base | mid | sft
run_name = ""  # run name; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
prompt = "The capital of France is"  # text to complete (a BOS token is put in front)
max_tokens = 64  # tokens to generate
temperature = 0.8  # 0 is greedy
top_k = 50  # sample among the k most likely tokens; 0 means all
seed = 42  # sampling seed
device_type = ""  # cuda | mps | cpu; "" autodetects
config = configure(globals())


def main():
    from nanotrain.gpt import GPT, GPTConfig
    from nanotrain.tokenizer import get_tokenizer

    device = torch.device(device_type or autodetect_device_type())
    run_dir = find_run_dir(stage, run_name)
    if run_dir is None:
        where = f" for --run_name={run_name}" if run_name else ""
        raise UserError(f"no {stage} checkpoint found{where}; "
                        f"train one first (python scripts/base_train.py)")
    paths = list_checkpoints(run_dir)
    path = paths[-1] if step < 0 else next((p for p in paths if p.endswith(f"step_{step:06d}")), None)
    if path is None:
        raise UserError(f"--step={step}: no such checkpoint in {run_dir}")
    ckpt = load_checkpoint(path, device, load_optimizer=False)
    tokenizer = get_tokenizer()
    with torch.device("meta"):
        model = GPT(GPTConfig(**ckpt["meta"]["model_config"]))
    model.to_empty(device=device)
    model.init_weights()
    model.load_state_dict(ckpt["model"])
    model.eval()
    ids = tokenizer.encode(prompt, prepend=tokenizer.get_bos_token_id())
    print(f"checkpoint: {path}", file=sys.stderr)
    print(prompt, end="", flush=True)
    out, shown = [], ""
    for tok in model.generate(ids, max_tokens=max_tokens, temperature=temperature, top_k=top_k or None, seed=seed):
        if tok == tokenizer.get_bos_token_id():
            break
        out.append(tok)
        text = tokenizer.decode(out)  # decode the whole completion: a token may end inside a UTF-8 character
        if not text.endswith("\ufffd"):
            print(text[len(shown):], end="", flush=True)
            shown = text
    print(tokenizer.decode(out)[len(shown):])


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        die(str(e))
