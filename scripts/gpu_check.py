"""
The GPU check: on a fresh CUDA machine, in minutes and offline, does every CUDA path of nanotrain work, and how fast.
Run it through runs/gpu_check.sh (which sets PYTHONPATH and installs rustbpe from .whl/ when missing):

    bash runs/gpu_check.sh                      # one CUDA device: ~9 minutes, writes <base_dir>/gpu_check/<time>/
    bash runs/gpu_check.sh --out=/tmp/gc        # the folder for gpu_check.json, gpu_check.log, gpu_tests.xml
    bash runs/gpu_check.sh --runs_dir=/tmp/nt   # the steps' runs (GBs of checkpoints) elsewhere than <out>/base
    bash runs/gpu_check.sh --dry-run            # the same steps on CPU at tiny sizes (what the default test tier runs)

Each step is a subprocess with its own timeout (never more than what is left of --budget_s); a failed or timed-out
step is recorded and the next one runs; a step's whole process tree is ended when it times out or leaves processes
behind (every process it starts carries GPU_CHECK_STEP=<a fresh id> in its environment, found through /proc, so
torchrun's workers in sessions of their own go too). The stage scripts are used only through their command-line
flags, with NANOTRAIN_BASE_DIR=<runs_dir>, so the check never touches the user's runs. Three passes, so that a call
cut short still has what finished (gpu_check.json and gpu_check.log are rewritten after every step):

  pass A: does it work at all
  env           torch, CUDA, the card, its memory, the bf16 peak FLOP/s that MFU divides by, optional packages
  tokenizer     the builtin corpus and a BPE tokenizer (scripts/tok_train.py; --vocab_size, 512 in a dry run)
  gpu_tests     pytest -m "gpu or multigpu" (each CUDA path has a test naming it; all skip without CUDA)
  d12_eager     scripts/bench.py --depth=12 --max_seq_len=2048 eager: tokens/s, MFU, peak memory
  pass B: the headline
  plan          scripts/auto_batch_plan.py for the depth-20 model, total batch and this card: the predicted batch
  d20_auto      torchrun --nproc_per_node=1 scripts/base_train.py --depth=20 --auto_batch_size=True, compiled on CUDA,
                --activation_checkpointing=none (base_train's CUDA default, auto, would probe a second policy past
                D20_CAP_S), --d20_steps steps after discovery: the device batch found, the probes (real CUDA OOMs among them), the
                peak against the limit, step-downs (OOMs during training), tokens/s and MFU (median after step 1),
                and the device's peak used memory polled with nvidia-smi
  pass C: with the time left
  d12_compiled  bench.py at depth 12 with --compile=True (dry run: skipped, torch.compile on CPU takes minutes)
  d12_auto      base_train at depth 12, eager, --auto_batch_size=True: the size found, tokens/s
  d12_rows8     the same at --device_batch_size=8 (same total batch): d12_auto_vs_rows8 is the tokens/s ratio
  tiny_train    a depth-2 model (not compiled) for the chat steps
  sample        scripts/sample.py on it (KV cache)
  chat_eval     scripts/chat_eval.py --source=base --tasks=arith, the calculator tool on

gpu_check.json (rewritten after every step): dry_run, commit, started, seconds, ok (every step ok), out, steps
{name: {ok, rc, seconds, timed_out, cmd, error, ...parsed numbers}} and targets (the issue's H100 targets; empty in a
dry run). Exit code 0 when every step passed, 1 otherwise.
"""

import contextlib
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree's package, uninstalled

from nanotrain.common import atomic_write_json, get_base_dir, run_script
from nanotrain.configurator import configure  # noqa: E402
from nanotrain.errors import UserError

