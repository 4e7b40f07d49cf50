"""scripts/bench.py through the command line: the JSON it prints (keys, types, positive numbers) and its errors."""

import ast
import contextlib
import json
from pathlib import Path

import pytest
import torch
from helpers import run_script

from nanotrain.muon import ns_dtype_for

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TINY = ["--depth=2", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=512", "--loader_seconds=0.2",
        "--tokenizer_chars=100000"]

RESULT_KEYS = {  # the result of one configuration: key -> type(s)
    "config": dict, "dtype": str, "grad_accum_steps": int, "model": dict, "tokens_per_step": int,
    "tokens_per_sec": float, "tokens_per_sec_p10_p90": list, "step_time_s": dict, "warmup_step_times_s": list,
    "flops_per_token": float, "achieved_flops": float, "peak_flops": float, "peak_flops_source": str,
    "peak_flops_samples": list, "mfu": float, "peak_memory_bytes": int, "peak_memory_source": str,
    "loader_tokens_per_sec": float, "loader_vs_trainer": float, "threads": int,
}
POSITIVE = ["tokens_per_sec", "flops_per_token", "achieved_flops", "peak_flops", "mfu", "peak_memory_bytes",
            "loader_tokens_per_sec", "loader_vs_trainer", "threads", "grad_accum_steps"]


# FLOPs per token and parameters of the default model (value embeddings on, smear off) at the tokenizer's vocab of 512
# (conftest.TINY_VOCAB), counted by hand (PaLM appendix B: 6 x matmul weights + 12 x layers x heads x head_dim x T):
# depth 2, T 64: model_dim 128, 1 head of 128; matmul weights: blocks 2 x 12 x 128^2 = 393,216, block 1's value-embedding
#   gate 12 x 1, lm_head 512 x 128 = 65,536: 458,764, x 6 = 2,752,584; attention 12 x 2 x 1 x 128 x 64 = 196,608:
#   2,949,192. Parameters: wte, lm_head and block 1's value embedding 3 x 65,536 = 196,608, blocks 393,216, gate 12:
#   589,836.
# depth 4, T 256: model_dim 256, 2 heads of 128; 4 x 12 x 256^2 = 3,145,728 + gates of blocks 1 and 3 2 x 12 x 2 +
#   lm_head 512 x 256 = 131,072: 3,276,848, x 6 = 19,661,088; attention 12 x 4 x 2 x 128 x 256 = 3,145,728: 22,806,816.
#   Parameters: 2 x 131,072 + value embeddings of blocks 1 and 3 2 x 512 x 256 + 3,145,728 + 48 = 3,670,064.
FLOPS_PER_TOKEN = {2: 2_949_192, 4: 22_806_816}
NUM_PARAMS = {2: 589_836, 4: 3_670_064}
# depth 1, T 64, without value embeddings and with smear (--value_embeds=False --smear=True): model_dim 64, 1 head of
#   64; 12 x 64^2 = 49,152 + the smear gate 12 + lm_head 512 x 64 = 32,768: 81,932, x 6 = 491,592; attention 12 x 1 x
#   1 x 64 x 64 = 49,152: 540,744. Parameters: wte and lm_head 2 x 32,768, the block 49,152, the smear gate 12 and
#   smear_lambda 1: 114,701.
FLOPS_PER_TOKEN_D1_SMEAR, NUM_PARAMS_D1_SMEAR = 540_744, 114_701


