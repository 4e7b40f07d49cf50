"""
The smoke matrix: {base_train, mid_train, chat_sft} x {1 rank, 2 ranks (torchrun --standalone, gloo)}
x {gradient accumulation 1, 2} x {fresh, resumed}, every cell through the command line on a tiny config (depth 2,
max_seq_len 64, 12 steps of 8 rows of 64 tokens, or of 8 conversations for chat_sft).

Every run of a cell happens once per module and is shared: the fresh run of (script, ranks, accumulation) saves a
checkpoint at step 6 and 12; its "resumed" cell copies that run directory, deletes the step-12 checkpoint (the later
metrics rows stay, as after a crash past the checkpoint) and continues it in a new process with --resume=True. A cut
by a smaller --num_iterations would change the lr schedule (the warmdown is a fraction of num_iterations), so the cut
is the fresh run's own checkpoint at step 6. mid_train starts from the fresh 1-rank, accumulation-1 base_train run
and chat_sft from the fresh 1-rank, accumulation-1 mid_train run (the pipeline, without extra runs). The runs start
in the order of the selected cells, PARALLEL at a time (single-process runs use one thread, so two fit the 2-core CI
machine; CPU fp32 results do not depend on what else runs, which the exact-resume comparisons check). Nearly all of
the time is process start-up (torch, gloo, the report card), not training.
"""

import json
import math
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import CPU_RECIPE, run_script

pytestmark = pytest.mark.smoke

PARALLEL = 2  # runs (processes, or torchrun groups) at a time
STEPS, CUT = 12, 6  # optimizer steps of a run; the checkpoint a resumed cell continues from
ROWS = 8  # rows of 64 tokens (base, mid) or conversations (chat_sft) per optimizer step, in every cell
TASKS = "arith:0.1,spell:0.1,identity:0.2"  # ~800 training conversations: quick to load and render
STAGE = {"base_train": "base", "mid_train": "mid", "chat_sft": "sft"}
VAL_KEY = {"base_train": "val_bpb", "mid_train": "val_bpb", "chat_sft": "val_loss"}
STEP_KEYS = {  # the keys each script writes on a step row of metrics.jsonl
    "base_train": {"step", "loss", "lrm", "dt", "tok_per_sec", "mfu", "tokens"},
    "mid_train": {"step", "loss", "lrm", "dt", "tok_per_sec", "mfu", "tokens", "epoch"},
    "chat_sft": {"step", "loss", "lrm", "dt", "tok_per_sec", "mfu", "tokens", "targets", "micro_batches", "epoch"},
}


def run_name(script, nproc, accum, resumed=False):
    return f"{STAGE[script]}_{nproc}r_a{accum}" + ("_resumed" if resumed else "")


def cell_args(script, nproc, accum, name):
    """
    The command line of a cell. device_batch_size (rows; for chat_sft max_conversations_per_device) is
    ROWS / (nproc * accum), so every cell trains ROWS per step in `accum` micro-batches per rank: base and mid run
    total_batch_size 512 = ROWS * 64 tokens; chat_sft's 8 conversations (truncated to 64 tokens) fit any micro-batch
    under max_tokens_per_device 512, so only max_conversations_per_device splits them. Evaluations at step 0 and STEPS only.
    The model and Muon's Newton-Schulz run in fp32 (both default to bf16 on CPUs with fast bf16 matmuls, where runs
    that differ by fp32 roundoff may round differently to bf16 and drift apart by more than the 1e-5 compared here).
    base_train runs without Muon's cautious weight decay for the same reason: its mask (update * weight > 0) is
    discontinuous where the update is ~0, and at depth 2 its default (6.4) takes 19% off a weight whose mask flips.
    """
    per_micro_batch = "max_conversations_per_device" if script == "chat_sft" else "device_batch_size"
    args = [f"--run_name={name}", f"--{per_micro_batch}={ROWS // (nproc * accum)}", f"--num_iterations={STEPS}",
            f"--save_every={CUT}", f"--eval_every={STEPS}", "--keep_last=0", "--ns_dtype=float32",
            "--dtype=float32"]
    if script == "base_train":  # (mid and sft have no Muon weight decay)
        return [*args, *CPU_RECIPE, "--depth=2", "--max_seq_len=64", "--total_batch_size=512", "--eval_tokens=512",
                "--sample_every=-1", "--muon_weight_decay=0"]
    if script == "mid_train":
        return [*args, f"--base_run_name={run_name('base_train', 1, 1)}", f"--tasks={TASKS}", "--total_batch_size=512",
                "--eval_tokens=512"]
    return [*args, f"--source_run_name={run_name('mid_train', 1, 1)}", f"--tasks={TASKS}",
            f"--examples_per_step={ROWS}", "--max_tokens_per_device=512", "--eval_examples=16"]


