"""
runs/gpu_check.sh --dry-run through the command line, as the GPU machine runs it: with `datasets`, `wandb` and
`flash_attn` missing (the device image lacks them; a sitecustomize.py on PYTHONPATH makes their import fail and logs
every attempt), gpu_check.json's keys, its numbers, the exit code, and its one-line errors.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ["env", "tokenizer", "gpu_tests", "d12_eager", "plan", "d20_auto", "d12_compiled", "d12_auto", "d12_rows8",
         "tiny_train", "sample", "chat_eval"]
STEP_KEYS = {"ok", "rc", "seconds", "timed_out", "cmd", "error"}
HIDDEN = ("datasets", "wandb", "flash_attn")
SITECUSTOMIZE = f'''
import os, sys
class _Missing:  # the device image lacks these: their import fails, and each attempt is logged
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HIDDEN!r}:
            with open(os.environ["GPU_CHECK_IMPORT_LOG"], "a") as f:
                f.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
sys.meta_path.insert(0, _Missing())
'''

pytestmark = pytest.mark.smoke


def dry_run(tmp_path, *args, timeout=420):
    """Runs bash runs/gpu_check.sh --dry-run --out=<tmp>/out *args with the modules hidden. Returns (process, json or
    None, the modules whose import was attempted)."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(SITECUSTOMIZE)
    imports = tmp_path / "imports.log"
    imports.touch()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), REPO]), GPU_CHECK_IMPORT_LOG=str(imports),
               OMP_NUM_THREADS="1", NANOTRAIN_BASE_DIR=str(tmp_path / "user_base"), PYTHON=sys.executable)
    out = tmp_path / "out"
    p = subprocess.run(["bash", os.path.join(REPO, "runs", "gpu_check.sh"), "--dry-run", f"--out={out}", *args],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    result = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else None
    return p, result, set(imports.read_text().split())


def check_common(p, result, attempted):
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(result["steps"]) == sorted(STEPS)  # every key in every run (skipped steps included)
    for name, s in result["steps"].items():
        assert STEP_KEYS <= set(s), name
        assert s["ok"], (name, s["error"])
    assert result["ok"] and result["dry_run"] is True and result["targets"] == {}
    assert {"datasets", "wandb"}.isdisjoint(attempted), f"imported on the check's path: {attempted}"
    env = result["steps"]["env"]
    assert env["cuda_available"] is False and env["bf16_peak_flops"] > 0 and env["torch"]
    assert set(env["packages"]) == {"triton", "flash_attn", "rustbpe", "datasets", "wandb"}
    d20 = result["steps"]["d20_auto"]
    assert d20["device_batch_size"] in d20["candidates"] and d20["steps"] == 3
    assert d20["device_batch_size"] * d20["grad_accum_steps"] * 64 == 16 * 64  # T=64, 1,024 tokens per step
    assert d20["probe_peak_bytes_at_found"] <= d20["limit_bytes"] == int(0.85 * 0.25 * 2 ** 30)
    assert d20["training_oom_count"] == 0 and d20["step_downs"] == [] and d20["discovery_oom_probes"] == 0
    assert d20["tokens_per_sec"] > 0 and 0 < d20["mfu"] < 1
    plan = result["steps"]["plan"]
    assert plan["device_batch_size"] in d20["candidates"] and plan["device_memory_gb"] == 0.25
    assert result["steps"]["tokenizer"]["vocab_size"] == 512
    assert os.path.getsize(os.path.join(result["out"], "gpu_check.log")) > 0


def test_dry_run_short(tmp_path):
    """
    The default tier's dry run: env, the tokenizer, depth 2 with the automatic batch size through torchrun (3 steps),
    plan mode; the other steps are listed as skipped ("not in --only"). Catches the check's parsing drifting from
    base_train's auto_batch_size.json / metrics.jsonl or plan mode's output, a lost JSON key, a module-level import
    of datasets or wandb anywhere on the path, and a wrong exit code.
    """
    p, result, attempted = dry_run(tmp_path, "--only=tokenizer,d20_auto,plan")
    check_common(p, result, attempted)
    assert result["steps"]["gpu_tests"]["skipped"] == "not in --only"
    assert "gpu_check: all steps passed" in p.stdout


@pytest.mark.slow  # the default tier keeps test_dry_run_short (same script, the steps that parse base_train and plan)
def test_dry_run_full(tmp_path):
    """
    The whole dry run, every step: the gpu tier collected (all skipped without CUDA), bench's JSON read, a tiny model
    through sample and chat_eval with the calculator tool on. Catches a step whose script or flags changed under it.
    """
    p, result, attempted = dry_run(tmp_path)
    check_common(p, result, attempted)
    steps = result["steps"]
    tests = steps["gpu_tests"]
    assert tests["failed"] == tests["errors"] == 0 and tests["skipped"] >= 10 and tests["passed"] == 0
    assert steps["d12_eager"]["tokens_per_sec"] > 0 and steps["d12_eager"]["mfu"] > 0
    assert steps["d12_compiled"]["skipped"].startswith("dry run")
    assert steps["d12_auto"]["device_batch_size"] >= 1 and steps["d12_rows8"]["device_batch_size"] is None
    assert result["d12_auto_vs_rows8"]["tokens_per_sec_ratio"] > 0
    assert steps["sample"]["text"]
    assert steps["chat_eval"]["results"]["arith"]["total"] == 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the full check would run")
def test_errors_are_one_line(tmp_path):
    """--out naming a file, and the full (non-dry) check on a machine without CUDA, are one error line, exit 2, and the
    second still leaves gpu_check.json saying why. Catches a traceback or a silent CPU run of the full-size check."""
    (tmp_path / "f").write_text("")
    env = dict(os.environ, PYTHONPATH=REPO, NANOTRAIN_BASE_DIR=str(tmp_path / "b"), PYTHON=sys.executable)
    script = os.path.join(REPO, "runs", "gpu_check.sh")
    p = subprocess.run(["bash", script, f"--out={tmp_path / 'f'}"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1] == (
        f"error: --out={tmp_path / 'f'}: {tmp_path / 'f'} is a file, expected a directory (or a path that does not "
        f"exist)")
    p = subprocess.run(["bash", script, f"--out={tmp_path / 'o'}", "--only=tokenizer"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().splitlines()[-1].startswith("error: no CUDA device here"), p.stderr
    saved = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert saved["ok"] is False and saved["steps"]["env"]["error"].startswith("no CUDA device")


def test_a_spent_budget_records_every_step_and_exits_1(tmp_path):
    """With --budget_s=4 no step can start (each needs 5 s left): every step is still in gpu_check.json, marked not
    run with the reason, the dry run's skipped compile stays ok, and the exit code is 1. Catches a check that stops
    at the first failed step (later keys missing) or exits 0 with steps not run."""
    env = dict(os.environ, PYTHONPATH=REPO, NANOTRAIN_BASE_DIR=str(tmp_path / "b"), PYTHON=sys.executable)
    p = subprocess.run(["bash", os.path.join(REPO, "runs", "gpu_check.sh"), "--dry-run", "--budget_s=4",
                        f"--out={tmp_path / 'o'}"], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    saved = json.loads((tmp_path / "o" / "gpu_check.json").read_text())
    assert sorted(saved["steps"]) == sorted(STEPS) and saved["ok"] is False
    for name, step in saved["steps"].items():
        if name == "d12_compiled":
            assert step["ok"] and step["skipped"].startswith("dry run")
        else:
            assert not step["ok"] and step["error"] == "not run: the budget of 4 s is spent", name
    assert "FAILED: env, tokenizer, gpu_tests" in p.stdout
