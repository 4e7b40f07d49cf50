"""
Helpers the tests share (imported as `from helpers import ...`; fixtures stay in conftest.py): the repository root,
the tiny base_train configuration of the smoke tests, running a script through the command line, the numeric tests'
tiny model, gradients as one tensor, a relative distance, SFT's backward as chat_sft runs it, a free port and
spawned ranks for the gloo tests.
"""

import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import nullcontext

import pytest
import torch
import torch.multiprocessing as mp

from nanotrain.gpt import GPT, GPTConfig
from nanotrain.sft_data import global_target_count, token_loss_scale
from nanotrain.training import forward_backward

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_VOCAB = 512  # tokenizer vocab (including the 9 special tokens) of the test runs
# the tiny base_train configuration the smoke tests use (seconds on 2 cores)
# the CPU recipe's optimizer values (runs/cpu.sh states them; base_train's defaults are nanochat's GPU recipe)
CPU_RECIPE = ["--hparam_transfer=False", "--matrix_lr=0.03", "--embedding_lr=0.2", "--unembedding_lr=0.004",
              "--muon_weight_decay=0.4", "--lr_warmup_steps=0", "--grad_clip=1.0", "--target_param_data_ratio=20"]
TINY_TRAIN = [*CPU_RECIPE, "--depth=2", "--max_seq_len=64", "--device_batch_size=4", "--total_batch_size=512",
              "--eval_tokens=2048", "--eval_every=-1", "--sample_every=-1", "--save_every=-1", "--keep_last=0"]


def run_script(script, *args, base_dir, nproc=1, timeout=300, env=None):
    """
    Runs scripts/<script> through the command line (python, or torchrun --standalone with nproc > 1 on gloo)
    with NANOTRAIN_BASE_DIR=base_dir. Returns the CompletedProcess (stdout and stderr as text).
    """
    path = os.path.join(REPO, "scripts", script)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", path]
    else:
        cmd = [sys.executable, path]
    full_env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    return subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


def copy_run(src_base, dst_base, stage, run):
    shutil.copytree(os.path.join(src_base, stage, run), os.path.join(dst_base, stage, run))


def tiny_model(seed=0):
    """A 2-layer GPT (vocab 64, 16 positions) with every weight nonzero, seeded: the numeric tests' model."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, model_dim=32))
    model.init_weights()
    with torch.no_grad():  # give the zero-initialised projections some weight so every path matters
        for name, p in model.named_parameters():
            if "c_proj" in name or "lm_head" in name:
                p.normal_(0, 0.05)
    return model


def grads(model):
    """All parameter gradients as one flat tensor."""
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def rel(a, b):
    """Relative distance |a - b| / |b| (float)."""
    return ((a - b).norm() / b.norm()).item()


def sft_backward(model, batches, autocast_ctx=None):
    """
    chat_sft's backward of one step's micro-batches (sft_data.micro_batch dicts): the global target count first
    (global_target_count, one all-reduce), then forward_backward with loss_scale = token_loss_scale(count, W), W the
    world size when `model` is DistributedDataParallel, else 1. Returns (scaled loss: 0-dim tensor, count: int);
    nothing runs when count is 0 (the scaled loss is then 0).
    """
    device = batches[0]["x"].device
    count = global_target_count(sum(b["targets"] for b in batches), device)
    if count == 0:
        return torch.zeros((), device=device), 0
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    scale = token_loss_scale(count, torch.distributed.get_world_size() if ddp else 1)
    return forward_backward(model, batches, autocast_ctx or nullcontext(), loss_scale=scale), count


# every call that changes what is on disk (shutil.rmtree's own unlink/rmdir calls included), for kill injection
FS_OPS = [("os", "fsync"), ("os", "rename"), ("os", "replace"), ("os", "unlink"), ("os", "remove"), ("os", "rmdir"),
          ("shutil", "rmtree"), ("torch", "save"), ("numpy", "save")]


class Killed(BaseException):
    """Stands for SIGKILL: not an Exception, so no `except OSError/Exception` cleanup code runs."""


def run_with_kill(monkeypatch, fn, kill_at):
    """
    Calls fn() with every file-system operation of FS_OPS counted, cut short by Killed before operation number
    `kill_at` (never when None): what a SIGKILL at that instant leaves on disk. Returns (the operations done, as
    (name, args) pairs, in order; whether fn was cut short).
    """
    import importlib
    done = []

    def counting(real, name):
        def op(*args, **kwargs):
            if kill_at is not None and len(done) == kill_at:
                raise Killed
            done.append((name, args))
            return real(*args, **kwargs)
        return op

    with monkeypatch.context() as m:
        for mod, name in FS_OPS:
            module = importlib.import_module(mod)
            m.setattr(module, name, counting(getattr(module, name), name))
        try:
            fn()
        except Killed:
            return done, True
    return done, False


def same(a, b):
    """Nested dicts/lists of tensors and plain values are equal: tensors with torch.equal, the rest with ==."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(worker, args, nprocs=2, timeout_s=90):
    """Runs worker(rank, *args) in `nprocs` spawned processes and waits for them; a rank still running after
    timeout_s seconds fails the test (all ranks terminated); a rank that raises re-raises here."""
    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.time() + timeout_s
    while not ctx.join(timeout=1):
        if time.time() > deadline:
            for p in ctx.processes:
                p.terminate()
            pytest.fail(f"{nprocs}-rank run timed out after {timeout_s} s")


def write_benchmark_copy(folder):
    """A local copy of the five chat benchmarks in the hub's layout (each task's hub_test), 3 rows each:
    ARC-Easy/ARC-Challenge as parquet, MMLU as JSONL, GSM8K as parquet, HumanEval as parquet. Returns the folder."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    arc = [{"id": f"q{i}", "question": f"Which number is {i}?", "answerKey": "ABC"[i],
            "choices": {"text": ["0", "1", "2"], "label": ["A", "B", "C"]}} for i in range(3)]
    mmlu = [{"question": f"Pick {c}.", "subject": "misc", "choices": ["a", "b", "c", "d"], "answer": i}
            for i, c in enumerate("abc")]
    gsm = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"}
           for i in range(3)]
    code = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x + {i}.\"\"\"\n",
             "canonical_solution": f"    return x + {i}\n", "entry_point": f"f{i}",
             "test": f"def check(candidate):\n    assert candidate(1) == {1 + i}\n"} for i in range(3)]
    for sub, rows in (("ARC-Easy", arc), ("ARC-Challenge", arc), ("main", gsm), ("openai_humaneval", code)):
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(folder, sub, "test-00000-of-00001.parquet"))
    os.makedirs(os.path.join(folder, "all"), exist_ok=True)
    with open(os.path.join(folder, "all", "test-00000-of-00001.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in mmlu))
    return str(folder)


# an lm-evaluation-harness multiple-choice task on local JSONL rows (test_hf_export, test_serve_lmeval): format with
# the task's name and the data file
LOCAL_MC_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
MC_ROWS = [{"question": "The cat sat on the", "choices": ["mat.", "cat", "42"], "answer": 0},
           {"question": "What is 12 + 30? It is", "choices": ["42.", "fine", "there"], "answer": 0},
           {"question": "Hello there, how are you", "choices": ["mat", "doing today?"], "answer": 1},
           {"question": "I'm fine, thanks;", "choices": ["you're kind.", "It is 42."], "answer": 0}]
