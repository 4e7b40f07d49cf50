"""
The GPU recipe (scripts/base_train.py's defaults): the automatic total batch from the training horizon, the lr and
weight-decay transfer from depth 12, and what a run stores and keeps of them.
"""

import json
import os

import pytest
import torch
from helpers import CPU_RECIPE, run_script

from nanotrain import training
from nanotrain.auto_batch_size.search import candidate_batch_sizes
from nanotrain.errors import UserError
from nanotrain.gpt import GPT, config_from_depth

# Computed once with nanochat's own code (karpathy/nanochat at 92d63d4: nanochat/gpt.py's GPT on the meta device at
# vocab 32,768 and 2,048-token rows, aspect ratio 64, head_dim 128; scripts/base_train.py's get_scaling_params,
# D_REF, B_REF and the batch, lr and weight-decay lines), not with nanotrain's: depth -> (scaling parameters, total
# batch in tokens, lr scale, Muon weight-decay scale). The same at data:param ratios 8, 12 and 20 (the ratio is in
# both D and D_ref).
NANOCHAT = {
    8: (41943232, 262144, 0.7071067811865476, 1.8561540867910067),
    10: (70123820, 524288, 1.0, 1.5700929013850073),
    12: (110100912, 524288, 1.0, 1.0),
    14: (164233804, 524288, 1.0, 0.6703912916734243),
    16: (234881792, 524288, 1.0, 0.4687503065371708),
    18: (324404172, 1048576, 1.4142135623730951, 0.47997595721440556),
    20: (435160240, 1048576, 1.4142135623730951, 0.35781348723414313),
    22: (569509292, 1048576, 1.4142135623730951, 0.27340414839104443),
    24: (729810624, 1048576, 1.4142135623730951, 0.21335151594072527),
    26: (918423532, 1048576, 1.4142135623730951, 0.16953638224074452),
}


def scaling_params(depth):
    with torch.device("meta"):
        return GPT(config_from_depth(depth, 32768, 2048)).num_scaling_params()


@pytest.mark.unit
@pytest.mark.parametrize("ratio", [8, 12, 20])
def test_automatic_batch_and_transfer_match_nanochats_table(ratio):
    """
    Depths 8-26 at ratios 8, 12 and 20: nanotrain's scaling parameters, automatic total batch and scale factors equal
    the table computed with nanochat's code (above). Catches counting every parameter or leaving out the lm_head
    (other horizons: 2^20 at depth 16, 2^18 at depth 10), floor or ceil for round in the power of two (2^19 at depth
    18), the lr scaled linearly with the batch, and the weight decay scaled without the horizon (1.414 at depth 24).
    """
    ref = ratio * scaling_params(12)
    for depth, (params, batch, lr_scale, wd_scale) in NANOCHAT.items():
        assert scaling_params(depth) == params, depth
        horizon = int(ratio * params)
        got = training.auto_total_batch_size(horizon, ref)
        assert got == batch, (depth, got)
        assert training.hparam_transfer_scales(got, horizon, ref) == pytest.approx((lr_scale, wd_scale), rel=1e-12)


@pytest.mark.unit
def test_the_automatic_batch_divides_for_1_2_and_8_ranks_else_one_line():
    """
    For every depth of the table at 2,048-token rows, the automatic batch (a power of two, at least 2^18) has device
    batch candidates on 1, 2 and 8 ranks and each divides it exactly; on 3 ranks there is none and the refusal is one
    line naming --total_batch_size and the world size. Catches a batch that is not a power of two (no whole
    grad_accum_steps on 8 ranks) and a refusal that is a traceback.
    """
    for _, batch, _, _ in NANOCHAT.values():
        for world_size in (1, 2, 8):
            candidates = candidate_batch_sizes(batch, 2048, world_size)
            assert candidates and all(training.grad_accum_steps_for(batch, c, 2048, world_size) * c * 2048 *
                                      world_size == batch for c in candidates)
    with pytest.raises(UserError) as e:
        candidate_batch_sizes(1048576, 2048, 3)
    assert "\n" not in str(e.value) and "--total_batch_size=1048576" in str(e.value) and "3" in str(e.value)


def _config(base, run):
    return json.loads((base / "base" / run / "config.json").read_text())


