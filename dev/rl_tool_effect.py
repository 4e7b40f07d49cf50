"""
What the calculator tool and the RL stage buy on the CPU recipe: the experiment behind the "tool and RL" entry of
dev/LOG.md. Needs the CPU recipe's mid-trained model (runs/cpu.sh steps 1-5, run "cpu") in $NANOTRAIN_BASE_DIR.
For each seed:
  1. chat_sft from the mid model with the recipe's settings and --seed=<seed> (run sft_s<seed>);
  2. chat_eval of it on arith, spell and identity, greedy, tool on; and on arith with the tool's execution off
     (--tool=False: the model writes the tool's output itself);
  3. chat_rl from it with the recipe's settings and --seed=<seed> (run sft_s<seed>), its wall time;
  4. chat_eval of the RL model on arith, spell and identity, tool on.
Prints and writes one JSON object (<base_dir>/rl_tool_effect_seeds<seeds>.json): accuracies with 95% Wilson
intervals, RL wall times.

    python dev/rl_tool_effect.py --seeds=42,43
"""

import json
import os
import subprocess
import sys
import time

from nanotrain.common import get_base_dir, run_script
from nanotrain.configurator import configure
from nanotrain.tasks.common import wilson_interval

mid_run = "cpu"  # the mid run to start from
seeds = "42,43"  # comma-separated seeds of the SFT and RL stages
problems = 200  # validation problems per task in chat_eval (identity has 100)
sft_args = "--eval_every=-1 --max_tokens_per_device=512"  # as runs/cpu.sh
rl_args = ""  # extra chat_rl settings ("" : runs/cpu.sh's, see RL_RECIPE)
config = configure(globals())
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RL_RECIPE = "--num_iterations=30 --eval_every=-1 --save_every=-1"  # runs/cpu.sh's RL stage


def sh(script, *args):
    """Runs scripts/<script> with args; stops with its stderr's tail on failure. Returns stdout."""
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", script), *args], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{script} {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    return r.stdout


def accuracies(source, run, tasks, tool=True):
    """{task: {"correct", "total", "accuracy", "ci95"}} of chat_eval on the newest checkpoint of <source>/<run>."""
    sh("chat_eval.py", f"--source={source}", f"--run_name={run}", f"--tasks={tasks}", f"--max_problems={problems}",
       f"--tool={tool}")
    with open(os.path.join(get_base_dir(), source, run, "chat_eval.json")) as f:
        results = json.load(f)["results"]
    return {t: dict(r, ci95=[round(x, 4) for x in wilson_interval(r["correct"], r["total"])])
            for t, r in results.items()}


def main():
    out = {"config": config, "seeds": {}}
    for seed in [int(s) for s in seeds.split(",")]:
        run = f"sft_s{seed}"
        sh("chat_sft.py", f"--source_run_name={mid_run}", f"--run_name={run}", f"--seed={seed}", *sft_args.split())
        res = {"sft_tool_off": accuracies("sft", run, "arith", tool=False),
               "sft": accuracies("sft", run, "arith,spell,identity")}
        t0 = time.time()
        sh("chat_rl.py", f"--source_run_name={run}", f"--run_name={run}", f"--seed={seed}",
           *(rl_args or RL_RECIPE).split())
        res["rl_wall_s"] = round(time.time() - t0, 1)
        res["rl"] = accuracies("rl", run, "arith,spell,identity")
        out["seeds"][seed] = res
        print(json.dumps({seed: res}), flush=True)
    path = os.path.join(get_base_dir(), f"rl_tool_effect_seeds{seeds.replace(',', '_')}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    print(f"saved {path}")


if __name__ == "__main__":
    run_script(main)
