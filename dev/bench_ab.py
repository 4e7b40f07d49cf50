"""
The whole training step of two source trees, A and B, as the CPU recipe runs it: each round runs one tree's own
scripts/base_train.py (PYTHONPATH set to that tree, one fresh process) for `steps` optimizer steps at runs/cpu.sh's
pretraining settings (depth 4, 4,096 tokens per step, the recipe's optimizer values), and takes the per-step wall
times "dt" its metrics.jsonl logged, leaving out the first (warm-up) step. Rounds alternate A B, B A, A B, ... so
that drift in the machine's load cancels; reports each tree's median step time with its 10th-90th percentiles and
min..max, and the median and range of the per-round ratios B/A of the median step times. Prints one JSON object.
Needs the corpus and tokenizer of runs/cpu.sh (steps 1-2) in $NANOTRAIN_BASE_DIR (default ~/.cache/nanotrain); each
round writes a throw-away run under a temporary base directory that links them.

    git worktree add /tmp/nanotrain_main main                       # A: another commit, checked out
    python dev/bench_ab.py --a=/tmp/nanotrain_main --b=$PWD --rounds=8 --steps=12
    python dev/bench_ab.py --a=/tmp/nanotrain_main --b=$PWD --args="--depth=2 --max_seq_len=64 --device_batch_size=4 --total_batch_size=512"
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

from nanotrain.common import run_script
from nanotrain.configurator import configure
from nanotrain.errors import UserError

a = ""  # source tree A (a directory holding scripts/base_train.py and nanotrain/)
b = ""  # source tree B
rounds = 6  # rounds; each runs A once and B once, the order alternating
steps = 8  # optimizer steps per run (the first, warm-up, is left out of the times)
threads = 0  # OMP_NUM_THREADS of the runs; 0 leaves the environment's
args = ""  # base_train settings replacing the CPU recipe's shape (depth, sizes), as --name=value words
config = configure(globals())

RECIPE = ["--depth=4", "--max_seq_len=256", "--device_batch_size=8", "--total_batch_size=4096",  # runs/cpu.sh
          "--hparam_transfer=False", "--matrix_lr=0.03", "--embedding_lr=0.2", "--unembedding_lr=0.004",
          "--muon_weight_decay=0.4", "--lr_warmup_steps=0", "--grad_clip=1.0"]
QUIET = ["--eval_every=-1", "--eval_tokens=2048", "--sample_every=-1", "--save_every=-1", "--keep_last=1"]


def step_times(tree, base, name):
    """Runs `tree`'s base_train for `steps` steps as run `name` under base dir `base`. Returns its steps' dt (s),
    the first left out. Raises UserError with the run's last stderr line when it fails."""
    env = dict(os.environ, PYTHONPATH=tree, NANOTRAIN_BASE_DIR=base, PYTHONUNBUFFERED="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, os.path.join(tree, "scripts", "base_train.py"), *RECIPE, *shlex.split(args), *QUIET,
           f"--num_iterations={steps}", f"--run_name={name}"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=env)
    if r.returncode != 0:
        raise UserError(f"{tree}: base_train failed ({(r.stderr.strip().splitlines() or ['?'])[-1]})")
    with open(os.path.join(base, "base", name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [row["dt"] for row in rows if "dt" in row and row.get("step", 0) > 1]


def spread(xs):
    """Median, 10th and 90th percentiles, min and max of xs (linear interpolation)."""
    s = sorted(xs)

    def pct(q):
        k = (len(s) - 1) * q
        lo = int(k)
        return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)
    return {"median": statistics.median(s), "p10": pct(0.1), "p90": pct(0.9), "min": s[0], "max": s[-1], "n": len(s)}


def main():
    trees = [os.path.abspath(t) for t in (a, b)]
    for flag, t in zip(("--a", "--b"), trees):
        if not (a and b) or not os.path.isfile(os.path.join(t, "scripts", "base_train.py")):
            raise UserError(f"{flag}={t!r}: expected a source tree holding scripts/base_train.py")
    if steps < 2:
        raise UserError(f"--steps={steps}: expected >= 2 (the first step is left out)")
    home = os.environ.get("NANOTRAIN_BASE_DIR", os.path.expanduser("~/.cache/nanotrain"))
    times, ratios = [[], []], []
    with tempfile.TemporaryDirectory(prefix="bench_ab_") as base:
        for sub in ("data", "tokenizer"):
            os.symlink(os.path.join(home, sub), os.path.join(base, sub))
        for r in range(rounds):
            medians = {}
            for i in ((0, 1) if r % 2 == 0 else (1, 0)):
                t = step_times(trees[i], base, f"ab_{'ab'[i]}_{r}")
                times[i] += t
                medians[i] = statistics.median(t)
                print(f"round {r + 1}/{rounds} {'AB'[i]}: median step {medians[i] * 1000:.1f} ms", file=sys.stderr)
            ratios.append(medians[1] / medians[0])
    print(json.dumps({"a": {"tree": trees[0], "step_time_s": spread(times[0])},
                      "b": {"tree": trees[1], "step_time_s": spread(times[1])},
                      "ratio_b_over_a": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                         "per_round": ratios, "metric": "median step time of B / of A, per round"},
                      "settings": {"recipe": RECIPE, "args": args, "steps": steps, "rounds": rounds,
                                   "threads": threads or os.environ.get("OMP_NUM_THREADS")}}, indent=2))


if __name__ == "__main__":
    run_script(main)