@pytest.mark.smoke
def test_automatic_batch_under_two_ranks_then_resume_keeps_it(base_dir):
    """
    base_train --total_batch_size=-1 on 2 gloo ranks with the automatic device batch: config.json stores the batch
    used (not -1) with the recipe's scale factors, every optimizer group's lr is the flag times the lr scale (read
    back from the checkpoint), and a resume of 2 more steps keeps the batch, the lrs and the weight decay. On 3 ranks
    the same run stops in one line before it trains. Catches -1 stored (a resume could not check the batch), the
    scales not applied to the optimizers, and a resume that recomputes another batch or lr.
    """
    tiny = ["--depth=2", "--max_seq_len=64", "--total_batch_size=-1", "--auto_batch_size=True",
            "--device_memory_gb=0.25", "--eval_tokens=2048", "--eval_every=-1", "--sample_every=-1", "--save_every=-1",
            "--run_name=auto", "--target_param_data_ratio=12"]
    r = run_script("base_train.py", *tiny, "--num_iterations=2", base_dir=base_dir, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = _config(base_dir, "auto")
    recipe = cfg["recipe"]
    batch = cfg["total_batch_size"]
    assert recipe["automatic"] and batch == recipe["total_batch_size"] and batch & (batch - 1) == 0
    with torch.device("meta"):
        sp = GPT(config_from_depth(2, 512, 64)).num_scaling_params()
        sp_ref = GPT(config_from_depth(12, 512, 64)).num_scaling_params()
    assert recipe["horizon_tokens"] == 12 * sp and recipe["ref_horizon_tokens"] == 12 * sp_ref
    assert recipe["lr_scale"] == pytest.approx((batch / 2**19) ** 0.5)
    ckpt = base_dir / "base" / "auto" / "checkpoints" / "step_000002"
    groups = [g for o in torch.load(ckpt / "optim.pt") for g in o["param_groups"]]
    lrs = sorted(g["initial_lr"] for g in groups)
    assert 0.02 * recipe["lr_scale"] in [pytest.approx(x) for x in lrs]  # Muon's matrix lr, the flag times the scale
    assert 0.28 * recipe["weight_decay_scale"] in [pytest.approx(g["weight_decay"]) for g in groups]
    r = run_script("base_train.py", *tiny, "--num_iterations=4", "--resume=True", base_dir=base_dir, nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    again = _config(base_dir, "auto")
    assert again["total_batch_size"] == batch and again["recipe"] == recipe
    ckpt4 = base_dir / "base" / "auto" / "checkpoints" / "step_000004"
    groups4 = [g for o in torch.load(ckpt4 / "optim.pt") for g in o["param_groups"]]
    assert lrs == sorted(g["initial_lr"] for g in groups4)
    assert [g["weight_decay"] for g in groups] == [g["weight_decay"] for g in groups4]
    r = run_script("base_train.py", *tiny, "--num_iterations=2", "--run_name=three", base_dir=base_dir, nproc=3)
    assert r.returncode != 0
    err = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert err and "--total_batch_size" in err[0] and "3" in err[0], r.stderr[-2000:]
    assert not (base_dir / "base" / "three" / "checkpoints").exists()


@pytest.mark.unit
def test_cpu_recipe_flags_are_the_old_defaults():
    """tests/helpers.CPU_RECIPE (runs/cpu.sh states the same) is the CPU recipe's values, each differing from
    base_train's GPU defaults where it has to. Catches a recipe that silently follows the new defaults."""
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runs", "cpu.sh")).read()
    for flag in CPU_RECIPE[:-1]:
        assert flag in text, flag


def speedrun_commands():
    """The scripts/*.py commands of runs/speedrun.sh: [(script path, [--name=value, ...])], continued lines joined."""
    import re
    import shlex

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = open(os.path.join(repo, "runs", "speedrun.sh")).read().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        m = re.search(r"(scripts/\w+\.py)(.*)", line.split("#")[0] if not line.lstrip().startswith("#") else "")
        if m:
            flags = [a for a in shlex.split(m.group(2).replace("$NPROC", "8")) if a.startswith("--")]
            commands.append((os.path.join(repo, m.group(1)), flags))
    return commands


# nanochat HEAD's architecture and Muon options (karpathy/nanochat 92d63d4: on in nanochat/gpt.py and its optimizer,
# no flags there), as base_train's flags
NANOCHAT_OPTIONS = ["--smear=True", "--backout=True", "--x0_lambdas=True", "--rotary_base=100000", "--qk_scale=1.44",
                    "--muon_beta2=0.9", "--momentum=0.97", "--momentum_warmup=400", "--final_momentum=0.90"]


@pytest.mark.unit
def test_speedrun_flags_are_accepted_and_run_nanochats_options():
    """
    Every scripts/*.py command of runs/speedrun.sh passes its flags through the script's own settings (the script's
    top level run as a module: its configurator parses and range-checks every --name=value, main() does not run), and
    the pretraining command carries nanochat HEAD's options. Catches a flag renamed or dropped in a script (the
    speedrun would stop hours in with `error: unknown setting`), a value of the wrong type or range, and a speedrun
    that silently trains without nanochat's architecture.
    """
    import subprocess
    import sys

    commands = speedrun_commands()
    scripts = [os.path.basename(p) for p, _ in commands]
    assert {"tok_train.py", "base_train.py", "base_eval.py", "mid_train.py", "chat_sft.py", "chat_eval.py",
            "chat_rl.py"} <= set(scripts)
    base_flags = dict(commands)[next(p for p, _ in commands if p.endswith("base_train.py"))]
    assert set(NANOCHAT_OPTIONS) <= set(base_flags), base_flags
    # one process: each script's top level (imports, settings, configure) with its flags as sys.argv
    check = ("import json, runpy, sys\n"
             "for path, flags in json.loads(sys.argv[1]):\n"
             "    sys.argv = [path] + flags\n"
             "    try:\n"
             "        runpy.run_path(path, run_name='speedrun_flags')\n"
             "    except SystemExit as e:\n"
             "        print(f'REFUSED {path} {flags} exit {e.code}'); raise\n"
             "    print('OK', path)\n")
    out = subprocess.run([sys.executable, "-c", check, json.dumps(commands)], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("OK ") == len(commands), out.stdout
