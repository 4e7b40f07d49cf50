"""
Evaluate a base checkpoint: CORE (the DCLM 22-task metric, computed as nanochat computes it: nanotrain/evaluation/core_eval.py)
or the gold-answer bits per byte of real benchmark rows (NOT CORE: a continuous signal for tiny models,
nanotrain/evaluation/gold_bpb.py). Writes core.json and core.csv (or gold_bpb.json) into the run directory and the CORE table
into the run's report card.

    python scripts/base_eval.py --run_name=d20                       # CORE of the newest checkpoint
    python scripts/base_eval.py --max_per_task=100                   # quick: 100 rows per task
    python scripts/base_eval.py --eval_bundle=/data/eval_bundle      # a copy of the pinned bundle, checked
    python scripts/base_eval.py --eval_bundle=DIR --own_eval_bundle=True   # your own bundle
    python scripts/base_eval.py --mode=gold_bpb --step=0             # not CORE: gold-answer bpb
    torchrun --standalone --nproc_per_node=8 scripts/base_eval.py    # rows strided over 8 ranks
    python scripts/base_eval.py --lm_eval_tasks=hellaswag,arc_easy   # lm-evaluation-harness (nanotrain/evaluation/lm_harness.py)

The protocol is nanochat's (nanotrain/evaluation/core_eval.py states it step by step). The baseline file: the random
baselines come from the eval bundle's own eval_meta_data.csv (the older DCLM file), which nanochat's numbers and its
"time to GPT-2" leaderboard use. GPT-2 as nanochat measures it: 124M 0.1139, 355M 0.1849, 774M 0.2146, 1.5B 0.2565;
three identical nanochat d24 runs scored 0.2540-0.2643, so compare over seeds. The eval bundle (eval_bundle.zip,
~162 MB, llm-foundry's ICL data as nanochat uses it) is downloaded once per machine into <base_dir>/eval_bundle and
checked file by file on every load (nanotrain/evaluation/core_bundle.py; a copy made by hand is compared with it). At
CPU scale a depth-4 model sits at chance on CORE: --mode=gold_bpb (and base_train's --gold_bpb_every) reports the
bits per byte spent on the gold answers of 400 real ARC-Easy and HellaSwag rows, a CPU-scale signal comparable with
nothing published.
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import os
import time

from nanotrain.checkpoint import load_model
from nanotrain.common import atomic_write_json, compute_init, print0, run_script
from nanotrain.configurator import configure
from nanotrain.downloads import rank0_first
from nanotrain.errors import UserError
from nanotrain.evaluation.core_bundle import ensure_bundle
from nanotrain.evaluation.core_eval import evaluate_core, write_results
from nanotrain.evaluation.gold_bpb import ensure_rows, evaluate_gold_bpb
from nanotrain.evaluation.lm_harness import evaluate_checkpoint
from nanotrain.report.card import write_section_or_warn
from nanotrain.tokenizer import get_token_bytes
from nanotrain.training import precision

run_name = ""  # the base run; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
mode = "core"  # core | gold_bpb (gold-answer bits per byte: not CORE)
eval_bundle = ""  # a CORE eval bundle directory copied by hand; "" downloads it once into <base_dir>/eval_bundle
own_eval_bundle = False  # True: --eval_bundle is your own bundle, not compared with the pinned one (only checked)
max_per_task = -1  # rows per CORE task (shuffled with a fixed seed, then cut); -1 means all
dtype = ""  # bfloat16 | float32; "" means bfloat16 autocast on CUDA and on CPUs with fast bf16 matmuls, else float32
device_type = ""  # cuda | mps | cpu; "" autodetects
log_samples = False  # also write core_samples.jsonl next to core.json: one record per CORE row (prompts, every option's score, correct)
lm_eval_tasks = ""  # harness tasks (comma-separated) instead of CORE, on the checkpoint exported for transformers
lm_eval_include = ""  # a directory of local harness task YAMLs (e.g. with local data files, offline)
config = configure(globals())


def main():
    t_start = time.time()
    if mode not in ("core", "gold_bpb"):
        raise UserError(f"--mode={mode}: expected core or gold_bpb")
    _, rank, _, _, device = compute_init(device_type)
    if lm_eval_tasks:  # max_per_task is the harness's row limit
        return evaluate_checkpoint(run_name, step, device, lm_eval_tasks, lm_eval_include, max_per_task)
    # the data first: offline, the error comes before any checkpoint is read
    bundle = rank0_first(lambda: ensure_bundle(eval_bundle, own_eval_bundle), device) if mode == "core" else None
    rows = rank0_first(ensure_rows, device) if mode == "gold_bpb" else None
    model, tokenizer, path, meta = load_model("base", run_name, step, device)
    print0(f"checkpoint: {path}")
    _, autocast_ctx = precision(dtype, device)
    run_dir = os.path.dirname(os.path.dirname(path))  # <run_dir>/checkpoints/step_XXXXXX
    if mode == "gold_bpb":
        result = evaluate_gold_bpb(model, tokenizer, rows, get_token_bytes(device), device, autocast_ctx)
        print0("gold-answer bpb (not CORE): " + ", ".join(f"{k} {v:.4f}" for k, v in result.items()))
        if rank == 0:
            atomic_write_json(os.path.join(run_dir, "gold_bpb.json"), dict(result, step=meta.get("step"),
                                                                           checkpoint=path))
        return
    result = evaluate_core(model, tokenizer, bundle, device, autocast_ctx, max_per_task, log_samples=log_samples)
    print0(f"CORE {result['core']:.4f} ({len(result['tasks'])} tasks"
           + (f", at most {max_per_task} rows each" if max_per_task > 0 else "") + f"; {time.time() - t_start:.0f}s)")
    if rank == 0:
        out = write_results(run_dir, dict(result, checkpoint=path, bundle=bundle), meta.get("step"))
        print0(f"saved {out} and core.csv" + (" and core_samples.jsonl" if log_samples else ""))
        # the results are saved: a report card that cannot be written is one warning line, not a failure
        write_section_or_warn(os.path.basename(run_dir), "base", run_dir)


if __name__ == "__main__":
    run_script(main)
