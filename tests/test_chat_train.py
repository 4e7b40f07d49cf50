"""
mid_train and chat_sft through the command line on a tiny base model (depth 2): training, loss, checkpoints that
reload, exact resume, 2 gloo processes, and the JSONL error paths.
"""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from helpers import REPO, TINY_TRAIN, run_script, same, write_benchmark_copy

pytestmark = pytest.mark.smoke

TASKS = "arith:0.3,spell:0.3,identity:0.5"  # ~2,000 training conversations: quick to load
# fp32 (the CPU default is bf16 where its matmuls are fast): the reloaded model is evaluated in fp32 and compared at 1e-5
MID = ["--max_seq_len=128", "--eval_tokens=1024", "--keep_last=0", f"--tasks={TASKS}",
       "--dtype=float32"]
SFT = ["--dtype=float32", "--examples_per_step=8", "--max_tokens_per_device=256", "--eval_examples=32",
       "--keep_last=0", "--init_lr_frac=0.5", f"--tasks={TASKS}"]
GOOD = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}


@pytest.fixture(scope="module")
def chat_base(shared_base_dir, tmp_path_factory):
    """A base dir with the shared corpus and tokenizer and a 3-step tiny base model (run "tiny")."""
    base = tmp_path_factory.mktemp("chat_base")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=3", "--run_name=tiny", base_dir=base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base