class Matrix:
    """
    The runs of the matrix, each started once in a pool of PARALLEL threads and shared by the cells that need it.
    A run is keyed (kind, script, nproc, accum) with kind "fresh" or "resumed"; its result is a dict
    {"proc": CompletedProcess, "run_dir": str, "name": str}. Runs are submitted after their
    dependencies, so a worker that waits for a dependency waits for one that is already running (no deadlock).
    """

    def __init__(self, base):
        self.base = base
        self.pool = ThreadPoolExecutor(PARALLEL)
        self.futures = {}

    def deps(self, key):
        kind, script, nproc, accum = key
        if kind == "resumed":
            return [("fresh", script, nproc, accum)]
        return {"base_train": [], "mid_train": [("fresh", "base_train", 1, 1)],
                "chat_sft": [("fresh", "mid_train", 1, 1)]}[script]

    def submit(self, key):
        """Starts the run `key` (and its dependencies) unless it is started already. Call from the main thread."""
        if key not in self.futures:
            deps = [self.submit(d) for d in self.deps(key)]
            self.futures[key] = self.pool.submit(self._run, key, deps)
        return self.futures[key]

    def result(self, key):
        return self.submit(key).result()

    def _run(self, key, deps):
        for d in deps:
            r = d.result()
            if r["proc"].returncode != 0:
                raise RuntimeError(f"a run this one needs failed:\n{r['proc'].stderr[-3000:]}")
        kind, script, nproc, accum = key
        name = run_name(script, nproc, accum, kind == "resumed")
        run_dir = self.base / STAGE[script] / name
        extra = []
        if kind == "resumed":  # the fresh run's directory, cut back to its step-CUT checkpoint
            shutil.copytree(deps[0].result()["run_dir"], run_dir)
            for ckpt in os.listdir(run_dir / "checkpoints"):
                if int(ckpt[len("step_"):]) > CUT:
                    shutil.rmtree(run_dir / "checkpoints" / ckpt)
            extra = ["--resume=True"]
        proc = run_script(f"{script}.py", *cell_args(script, nproc, accum, name), *extra, base_dir=self.base,
                          nproc=nproc)
        return {"proc": proc, "run_dir": str(run_dir), "name": name}


@pytest.fixture(scope="module")
def matrix(shared_base_dir, tmp_path_factory, request):
    """A base dir linking the shared corpus and tokenizer, with the runs of every selected cell of this module
    started in the order of the cells (the first cells' runs first)."""
    base = tmp_path_factory.mktemp("smoke_matrix")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    m = Matrix(base)
    keys = []
    for item in request.session.items:
        spec = getattr(item, "callspec", None)
        if item.module is request.module and spec is not None and {"script", "resumed"} <= set(spec.params):
            p = spec.params
            keys.append(("resumed" if p["resumed"] else "fresh", p["script"], p["nproc"], p["accum"]))
    pending = []  # each resumed run goes after the next fresh run, so that its fresh run has (nearly) finished
    for key in keys:
        if key[0] == "resumed":
            pending.append(key)
            continue
        m.submit(key)
        for k in pending:
            m.submit(k)
        pending = []
    for k in pending:
        m.submit(k)
    yield m
    m.pool.shutdown(wait=True, cancel_futures=True)