def check_result(r, steps, depth, tokens):
    """
    Schema of one configuration's result (catches a missing field, a string where a number belongs, or a zero), and
    its derived numbers from independent inputs: the literal tokens per step of the command line, the hand-counted
    FLOPs per token and parameters above, and the measured median step time and peak (not the result's own
    intermediate fields): tokens/s = tokens / median, achieved FLOP/s = FLOPs per token x tokens/s, MFU = achieved /
    the larger peak sample. Fails on FLOPs per token from 6 x all parameters (3,539,094 at depth 2: the embeddings
    counted), tokens per micro-batch or per row instead of per optimizer step, an MFU without the FLOPs per token, and
    a peak other than the larger sample.
    """
    for key, typ in RESULT_KEYS.items():
        assert isinstance(r[key], typ), (key, r.get(key))
    for key in POSITIVE:
        assert r[key] > 0, key
    st = r["step_time_s"]
    assert set(st) == {"median", "min", "max", "p10", "p90", "n"} and st["n"] == steps
    assert 0 < st["min"] <= st["p10"] <= st["median"] <= st["p90"] <= st["max"]
    assert r["tokens_per_step"] == tokens
    assert r["flops_per_token"] == FLOPS_PER_TOKEN[depth] and r["model"]["num_params"] == NUM_PARAMS[depth]
    peak = max(r["peak_flops_samples"])
    assert r["peak_flops"] == peak
    assert r["tokens_per_sec"] == pytest.approx(tokens / st["median"])
    assert r["achieved_flops"] == pytest.approx(FLOPS_PER_TOKEN[depth] * tokens / st["median"])
    assert r["mfu"] == pytest.approx(FLOPS_PER_TOKEN[depth] * tokens / st["median"] / peak)
    assert r["compile_s"] is None  # compile is off in these runs


@pytest.mark.smoke
def test_bench_prints_one_json_object(base_dir):
    """
    Two timed steps of a tiny config, profiled: stdout is exactly one JSON object with the documented schema, and the
    profile's phases add up to the measured step time (fails if backward is counted inside forward as well, or a
    phase is left out).
    """
    r = run_script("bench.py", *TINY, "--warmup_steps=1", "--steps=2", "--profile=True", base_dir=base_dir)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)  # fails if anything else is printed on stdout
    check_result(out, 2, depth=2, tokens=512)
    default = "bfloat16" if ns_dtype_for("cpu") == torch.bfloat16 else "float32"  # bf16 where its matmuls are fast
    assert out["config"]["depth"] == 2 and out["grad_accum_steps"] == 2 and out["dtype"] == default
    assert isinstance(out["rss_peak_delta_bytes"], int)
    tok = out["tokenizer"]
    assert tok["chars_per_sec"] > 0 and tok["tokens_per_sec"] > 0 and tok["docs"] > 0
    sysinfo = out["system"]
    assert sysinfo["device"] == "cpu" and sysinfo["torch"] and sysinfo["cpu_count"] >= 1
    assert len(sysinfo["load_avg_start"]) == 3
    assert isinstance(out["warnings"], list) and all(isinstance(w, str) for w in out["warnings"])
    phases = out["profile"]["phases_s_per_step"]
    assert set(phases) == {"loader", "forward", "backward", "optimizer_step"} and min(phases.values()) >= 0
    st = out["step_time_s"]
    mean_step = (st["min"] + st["max"]) / 2  # two steps
    assert 0.85 * mean_step <= sum(phases.values()) <= 1.02 * mean_step, (phases, st)
    ops = {o["op"] for o in out["profile"]["top_ops"]}
    assert "aten::mm" in ops and sum(o["share"] for o in out["profile"]["top_ops"]) <= 1.0 + 1e-9
    assert "aten::mm" in r.stderr  # the profiler's table


@pytest.mark.smoke
@pytest.mark.slow  # bench.py is a developer's tool; its one-run output is in the default run
def test_bench_vs_interleaves_two_configs(base_dir):
    """--vs: both configurations' results, one ratio per round, their median; B differs from A only as asked (its
    FLOPs per token and parameters are the hand count of depth 1 without value embeddings and with smear, A's those
    of depth 2 with the defaults (value embeddings, no smear): fails on B built with A's model, on either model
    option not passed to the model, or on FLOPs counted from all parameters)."""
    r = run_script("bench.py", *TINY, "--warmup_steps=1", "--pairs=2", "--pair_steps=1", "--memory_estimate=False",
                   "--vs=--depth=1 --prefetch=1 --value_embeds=False --smear=True", base_dir=base_dir)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for side in ("a", "b"):
        RESULT_KEYS_NO_MEM = {k: v for k, v in RESULT_KEYS.items() if k != "peak_memory_bytes"}
        for key, typ in RESULT_KEYS_NO_MEM.items():
            assert isinstance(out[side][key], typ), (side, key)
        assert out[side]["step_time_s"]["n"] == 2  # pairs * pair_steps
        assert out[side]["peak_memory_bytes"] is None  # --memory_estimate=False
    assert out["a"]["config"]["depth"] == 2 and out["b"]["config"]["depth"] == 1
    assert out["a"]["config"]["prefetch"] == 0 and out["b"]["config"]["prefetch"] == 1  # CPU default: off
    assert (out["a"]["flops_per_token"], out["b"]["flops_per_token"]) == (FLOPS_PER_TOKEN[2], FLOPS_PER_TOKEN_D1_SMEAR)
    assert (out["a"]["model"]["num_params"], out["b"]["model"]["num_params"]) == (NUM_PARAMS[2], NUM_PARAMS_D1_SMEAR)
    vs = out["vs"]
    assert len(vs["ratios"]) == 2 and all(x > 0 for x in vs["ratios"])
    assert vs["median_ratio"] == pytest.approx(sorted(vs["ratios"])[0] / 2 + sorted(vs["ratios"])[1] / 2)


