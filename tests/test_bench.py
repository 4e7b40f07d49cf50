"""scripts/bench.py through the command line: the JSON it prints (keys, types, positive numbers) and its errors."""

import json

import pytest
import torch
from conftest import run_script

from nanotrain.muon import ns_dtype_for

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


def check_result(r, steps):
    """Schema of one configuration's result; catches a missing field, a string where a number belongs, or a zero."""
    for key, typ in RESULT_KEYS.items():
        assert isinstance(r[key], typ), (key, r.get(key))
    for key in POSITIVE:
        assert r[key] > 0, key
    st = r["step_time_s"]
    assert set(st) == {"median", "min", "max", "p10", "p90", "n"} and st["n"] == steps
    assert 0 < st["min"] <= st["p10"] <= st["median"] <= st["p90"] <= st["max"]
    assert r["tokens_per_sec"] == pytest.approx(r["tokens_per_step"] / st["median"])
    assert r["achieved_flops"] == pytest.approx(r["flops_per_token"] * r["tokens_per_sec"])
    assert r["mfu"] == pytest.approx(r["achieved_flops"] / r["peak_flops"])
    assert r["peak_flops"] == max(r["peak_flops_samples"])
    assert r["model"]["num_params"] > 0 and r["compile_s"] is None  # compile is off in these runs


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
    check_result(out, 2)
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
def test_bench_vs_interleaves_two_configs(base_dir):
    """--vs: both configurations' results, one ratio per round, their median; B differs from A only as asked."""
    r = run_script("bench.py", *TINY, "--warmup_steps=1", "--pairs=2", "--pair_steps=1", "--memory_estimate=False",
                   "--vs=--depth=1 --prefetch=1", base_dir=base_dir)
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
    assert out["b"]["flops_per_token"] < out["a"]["flops_per_token"]
    vs = out["vs"]
    assert len(vs["ratios"]) == 2 and all(x > 0 for x in vs["ratios"])
    assert vs["median_ratio"] == pytest.approx(sorted(vs["ratios"])[0] / 2 + sorted(vs["ratios"])[1] / 2)


@pytest.mark.smoke
@pytest.mark.parametrize("args, fragment", [
    (["--vs=--depht=3"], "--vs"),
    (["--total_batch_size=500"], "--total_batch_size=500"),
    (["--adamw=fast"], "--adamw"),
    (["--profile=True", "--vs=--depth=1"], "--profile"),
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
    check_result(out, 10)
    print(json.dumps({k: out[k] for k in ("tokens_per_sec", "mfu", "peak_flops", "loader_vs_trainer")}))