def strict_json(line):
    """json.loads that rejects NaN and Infinity (not JSON, though Python writes and reads them)."""
    def reject(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(line, parse_constant=reject)


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = f.read().splitlines()
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(strict_json(line))
        except ValueError as e:
            raise AssertionError(f"metrics.jsonl line {i + 1} is not JSON ({e}): {line!r}") from None
    return rows


def check_schema(script, rows, accum):
    """
    Every row is a step row (the script's STEP_KEYS, finite numbers, dt and tok/s > 0, 0 <= lrm <= 1, tokens counting
    up: base and mid 512 per step, chat_sft's micro_batches equal to the cell's accumulation) or an eval row
    {step, VAL_KEY} with a finite positive value; steps 1..STEPS each once, evals at step 0 and STEPS only.
    """
    tokens = 0
    for row in rows:
        assert isinstance(row, dict) and isinstance(row.get("step"), int), row
        if "loss" in row:
            assert STEP_KEYS[script] <= set(row), (STEP_KEYS[script] - set(row), row)
            assert all(isinstance(row[k], (int, float)) and math.isfinite(row[k]) for k in STEP_KEYS[script]), row
            assert row["dt"] > 0 and row["tok_per_sec"] > 0 and 0 <= row["lrm"] <= 1 and row["mfu"] >= 0, row
            assert row["tokens"] > tokens, row
            tokens = row["tokens"]
            if script == "chat_sft":
                assert row["micro_batches"] == accum and row["targets"] > 0, row
            else:
                assert row["tokens"] == 512 * row["step"], row
        else:
            assert set(row) == {"step", VAL_KEY[script]}, row
            assert math.isfinite(row[VAL_KEY[script]]) and row[VAL_KEY[script]] > 0, row
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "loss" not in r] == [0, STEPS]


def check_learns(script, rows):
    """
    The optimizer steps train the model: the held-out metric (val bpb; val loss for chat_sft), measured on the same
    held-out data at step 0 and at the last step, falls by at least 3%, and for base and mid the mean train loss of
    the last 3 steps is at least 10% below the first step's. A broken optimizer step fails this: with every lr set to
    0 (--matrix_lr=0 --embedding_lr=0 --unembedding_lr=0, or --init_lr_frac=0) the val metric is exactly unchanged
    (ratio last/first 1.0000) and the train-loss ratio is 0.9999 (base: the zero-initialised lm_head keeps
    ln(vocab)) and 0.966 (mid); test_learning_check_fails_with_lr_zero (slow) checks it. chat_sft's train loss is not
    used: at this size its step-to-step data noise is as large as 12 steps of learning (the lr=0 run's ratio is
    0.888, on data order alone). With the default lrs: val ratio 0.84-0.90 (base), 0.43 (mid), 0.90 (sft); train
    ratio 0.66-0.77 (base), 0.42-0.47 (mid).
    """
    val = [r[VAL_KEY[script]] for r in rows if "loss" not in r]
    assert val[-1] < 0.97 * val[0], (script, val)
    if script != "chat_sft":
        loss = [r["loss"] for r in rows if "loss" in r]
        assert sum(loss[-3:]) / 3 < 0.9 * loss[0], (script, loss)


def step_lines(stdout):
    """The step numbers of the training log lines ("step 00007/00012 (58.3%) | loss ...")."""
    return [int(s) for s in re.findall(r"^step (\d+)/\d+ \(", stdout, re.M)]


def load_weights(run_dir, step):
    return torch.load(os.path.join(run_dir, "checkpoints", f"step_{step:06d}", "model.pt"), weights_only=True)