def script_defaults(name):
    """The module-level `name = <literal>` settings of scripts/<name>, read with ast (nothing is run)."""
    out = {}
    for node in ast.parse((SCRIPTS / name).read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            with contextlib.suppress(ValueError):
                out[node.targets[0].id] = ast.literal_eval(node.value)
    return out


def test_bench_times_the_model_and_optimizers_base_train_trains():
    """
    Every setting bench.py shares with base_train has base_train's default, except the benchmark's own smaller
    config (depth, max_seq_len, batch sizes), compile (None in base_train means on for CUDA only; bench's False is
    that on CPU) and activation_checkpointing ("" in base_train means auto on CUDA with a discovered batch, else
    none; bench times one given policy, "none" by default). Fails on a default changed in base_train (say its AdamW weight decay, or value embeddings turned
    off) but left behind in bench.py, which would then time a step base_train no longer runs, and on a model or
    optimizer option missing from bench.py (it could not be timed on and off with --vs).
    """
    bench, base = script_defaults("bench.py"), script_defaults("base_train.py")
    options = {"value_embeds", "smear", "backout", "x0_lambdas", "rotary_base", "qk_scale", "window_pattern",
               "short_window", "weight_decay",
               "embedding_beta2", "unembedding_beta2", "muon_weight_decay", "polar_express", "muon_beta2", "ns_dtype",
               "dtype", "row_packing", "activation_checkpointing", "fp8", "fp8_recipe", "fp8_emulate"}
    assert options <= set(bench) & set(base)
    own = {"depth", "max_seq_len", "device_batch_size", "total_batch_size", "compile", "activation_checkpointing"}
    assert bench["activation_checkpointing"] == "none" and base["activation_checkpointing"] == ""
    assert {k: bench[k] for k in set(bench) & set(base) - own} == {k: base[k] for k in set(bench) & set(base) - own}


@pytest.mark.smoke
@pytest.mark.parametrize("args, fragment", [
    (["--vs=--depht=3"], "--vs"),
    (["--total_batch_size=500"], "--total_batch_size=500"),
    (["--adamw=fast"], "--adamw"),
    (["--profile=True", "--vs=--depth=1"], "--profile"),
    (["--fp8=True"], "--fp8=True"),  # a CPU without --fp8_emulate
])
def test_bench_bad_settings_one_line_error(base_dir, args, fragment):
    """Bad settings exit 2 with one `error:` line naming the flag (no traceback)."""
    r = run_script("bench.py", *TINY, *args, base_dir=base_dir)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines()[-1].startswith("error: ") and fragment in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.smoke
def test_bench_without_tokenizer_names_tok_train(tmp_path):
    """Without a tokenizer the error names scripts/tok_train.py."""
    r = run_script("bench.py", *TINY, base_dir=tmp_path)
    assert r.returncode == 2 and "tok_train.py" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.bench
def test_bench_reference_config(base_dir):
    """The issue's reference configuration (depth 4, 256 tokens, 8 x 256 rows, 4,096 tokens per step, fp32)."""
    r = run_script("bench.py", "--depth=4", "--max_seq_len=256", "--device_batch_size=8", "--total_batch_size=4096",
                   "--dtype=float32", "--steps=10", base_dir=base_dir, timeout=900)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    check_result(out, 10, depth=4, tokens=4096)
    print(json.dumps({k: out[k] for k in ("tokens_per_sec", "mfu", "peak_flops", "loader_vs_trainer")}))