# ----------------------------------------------------------------------------- settings
dry_run = False  # the same steps on CPU at tiny sizes (seconds each)
out = ""  # folder for gpu_check.json, gpu_check.log and gpu_tests.xml; "" means <base_dir>/gpu_check/<UTC time>
runs_dir = ""  # NANOTRAIN_BASE_DIR of the steps' runs (checkpoints: GBs); "" means <out>/base
budget_s = 530  # wall-clock seconds for the whole check; each step's timeout is cut to what is left
d20_steps = 30  # optimizer steps of the depth-20 run after the batch-size discovery (a dry run takes 3)
only = ""  # comma-separated names of the steps to run, e.g. tokenizer,d20_auto,plan ("" all; env always runs)
vocab_size = 32768  # tokenizer vocabulary on CUDA (the builtin corpus stops merging near 33k)
env_only = False  # internal: print the environment as JSON and exit (a subprocess: this process never starts CUDA)
config = configure(globals())
# -----------------------------------------------------------------------------

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1024 ** 3
T_BIG = 2048  # nanochat's reference max_seq_len
D20_TOTAL = 64 * T_BIG  # tokens per step of the depth-20 run: candidates 1..64 rows, so 32 (the target) is one
STEPS = ("env", "tokenizer", "gpu_tests", "d12_eager",  # pass A: does it work at all
         "plan", "d20_auto",  # pass B: the headline
         "d12_compiled", "d12_auto", "d12_rows8", "tiny_train", "sample", "chat_eval")  # pass C: with the time left
D20_CAP_S = 300  # the depth-20 step's timeout: compiled probes, 30 steps, a 9 GB checkpoint (see dev/LOG.md)
D12_ROWS = 32  # device batch of the depth-12 benchmark (about half of an 80 GB card's memory in plan mode)


def env_info():
    """The environment as a JSON-able dict (this step runs in its own process: it starts CUDA)."""
    import importlib.metadata
    import platform

    import torch

    from nanotrain.common import get_peak_flops, git_commit
    def version(name):  # the installed distribution's version (from its metadata: nothing is imported), or None
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    peak, source = get_peak_flops(device, torch.bfloat16)
    props = torch.cuda.get_device_properties(device) if cuda else None
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": cuda, "device_count": torch.cuda.device_count() if cuda else 0,
            "device_name": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
            "total_memory_bytes": props.total_memory if cuda else None,
            "capability": list(torch.cuda.get_device_capability(device)) if cuda else None,
            "bf16_peak_flops": peak, "bf16_peak_source": source,
            "commit": git_commit() if git_commit() != "unknown" else os.environ.get("GPU_CHECK_COMMIT", "unknown"),
            "packages": {name: version(name) for name in ("triton", "flash_attn", "rustbpe", "datasets", "wandb")},
            "rustbpe_from": os.environ.get("GPU_CHECK_RUSTBPE", "installed")}