def cell(script, nproc, accum, resumed):
    """One (script, nproc, accum, resumed) cell of the matrix: 2 ranks are `dist`. The default run keeps 1 rank fresh
    with accumulation 2 (mid_train, chat_sft), 2 ranks with accumulation 2 (fresh and resumed); the other cells are
    `slow` (CI runs them): a resume on 1 rank is in the default run through test_resume.py (base_train) and
    test_chat_train.py (mid_train, chat_sft), accumulation 1 adds no path that accumulation 2 does not take, on 1 rank
    or 2, and base_train fresh on 1 rank with accumulation 2 is test_base_train.py's
    test_trains_evaluates_saves_and_samples (the same tiny configuration: 2 micro-steps, checkpoint reloaded)."""
    marks = [pytest.mark.dist] if nproc == 2 else []
    if (resumed and nproc == 1) or accum == 1 or (script == "base_train" and nproc == 1):
        marks.append(pytest.mark.slow)
    return pytest.param(script, nproc, accum, resumed, marks=marks,
                        id=f"{script}-{nproc}rank{'s' if nproc > 1 else ''}-accum{accum}-"
                           f"{'resumed' if resumed else 'fresh'}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,nproc,accum,resumed", [cell(s, n, a, r) for n in (1, 2) for a in (1, 2)
                                                         for r in (False, True) for s in STAGE])
def test_cell(matrix, monkeypatch, script, nproc, accum, resumed):
    """
    One cell: exit 0; metrics.jsonl is strict JSON with the script's step and eval rows (check_schema); the run uses
    the cell's accumulation (base, mid: "gradient accumulation steps: N" printed; chat_sft: "micro-batches N" on
    every step line and in every row); the model learns (check_learns); 2 ranks end with identical replicas.
    Fresh: it logs steps 1..12, writes complete checkpoints at 6 and 12 (a rank file per rank), and the last one
    loads with nanotrain.checkpoint.load_model into a model whose logits are finite.
    Resumed: the new process logs exactly steps 7..12, metrics.jsonl holds each step once (the copied rows after
    step 6 replaced), and the losses, val metrics and final weights equal the fresh run's exactly (==; all three
    scripts promise exact resume). Catches a resume that restarts the data order or the loader position, drops the
    optimizer or RNG state, repeats or skips a step, or keeps stale metrics rows; accumulation that scales the loss
    by the wrong count; a DDP run whose ranks drift; a checkpoint that does not hold the trained weights.
    """
    run = matrix.result(("resumed" if resumed else "fresh", script, nproc, accum))
    proc = run["proc"]
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    out = proc.stdout
    rows = read_metrics(run["run_dir"])
    check_schema(script, rows, accum)
    check_learns(script, rows)
    if script == "chat_sft":
        lines = [ln for ln in out.splitlines() if re.match(r"step \d+/\d+ \(", ln)]
        assert lines and all(ln.endswith(f"| micro-batches {accum}") for ln in lines), lines
    else:
        assert re.findall(r"gradient accumulation steps: (\d+)", out) == [str(accum)], out[-3000:]
    if nproc == 2:
        assert "Replica check: parameters identical on all 2 ranks" in out, out[-3000:]

    if not resumed:
        assert step_lines(out) == list(range(1, STEPS + 1)), out[-3000:]
        from nanotrain.checkpoint import list_checkpoints
        ckpts = list_checkpoints(run["run_dir"])
        assert [os.path.basename(p) for p in ckpts] == [f"step_{CUT:06d}", f"step_{STEPS:06d}"]
        rank_files = [f"rank_{r:05d}.pt" for r in range(nproc)]
        assert all(sorted(f for f in os.listdir(p) if f.startswith("rank_")) == rank_files for p in ckpts)
        monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(matrix.base))
        from nanotrain.checkpoint import load_model
        model, tokenizer, path, meta = load_model(STAGE[script], run["name"])
        assert path == ckpts[-1] and meta["step"] == STEPS and meta["world_size"] == nproc
        ids = tokenizer.encode("The capital of France is", prepend=tokenizer.get_bos_token_id())
        with torch.no_grad():
            logits = model(torch.tensor([ids]))
        assert logits.shape == (1, len(ids), tokenizer.get_vocab_size()) and torch.isfinite(logits).all()
        return

    fresh = matrix.result(("fresh", script, nproc, accum))
    assert step_lines(out) == list(range(CUT + 1, STEPS + 1)), out[-3000:]
    if script == "chat_sft":
        assert f"resuming from {run['run_dir']}/checkpoints/step_{CUT:06d}" in out, out[-3000:]
    timing = {"dt", "tok_per_sec", "mfu"}
    untimed = lambda rs: [{k: v for k, v in r.items() if k not in timing} for r in rs]
    assert untimed(rows) == untimed(read_metrics(fresh["run_dir"])), "resumed metrics (timings aside) != fresh"
    a, b = load_weights(fresh["run_dir"], STEPS), load_weights(run["run_dir"], STEPS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        [k for k in a if not torch.equal(a[k], b[k])]


def curves(run):
    """(train losses of steps 1..STEPS, val metrics at 0 and STEPS) of a run, from its metrics.jsonl."""
    rows = read_metrics(run["run_dir"])
    return [r["loss"] for r in rows if "loss" in r], [r[k] for r in rows for k in r if k.startswith("val_")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script,nproc", [
    # slow: the 2-rank pairs, and base_train's 1-rank pair (the default run keeps test_training.py's accumulation test
    # of the one step every stage shares, and mid_train's and chat_sft's pairs here end to end)
    pytest.param(s, n, marks=[pytest.mark.slow] + ([pytest.mark.dist] if n == 2 else []), id=f"{s}-{n}")
    if n == 2 or s == "base_train" else pytest.param(s, n, id=f"{s}-{n}") for n in (1, 2) for s in STAGE])
