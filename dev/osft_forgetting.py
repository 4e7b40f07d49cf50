"""
How much a second fine-tuning stage forgets, with and without orthogonal subspace fine-tuning (OSFT): the experiment
behind the OSFT entry of dev/LOG.md. Needs the CPU recipe's base model (runs/cpu.sh steps 1-3, run "cpu") in
$NANOTRAIN_BASE_DIR. For each seed:
  1. chat_sft from the base model on `arith` only (run arith_s<seed>);
  2. from that, a second chat_sft on `spell` only: plain, and with --osft_rank_ratio=r for each r in `ratios`;
  3. chat_eval of every model on arith and spell (the first `problems` validation problems of each), greedy.
And, for the base corpus's val bpb before and after mid-training: mid_train from the base model plain and with OSFT
(first seed only), the bpb on the corpus's val split of base, mid-plain and mid-OSFT.
Prints and writes one JSON object (<base_dir>/osft_forgetting_seeds<seeds>.json): accuracies with 95% Wilson intervals, bpbs.

    python dev/osft_forgetting.py --seeds=1,2 --ratios=0.5,0.25 --problems=200
    OMP_NUM_THREADS=1 python dev/osft_forgetting.py --seeds=1 &   # or one process per seed, one thread each
    OMP_NUM_THREADS=1 python dev/osft_forgetting.py --seeds=2 --mid_steps=0
"""

import json
import os
import subprocess
import sys

import torch

from nanotrain.common import get_base_dir, run_script
from nanotrain.configurator import configure
from nanotrain.tasks.common import wilson_interval

base_run = "cpu"  # the base run to start from
seeds = "1,2"  # comma-separated seeds of the SFT stages (data order and task generation)
ratios = "0.5,0.25"  # comma-separated --osft_rank_ratio values of the second stage (plain fine-tuning always runs)
problems = 200  # validation problems per task in chat_eval
sft_args = "--examples_per_step=32 --max_tokens_per_device=512 --eval_every=-1 --save_every=-1"  # both SFT stages
mid_steps = 60  # mid_train steps for the bpb comparison (0: skip it)
eval_tokens = 131072  # val tokens of the base corpus for the bpb comparison
config = configure(globals())
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sh(script, *args):
    """Runs scripts/<script> with args; stops with its stderr's tail on failure. Returns stdout."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", script), *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{script} {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def accuracies(run):
    """{task: {"correct", "total", "accuracy", "ci95"}} of chat_eval on the SFT run `run`."""
    sh("chat_eval.py", "--source=sft", f"--run_name={run}", "--tasks=arith,spell", f"--max_problems={problems}")
    with open(os.path.join(get_base_dir(), "sft", run, "chat_eval.json")) as f:
        results = json.load(f)["results"]
    return {t: dict(r, ci95=tuple(round(x, 4) for x in wilson_interval(r["correct"], r["total"]))) for t, r in results.items()}


def corpus_bpb(stage, run):
    """Bits per byte of the newest checkpoint of <stage>/<run> on the base corpus's val split (eval_tokens)."""
    from nanotrain.checkpoint import load_model
    from nanotrain.dataloader import TokenLoader
    from nanotrain.dataset import resolve_data_files
    from nanotrain.loss_eval import evaluate_bpb
    from nanotrain.tokenizer import get_token_bytes
    model, tokenizer, _, meta = load_model(stage, run)
    rows, seq = 8, model.config.max_seq_len
    loader = TokenLoader(tokenizer, resolve_data_files("builtin", "val"), rows, seq, torch.device("cpu"), 0, 1)
    return evaluate_bpb(model, loader, max(1, eval_tokens // (rows * seq)), get_token_bytes("cpu"))


def main():
    out = {"config": config, "seeds": {}}
    for seed in [int(s) for s in seeds.split(",")]:
        first = f"arith_s{seed}"
        sh("chat_sft.py", "--source=base", f"--source_run_name={base_run}", f"--run_name={first}", "--tasks=arith:1",
           f"--seed={seed}", *sft_args.split())
        res = {"after_arith": accuracies(first)}
        for r in [0.0] + [float(x) for x in ratios.split(",")]:
            run = f"spell_r{r:g}_s{seed}"
            sh("chat_sft.py", "--source=sft", f"--source_run_name={first}", f"--run_name={run}", "--tasks=spell:1",
               f"--seed={seed}", f"--osft_rank_ratio={r}", *sft_args.split())
            res[f"after_spell_r{r:g}"] = accuracies(run)
        out["seeds"][seed] = res
        print(json.dumps({seed: res}), flush=True)
    if mid_steps > 0:
        bpb = {"base": corpus_bpb("base", base_run)}
        for r in (0.0, float(ratios.split(",")[0])):
            run = f"mid_r{r:g}"
            sh("mid_train.py", f"--base_run_name={base_run}", f"--run_name={run}", f"--num_iterations={mid_steps}",
               "--eval_every=-1", "--save_every=-1", f"--osft_rank_ratio={r}")
            bpb[run] = corpus_bpb("mid", run)
        out["corpus_val_bpb"] = bpb
    path = os.path.join(get_base_dir(), f"osft_forgetting_seeds{seeds.replace(',', '_')}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    run_script(main)