def gpu_used_bytes():
    """Memory in use on GPU 0 by every process, in bytes (nvidia-smi), or None where there is none."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                           capture_output=True, text=True, timeout=5)
        return int(r.stdout.split()[0]) * 1024 ** 2 if r.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def marked_pids(marker):
    """PIDs of the processes whose environment holds GPU_CHECK_STEP=<marker> (Linux /proc; [] elsewhere). A step's
    processes inherit it, whatever process session or group they moved to (torchrun's workers, daemons)."""
    needle = f"GPU_CHECK_STEP={marker}".encode()
    pids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:  # gone, or not ours to read
                pass
    return pids


def kill_step(p, marker):
    """Ends a step's whole process tree: its process group, then every process carrying its marker (workers in other
    process sessions included), until none is left (at most 10 s). Returns the PIDs killed by marker."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)
    killed, deadline = set(), time.time() + 10
    while time.time() < deadline:
        pids = marked_pids(marker)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
        time.sleep(0.1)
    p.wait()
    return sorted(killed)


class Check:
    """The steps' runner: the log, the JSON, the budget."""

    def __init__(self, out_dir, base):
        self.out, self.t0 = out_dir, time.time()
        self.base = base
        self.log_path = os.path.join(out_dir, "gpu_check.log")
        self.result = {"dry_run": dry_run, "commit": None, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "seconds": 0.0, "ok": False, "out": out_dir, "steps": {}, "targets": {}}

    def save(self):
        self.result["seconds"] = round(time.time() - self.t0, 1)
        self.result["ok"] = all(s["ok"] for s in self.result["steps"].values())
        atomic_write_json(os.path.join(self.out, "gpu_check.json"), self.result)

    def run(self, name, cmd, timeout, parse=None, poll_gpu=False):
        """Runs cmd (a list) for at most min(timeout, budget left) seconds, logs it, records {ok, rc, seconds,
        timed_out, cmd, error} plus parse(output) (a dict; an exception in it fails the step). Returns the record."""
        if only and name != "env" and name not in only.split(","):
            return self.skip(name, "not in --only")
        left = budget_s - (time.time() - self.t0)
        rec = {"ok": False, "rc": None, "seconds": 0.0, "timed_out": False, "cmd": shlex.join(cmd), "error": None}
        self.result["steps"][name] = rec
        if left < 5:
            rec["error"] = f"not run: the budget of {budget_s} s is spent"
            self.save()
            return rec
        marker = uuid.uuid4().hex
        env = dict(os.environ, NANOTRAIN_BASE_DIR=self.base, PYTHONUNBUFFERED="1", GPU_CHECK_STEP=marker,
                   PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        peak_used, stop = [None], threading.Event()

        def poll():  # the device's used memory every half second while the step runs
            while not stop.wait(0.5):
                used = gpu_used_bytes()
                if used is not None:
                    peak_used[0] = max(peak_used[0] or 0, used)
        poller = threading.Thread(target=poll, daemon=True) if poll_gpu and not dry_run else None
        if poller:
            poller.start()
        t = time.time()
        limit = min(timeout, left)
        with open(self.log_path, "ab") as log:  # the step writes straight into the log (readable while it runs)
            log.write(f"\n===== {name} | {rec['cmd']} | timeout {limit:.0f}s\n".encode())
            log.flush()
            start = log.tell()
            p = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rec["rc"] = p.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rec["timed_out"] = True
            finally:  # a timeout or Ctrl-C: its whole tree goes (torchrun's workers sit in sessions of their own)
                if p.returncode is None or marked_pids(marker):
                    rec["killed_pids"] = kill_step(p, marker)
        with open(self.log_path, "rb") as f:
            f.seek(start)
            output = f.read().decode("utf-8", "replace")
        if poller:
            stop.set()
            poller.join()
            rec["peak_device_used_bytes"] = peak_used[0]
        rec["seconds"] = round(time.time() - t, 1)
        lines = [ln for ln in output.splitlines() if ln.strip()]
        if rec["timed_out"]:
            rec["error"] = f"timed out after {limit:.0f} s"
        elif rec["rc"] != 0:
            errs = [ln for ln in lines if ln.startswith("error:") or "Error" in ln]
            rec["error"] = (errs or lines or ["(no output)"])[-1][-500:]
        else:
            try:
                rec.update(parse(output) if parse else {})
                rec["ok"] = True
            except Exception as exc:  # noqa: BLE001 - a parse failure is this step's failure, recorded
                rec["error"] = f"could not read the step's results: {type(exc).__name__}: {exc}"
        print(f"gpu_check: {name}: {'ok' if rec['ok'] else 'FAILED'} in {rec['seconds']} s"
              + (f" | {rec['error']}" if rec["error"] else ""), flush=True)
        self.save()
        return rec

    def skip(self, name, why):
        self.result["steps"][name] = {"ok": True, "rc": None, "seconds": 0.0, "timed_out": False, "cmd": None,
                                      "error": None, "skipped": why}
        print(f"gpu_check: {name}: skipped ({why})", flush=True)
        self.save()
        return self.result["steps"][name]


def last_json(output):
    """The last top-level JSON object printed in output (bench.py pretty-prints one)."""
    start = output.rfind("\n{")
    return json.loads(output[start + 1 if start >= 0 else output.index("{"):])


def read_json(path):
    with open(path) as f:
        return json.load(f)


def parse_pytest(xml_path):
    """passed / failed / skipped / errors counts and the failing tests' ids, from pytest's JUnit XML."""
    import xml.etree.ElementTree as ET
    cases = ET.parse(xml_path).getroot().iter("testcase")
    counts, failures = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}, []
    for c in cases:
        kinds = {child.tag for child in c}
        kind = "failed" if "failure" in kinds else "errors" if "error" in kinds else (
            "skipped" if "skipped" in kinds else "passed")
        counts[kind] += 1
        if kind in ("failed", "errors"):
            failures.append(f"{c.get('classname')}::{c.get('name')}")
    return dict(counts, failing=failures)


def parse_d20(run_dir, output, steps_wanted):
    """The depth-20 run's record: discovery (auto_batch_size.json), step-downs, tokens/s and MFU (metrics.jsonl)."""
    ab = read_json(os.path.join(run_dir, "auto_batch_size.json"))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "tok_per_sec" in r]
    if len(rows) < steps_wanted:
        raise ValueError(f"{len(rows)} training steps logged, expected {steps_wanted}")
    steady = rows[1:]  # step 1 includes compilation and warm-up
    found = ab["device_batch_size"]
    at_found = [p for p in ab["probes"] if p["batch_size"] == found and p["result"] == "fits"]
    return {"device_batch_size": found, "grad_accum_steps": ab["grad_accum_steps"], "candidates": ab["candidates"],
            "measurement": ab["measurement"], "budget_bytes": ab["budget_bytes"], "limit_bytes": ab["limit_bytes"],
            "probe_peak_bytes_at_found": max((p["peak_bytes"] for p in at_found), default=None),
            "probes": [[p["batch_size"], p["phase"], p["result"], p["peak_bytes"], p["seconds"]] for p in ab["probes"]],
            "discovery_oom_probes": sum(p["result"] == "OOM" for p in ab["probes"]),
            "discovery_seconds": ab["seconds"], "step_downs": ab.get("step_downs", []),
            "training_oom_count": output.count("out of memory at device_batch_size="),
            "steps": len(rows), "first_step_s": rows[0]["dt"],
            "tokens_per_sec": statistics.median(r["tok_per_sec"] for r in steady),
            "mfu": median_mfu(steady), "final_loss": rows[-1]["loss"]}