def test_accumulation_and_ranks_do_not_change_the_run(matrix, script, nproc):
    """
    The fresh runs of the matrix that train on the same rows agree to fp32 roundoff (rtol 1e-5): accumulation 2
    against 1 at `nproc` ranks for every script (the same rows per step, split into micro-batches), and for chat_sft
    also 2 ranks with accumulation 2 against 1 rank with accumulation 1 (the same conversations per step; base and mid
    ranks read disjoint data, so their rank counts are different runs). The 2-rank accumulation pairs are slow (their
    accumulation-1 runs are the matrix's slow cells). Catches accumulation that averages per micro-batch instead of
    per token (chat_sft's masked targets), scales the gradient by the micro-batch count twice or not at all, or a step
    that syncs gradients across ranks wrongly.
    """
    pairs = [((script, nproc, 1), (script, nproc, 2))]
    if script == "chat_sft" and nproc == 1:
        pairs.append(((script, 1, 1), (script, 2, 2)))
    for a, b in pairs:
        ra, rb = matrix.result(("fresh", *a)), matrix.result(("fresh", *b))
        assert ra["proc"].returncode == 0 and rb["proc"].returncode == 0, (a, b)
        (la, va), (lb, vb) = curves(ra), curves(rb)
        assert len(la) == len(lb) == STEPS and len(va) == len(vb) == 2, (a, b)
        assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(la + va, lb + vb)), (a, b, la + va, lb + vb)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_learning_check_fails_with_lr_zero(matrix):
    """
    The negative control of check_learns (not in the default run: three more processes): each script's 1-rank,
    accumulation-1 cell with every lr at 0 passes check_schema but fails check_learns.
    """
    every_lr = ["--matrix_lr=0", "--embedding_lr=0", "--unembedding_lr=0", "--scalar_lr=0"]  # init_lr_frac must be > 0
    zero = {"base_train": every_lr[:3], "mid_train": every_lr, "chat_sft": every_lr}
    for script in STAGE:
        for dep in matrix.deps(("fresh", script, 1, 1)):
            assert matrix.result(dep)["proc"].returncode == 0, dep
        name = run_name(script, 1, 1) + "_lr0"
        proc = run_script(f"{script}.py", *cell_args(script, 1, 1, name), *zero[script], base_dir=matrix.base)
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = read_metrics(matrix.base / STAGE[script] / name)
        check_schema(script, rows, 1)
        with pytest.raises(AssertionError):
            check_learns(script, rows)