def write_jsonl(path, bad_line=None, n=40):
    """n good conversations, with `bad_line` (text) as line 3 if given."""
    lines = [json.dumps(GOOD)] * n
    if bad_line is not None:
        lines.insert(2, bad_line)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def losses(base, stage, run):
    with open(os.path.join(base, stage, run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}, rows


def resume_from(base, stage, run, step, script, args):
    """Deletes the checkpoints after `step`, resumes, and returns the completed process."""
    ckpts = os.path.join(base, stage, run, "checkpoints")
    for name in os.listdir(ckpts):
        if int(name[5:]) > step:
            shutil.rmtree(os.path.join(ckpts, name))
    return run_script(script, *args, "--resume=True", base_dir=base)


def rng_at(base, stage, run, step):
    """The RNG states rank 0 saved in the run's checkpoint of `step`."""
    path = os.path.join(base, stage, run, "checkpoints", f"step_{step:06d}", "rank_00000.pt")
    return torch.load(path, weights_only=True)["rng"]


def test_mid_then_sft_train_reload_and_resume(chat_base, tmp_path, monkeypatch):
    """
    mid_train then chat_sft in one process: exit 0, the loss falls, the SFT checkpoint reloads into a model whose
    token-weighted val loss equals the logged one, skipped JSONL lines are counted, and --resume=True (mid: from its
    middle checkpoint; SFT: after a SIGTERM at an arbitrary step) repeats the remaining steps' losses exactly (==)
    and saves at step 16 the Python, NumPy and torch RNG states the straight run saved.
    Catches a resume that restarts the data (token stream or sampler), drops the optimizer state, repeats or skips
    a step, a checkpoint that does not hold the trained weights, and mid_train's RNG states restored before the
    set-up that draws from them (the CPU MFU probe). (chat_sft's old order, restored then re-seeded, also saved equal
    states here: its training draws nothing from these generators, so the set-up's state is the same either way.)
    """
    mid_args = [*MID, "--run_name=m1", "--num_iterations=16", "--eval_every=8", "--save_every=8"]
    r = run_script("mid_train.py", *mid_args, base_dir=chat_base)
    assert r.returncode == 0, r.stderr[-3000:]
    straight, _ = losses(chat_base, "mid", "m1")
    assert sorted(straight) == list(range(1, 17))
    assert sum(straight[s] for s in (14, 15, 16)) / 3 < 0.7 * straight[1], straight
    straight_rng = rng_at(chat_base, "mid", "m1", 16)
    r = resume_from(chat_base, "mid", "m1", 8, "mid_train.py", mid_args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 00009/00016" in r.stdout and "step 00008/00016 (" not in r.stdout
    resumed, _ = losses(chat_base, "mid", "m1")
    assert resumed == straight
    assert same(rng_at(chat_base, "mid", "m1", 16), straight_rng)

    jsonl = write_jsonl(tmp_path / "chat.jsonl", bad_line='{"messages": [{"role": "user", "content": "no reply"}]}')
    sft_args = [*SFT, "--source_run_name=m1", "--run_name=s1", "--num_iterations=16", "--eval_every=8",
                "--save_every=8", f"--jsonl={jsonl}", "--skip_bad_rows=True"]
    r = run_script("chat_sft.py", *sft_args, base_dir=chat_base)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "skipped 1 bad rows" in r.stdout and "Source: " in r.stdout and "mid/m1" in r.stdout
    straight, rows = losses(chat_base, "sft", "s1")
    assert sorted(straight) == list(range(1, 17))
    assert sum(straight[s] for s in (14, 15, 16)) / 3 < 0.9 * sum(straight[s] for s in (1, 2, 3)) / 3, straight
    val = [row["val_loss"] for row in rows if "val_loss" in row]
    assert len(val) == 3 and val[-1] < val[0]

    # the checkpoint reloads and gives the logged val loss (same data, same token weighting)
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(chat_base))
    from nanotrain.checkpoint import load_model
    from nanotrain.sft_data import evaluate_loss, fit_conversation, lpt_pack, micro_batch
    from nanotrain.tasks.registry import load_task_mixture
    model, tokenizer, path, meta = load_model("sft", "s1")
    assert path.endswith("step_000016") and meta["config"]["run_name"] == "s1"
    convs = load_task_mixture(f"{TASKS},jsonl:{jsonl}", "val", 42, skip_bad_rows=True)[:32]
    examples = [fit_conversation(*tokenizer.render_conversation(c, 2**62), 128)[:2] for c in convs]
    plan = lpt_pack([len(ids) for ids, _ in examples], 256, 1, 32)
    loss = evaluate_loss(model, [micro_batch([examples[i] for i in mb[0]], True, 0) for mb in plan])
    assert abs(loss - val[-1]) <= 1e-5 * val[-1], (loss, val[-1])

    assert torch.equal(torch.load(os.path.join(path, "model.pt"), weights_only=True)["lm_head.weight"],
                       model.lm_head.weight)

    # SIGTERM mid-run: a checkpoint at that step and exit 0; --resume=True then repeats the straight run's losses
    cut_args = [a.replace("--run_name=s1", "--run_name=s1cut") for a in sft_args]
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(chat_base), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", "chat_sft.py"), *cut_args],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    out = []
    for line in p.stdout:
        out.append(line)
        if line.startswith("step 00005/"):
            p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=120) == 0, "".join(out)[-3000:]
    stopped = int("".join(out).split("Stopped at step ")[1].split()[0])
    assert 5 <= stopped < 16
    r = run_script("chat_sft.py", *cut_args, "--resume=True", base_dir=chat_base)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"step {stopped + 1:05d}/00016" in r.stdout and f"step {stopped:05d}/00016 (" not in r.stdout
    resumed, _ = losses(chat_base, "sft", "s1cut")
    assert resumed == straight
    assert same(rng_at(chat_base, "sft", "s1cut", 16), rng_at(chat_base, "sft", "s1", 16))


@pytest.mark.dist
@pytest.mark.slow  # 2-rank mid_train and chat_sft runs are in the default run: test_smoke_matrix.py's 2-rank cells
@pytest.mark.timeout(300)
def test_mid_and_sft_two_gloo_processes(chat_base):
    """2 ranks on gloo: both scripts exit 0 with identical parameters on the ranks (checksum all-gathered), the loss
    falls, and each writes one checkpoint with a rank file per process. Catches a rank that runs a different number of
    micro-batches (a hang), or replicas drifting apart."""
    r = run_script("mid_train.py", *MID, "--run_name=m2", "--num_iterations=8", "--eval_every=-1",
                   "--total_batch_size=1024", base_dir=chat_base, nproc=2)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "parameters identical on all 2 ranks" in r.stdout and "gradient accumulation steps: 1" in r.stdout
    mid, _ = losses(chat_base, "mid", "m2")
    assert mid[8] < 0.8 * mid[1], mid
    r = run_script("chat_sft.py", *SFT, "--source_run_name=m2", "--run_name=s2", "--num_iterations=12",
                   "--eval_every=12", "--max_tokens_per_device=128", base_dir=chat_base, nproc=2)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    assert "parameters identical on all 2 ranks" in r.stdout
    sft, rows = losses(chat_base, "sft", "s2")
    assert sorted(sft) == list(range(1, 13))
    assert all(row["micro_batches"] >= 2 for row in rows if "loss" in row)  # accumulation on both ranks
    val = [row["val_loss"] for row in rows if "val_loss" in row]
    assert len(val) == 2 and val[1] < val[0]  # the same held-out conversations before and after
    files = sorted(os.listdir(os.path.join(chat_base, "sft", "s2", "checkpoints", "step_000012")))
    assert files == ["meta.json", "model.pt", "optim.pt", "rank_00000.pt", "rank_00001.pt"]


def test_malformed_jsonl_stops_with_file_and_line(chat_base, tmp_path):
    """A malformed JSONL line stops chat_sft with one `error: file:line: ...` line (besides the configurator's
    "Overriding:" echo) and a non-zero exit."""
    jsonl = write_jsonl(tmp_path / "bad.jsonl", bad_line="{not json")
    r = run_script("chat_sft.py", *SFT, "--source=base", "--num_iterations=2", f"--jsonl={jsonl}",
                   base_dir=chat_base)
    assert r.returncode != 0
    err = [line for line in r.stderr.strip().splitlines() if not line.startswith("Overriding: ")]
    assert len(err) == 1 and err[0].startswith(f"error: {jsonl}:3: "), r.stderr[-2000:]


@pytest.mark.slow  # the default run keeps the ChatCORE arithmetic and the scoring (tests/test_benchmarks.py)
def test_sft_in_loop_chatcore_equals_chat_eval(chat_base, tmp_path):
    """
    chat_sft --chatcore_every=1 logs ChatCORE and the five accuracies at steps 0, 1 and 2 (the end), on every rank's
    share of the problems; the last row equals scripts/chat_eval.py --tasks=chatcore on the final checkpoint with the
    same problems. Catches the in-loop evaluation scoring another model state (e.g. in train mode or before the last
    update) or other problems than chat_eval's.
    """
    data = write_benchmark_copy(tmp_path / "bench")
    r = run_script("chat_sft.py", *SFT, "--source=base", "--num_iterations=2", "--run_name=cc", "--eval_every=-1",
                   "--chatcore_every=1", "--chatcore_max_problems=2", f"--chatcore_data={data}", base_dir=chat_base)
    assert r.returncode == 0, r.stderr[-3000:]
    _, rows = losses(chat_base, "sft", "cc")
    cc = [row for row in rows if "chatcore" in row]
    assert [row["step"] for row in cc] == [0, 1, 2] and "ChatCORE" in r.stdout
    e = run_script("chat_eval.py", "--run_name=cc", "--tasks=chatcore", "--max_problems=2", f"--data={data}",
                   base_dir=chat_base)
    assert e.returncode == 0, e.stderr[-3000:]
    saved = json.load(open(os.path.join(chat_base, "sft", "cc", "chat_eval.json")))
    assert saved["chatcore"] == cc[-1]["chatcore"]
    assert {n: saved["results"][n]["accuracy"] for n in saved["results"]} == \
        {k[len("chatcore_"):]: v for k, v in cc[-1].items() if k.startswith("chatcore_")}
