"""
Accuracy of a checkpoint on the validation split of the built-in chat tasks (and optionally a JSONL of
question/answer conversations), with greedy decoding. Prints a table and writes chat_eval.json into the run directory.

    python scripts/chat_eval.py                                   # the newest sft checkpoint
    python scripts/chat_eval.py --source=base --max_problems=50   # the baseline: a base model with the same prompts
    python scripts/chat_eval.py --jsonl=qa.jsonl                  # also graded on the final line of each reply

Every model gets the same chat prompt (nanotrain.tokenizer.render_for_completion); a base model, never trained on the
chat format, mostly fails: that is the baseline. Grading: nanotrain.tasks.grade.
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import os
import sys
import time

import torch

from nanotrain.checkpoint import load_model
from nanotrain.common import UserError, atomic_write_json, autodetect_device_type, run_script
from nanotrain.configurator import configure
from nanotrain.conversations import load_jsonl
from nanotrain.engine import Engine
from nanotrain.report import write_section_or_warn
from nanotrain.tasks import grade, load_task, wilson_interval

source = "sft"  # which stage's checkpoint: sft | rl | mid | base
run_name = ""  # run name; "" picks the run with the newest checkpoint
step = -1  # checkpoint step; -1 is the newest
tasks = "arith,spell,identity"  # comma-separated built-in tasks (their val split); "" for none
jsonl = ""  # optional JSONL file of conversations ending in the reference answer (graded on its final line)
max_problems = -1  # problems per task (the first ones of its val split); -1 means all
max_tokens = 64  # most tokens per answer
batch_size = 64  # prompts of equal length decoded together
tool = True  # run the calculator tool when the model calls it (False: the model writes the tool's output itself)
device_type = ""  # cuda | mps | cpu; "" autodetects
config = configure(globals())


def main():
    t_start = time.time()  # wall time of the evaluation, for the report card

    device = torch.device(device_type or autodetect_device_type())
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    problem_sets = [(name, load_task(name, "val")) for name in names]
    if jsonl:
        problem_sets.append((f"jsonl:{os.path.basename(jsonl)}", load_jsonl(jsonl)[0]))
    if not problem_sets:
        raise UserError("nothing to evaluate: set --tasks (e.g. arith,spell,identity) and/or --jsonl=path")
    model, tokenizer, path, meta = load_model(source, run_name, step, device)
    print(f"checkpoint: {path}", file=sys.stderr)
    engine = Engine(model, tokenizer)

    results = {}
    for name, problems in problem_sets:
        problems = problems if max_problems < 0 else problems[:max_problems]
        t0 = time.time()
        prompts = [tokenizer.render_for_completion(c) for c in problems]
        outs = engine.generate(prompts, max_tokens=max_tokens, temperature=0.0, max_batch=batch_size,
                               tool=tool)
        answers = [tokenizer.decode(o) for o in outs]
        correct = sum(grade(c, a) for c, a in zip(problems, answers))
        results[name] = {"correct": correct, "total": len(problems),
                         "accuracy": correct / len(problems) if problems else 0.0,
                         "ci95": list(wilson_interval(correct, len(problems)))}
        if problems:
            print(f"{name} example: {problems[0]['messages'][-2]['content']!r} -> {answers[0][:200]!r} "
                  f"({'right' if grade(problems[0], answers[0]) else 'wrong'}; {time.time() - t0:.1f}s)")

    print(f"\nchat eval of {source} checkpoint {path} (greedy, max_tokens {max_tokens}, tool {'on' if tool else 'off'})")
    print(f"{'task':<24} {'correct':>8} {'total':>6} {'accuracy':>9}  95% interval")
    for name, r in results.items():
        lo, hi = r["ci95"]
        print(f"{name:<24} {r['correct']:>8} {r['total']:>6} {100 * r['accuracy']:>8.2f}%  [{100 * lo:.1f}, {100 * hi:.1f}]")
    run_dir = os.path.dirname(os.path.dirname(path))  # <run_dir>/checkpoints/step_XXXXXX
    out = os.path.join(run_dir, "chat_eval.json")
    atomic_write_json(out, {"checkpoint": path, "step": meta.get("step"), "source": source, "config": config,
                            "results": results})
    print(f"saved {out}")
    # the results are saved: a report card that cannot be written is one warning line, not a failure
    report = write_section_or_warn(os.path.basename(run_dir), "eval", run_dir, {"wall_time_s": time.time() - t_start})
    if report:
        print(f"Report card: {report}")


if __name__ == "__main__":
    run_script(main)