def parse_train(run_dir, steps_wanted):
    """A base_train run's device batch (auto_batch_size.json where discovered) and median tokens/s and MFU after
    step 1 (metrics.jsonl)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "tok_per_sec" in r]
    if len(rows) < steps_wanted:
        raise ValueError(f"{len(rows)} training steps logged, expected {steps_wanted}")
    ab_path = os.path.join(run_dir, "auto_batch_size.json")
    found = read_json(ab_path)["device_batch_size"] if os.path.exists(ab_path) else None
    return {"device_batch_size": found, "tokens_per_sec": statistics.median(r["tok_per_sec"] for r in rows[1:]),
            "mfu": median_mfu(rows[1:])}


def median_mfu(rows):
    """The median MFU of metrics rows, None when the card's peak is unknown (rows log mfu None)."""
    return None if any(r["mfu"] is None for r in rows) else statistics.median(r["mfu"] for r in rows)


def parse_bench(output):
    b = last_json(output)
    return {k: b[k] for k in ("tokens_per_sec", "mfu", "peak_memory_bytes", "peak_memory_source", "compile_s",
                              "flops_per_token", "peak_flops", "dtype", "grad_accum_steps")}


def main():
    if env_only:
        print(json.dumps(env_info()))
        return
    unknown = [n for n in only.split(",") if n and n not in STEPS]
    if unknown:
        raise UserError(f"--only={only}: unknown step {unknown[0]!r}; expected names from {', '.join(STEPS)}")
    out_dir = os.path.abspath(out or os.path.join(get_base_dir(), "gpu_check", time.strftime("%Y%m%d-%H%M%S")))
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out={out}: {out_dir} is a file, expected a directory (or a path that does not exist)")
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.abspath(runs_dir) if runs_dir else os.path.join(out_dir, "base")
    chk = Check(out_dir, base)
    py = sys.executable
    script = lambda name: os.path.join(REPO, "scripts", name)  # noqa: E731
    print(f"gpu_check: {'DRY RUN on CPU, tiny sizes' if dry_run else 'CUDA'} | out {out_dir} | runs {base} | "
          f"budget {budget_s} s", flush=True)

    # ------------------------------------------------------------------------- pass A: does it work at all
    # env, tokenizer, the gpu test tier, depth 12 eager (dry: depth 2, T=64)
    env = chk.run("env", [py, script("gpu_check.py"), "--env_only=True"], 60, lambda o: json.loads(o.strip().splitlines()[-1]))
    chk.result["commit"] = env.get("commit")
    gpu = env.get("cuda_available", False) and not dry_run
    if not dry_run and not gpu:
        chk.result["steps"]["env"].update(ok=False, error="no CUDA device: run with --dry-run for the CPU check")
        chk.save()
        raise UserError(f"no CUDA device here (torch {env.get('torch')}): the full check needs one; "
                        f"--dry-run runs the same steps on CPU at tiny sizes ({out_dir}/gpu_check.json)")
    vocab = 512 if dry_run else vocab_size
    chk.run("tokenizer", [py, script("tok_train.py"), f"--vocab_size={vocab}"] + (["--max_chars=300000"] if dry_run
                                                                                 else []), 90,
            lambda o: {"vocab_size": int(re.search(r"^vocab size: (\d+)", o, re.M).group(1))})
    vocab = chk.result["steps"]["tokenizer"].get("vocab_size", vocab)
    xml = os.path.join(out_dir, "gpu_tests.xml")
    chk.run("gpu_tests", [py, "-m", "pytest", "-m", "gpu or multigpu", "-n", "0", "-q", "-p", "no:cacheprovider",
                          "--timeout=60", f"--junitxml={xml}", os.path.join(REPO, "tests")], 120,
            lambda o: parse_pytest(xml))
    depth, seq, total = (2, 64, 16 * 64) if dry_run else (20, T_BIG, D20_TOTAL)
    bench = ([f"--depth={depth}", f"--max_seq_len={seq}", "--device_batch_size=4", f"--total_batch_size={4 * seq}",
              "--warmup_steps=1", "--steps=2", "--memory_estimate=False"] if dry_run else
             ["--depth=12", f"--max_seq_len={T_BIG}", f"--device_batch_size={D12_ROWS}",
              f"--total_batch_size={D12_ROWS * T_BIG}", "--warmup_steps=3", "--steps=10"])
    bench += ["--loader_seconds=0.2", "--tokenizer_chars=20000"]
    chk.run("d12_eager", [py, script("bench.py"), *bench, "--compile=False"], 90, parse_bench)

    # ------------------------------------------------------------------------- pass B: the headline
    # plan mode's prediction for depth 20 on this card, then depth 20 with the automatic batch size, compiled (on
    # CUDA), through torchrun (dry: depth 2, T=64, a 0.25 GiB budget)
    memory = ["--device_memory_gb=0.25"] if dry_run else []
    d20_iters = 3 if dry_run else d20_steps
    gb = (env.get("total_memory_bytes") or 0) / GiB if gpu else 0.25
    plan = chk.run("plan", [py, script("auto_batch_plan.py"), f"--depth={depth}", f"--max_seq_len={seq}",
                            f"--vocab_size={vocab}", f"--total_batch_size={total}", f"--device_memory_gb={gb:.4f}"], 90,
                   lambda o: {"device_batch_size": int(re.search(r"=> device_batch_size=(\d+)", o).group(1)),
                              "device_memory_gb": gb, "measured_with": "fake CUDA tensors" if "fake CUDA" in o
                              else "fake CPU tensors (bf16)"})
    run_dir = os.path.join(chk.base, "base", "gpu_check_d20")
    torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--local-addr=127.0.0.1", "--nproc_per_node=1"]
    chk.run("d20_auto", [*torchrun, script("base_train.py"),
                         f"--depth={depth}", f"--max_seq_len={seq}", f"--total_batch_size={total}",
                         "--auto_batch_size=True", "--batch_size_cache=False", f"--num_iterations={d20_iters}",
                         "--activation_checkpointing=none",  # as on 2026-11-28; auto would add a policy's probes
                         "--run_name=gpu_check_d20", "--eval_every=-1", f"--eval_tokens={total}", "--save_every=-1",
                         "--sample_every=-1", "--keep_last=1"] + memory, D20_CAP_S,
            lambda o: parse_d20(run_dir, o, d20_iters), poll_gpu=True)
    d20 = chk.result["steps"]["d20_auto"]

    # ------------------------------------------------------------------------- pass C: with the time left
    # depth 12 compiled; depth 12 at 8 rows against the size found (eager, same total batch); the chat steps
    if dry_run:
        chk.skip("d12_compiled", "dry run: torch.compile on CPU takes minutes (the CUDA run compiles)")
    else:
        chk.run("d12_compiled", [py, script("bench.py"), *bench, "--compile=True"], 150, parse_bench)
    d12 = (["--depth=2", "--max_seq_len=64", "--total_batch_size=1024", "--device_memory_gb=0.25", "--num_iterations=3"]
           if dry_run else ["--depth=12", f"--max_seq_len={T_BIG}", f"--total_batch_size={D20_TOTAL}",
                            "--num_iterations=8"])
    d12 += ["--compile=False", "--eval_every=-1", "--eval_tokens=1024", "--sample_every=-1", "--save_every=-1"]
    steps12 = 3 if dry_run else 8
    for name, rows in (("d12_auto", ["--auto_batch_size=True", "--batch_size_cache=False",
                                     "--activation_checkpointing=none"]),
                       ("d12_rows8", ["--device_batch_size=8"])):
        rd = os.path.join(chk.base, "base", f"gpu_check_{name}")
        chk.run(name, [py, script("base_train.py"), *d12, *rows, f"--run_name=gpu_check_{name}"], 90,
                lambda o, rd=rd: parse_train(rd, steps12))
    a, b = chk.result["steps"]["d12_auto"], chk.result["steps"]["d12_rows8"]
    if a.get("tokens_per_sec") and b.get("tokens_per_sec"):
        chk.result["d12_auto_vs_rows8"] = {"device_batch_size": [a.get("device_batch_size"), 8],
                                           "tokens_per_sec_ratio": round(a["tokens_per_sec"] / b["tokens_per_sec"], 3)}
    tiny = ["--depth=2", "--max_seq_len=128", "--device_batch_size=4", f"--total_batch_size={4 * 128}",
            f"--num_iterations={3 if dry_run else 20}", "--compile=False", "--run_name=gpu_check_tiny", "--eval_every=-1",
            "--eval_tokens=1024", "--sample_every=-1", "--save_every=-1"]
    chk.run("tiny_train", [py, script("base_train.py"), *tiny], 90)
    chk.run("sample", [py, script("sample.py"), "--stage=base", "--run_name=gpu_check_tiny", "--max_tokens=32"], 60,
            lambda o: {"text": o.strip().splitlines()[-1][:200]})
    chat_json = os.path.join(chk.base, "base", "gpu_check_tiny", "chat_eval.json")
    chk.run("chat_eval", [py, script("chat_eval.py"), "--source=base", "--run_name=gpu_check_tiny", "--tasks=arith",
                          "--max_problems=8", "--max_tokens=48", "--tool=True", "--batch_size=8"], 90,
            lambda o: {"results": read_json(chat_json)["results"]})

    if gpu:  # the targets for one H100 80 GB (informational: they do not change the exit code)
        d12c = chk.result["steps"].get("d12_compiled", {})
        chk.result["targets"] = {
            "gpu_tests_green": chk.result["steps"]["gpu_tests"]["ok"],
            "d20_device_batch_ge_32": (d20.get("device_batch_size") or 0) >= 32,
            "d20_zero_oom_after_discovery": d20.get("ok") and d20.get("training_oom_count") == 0,
            "d20_found_vs_plan": [d20.get("device_batch_size"), plan.get("device_batch_size")],
            "d20_mfu_ge_40pct": (d20.get("mfu") or 0) >= 0.40, "d12_mfu_ge_30pct": (d12c.get("mfu") or 0) >= 0.30}
    chk.save()
    failed = [n for n, s in chk.result["steps"].items() if not s["ok"]]
    print(f"gpu_check: {'all steps passed' if not failed else 'FAILED: ' + ', '.join(failed)} in "
          f"{chk.result['seconds']} s | {os.path.join(out_dir, 'gpu_check.json')}", flush=True)
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    run_script(main)
