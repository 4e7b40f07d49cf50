"""
A kill at every instant of a checkpoint save (every file write, fsync, rename and deletion), then a resume: the
newest complete checkpoint is found and nothing complete is ever deleted before a newer copy is committed.

In-process (default tier): the file-system operations of one save_checkpoint are counted and the save is cut short
before operation k, for every k, by an exception no cleanup code catches (what a SIGKILL leaves on disk); then the
readers (list_checkpoints, load_latest) and the next save are checked. End to end (slow): base_train itself is
SIGKILLed before each operation of a save and resumed with --resume=True; its final weights must equal an
uninterrupted run's bit for bit.
"""

import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import REPO, TINY_TRAIN, run_script, run_with_kill, same

from nanotrain.checkpoint import list_checkpoints, load_latest, save_checkpoint, step_of
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers

CONFIG = GPTConfig(max_seq_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, model_dim=32)
def model_at(step):
    """A tiny model whose weights encode `step` (so a loaded checkpoint shows which save it came from)."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    with torch.no_grad():
        model.lm_head.weight.fill_(float(step))
    return model, setup_optimizers(model)


def saved_step(ckpt):
    """The step the weights of a loaded checkpoint encode (model_at)."""
    return int(ckpt["model"]["lm_head.weight"].flatten()[0].item())


def save_with_kill(monkeypatch, run_dir, step, content, keep_last, kill_at):
    """
    save_checkpoint(step) of model_at(content), cut short before its file-system operation number `kill_at` (never,
    when kill_at is None). Returns (the operations done as (name, args), whether it was cut short).
    """
    model, opts = model_at(content)
    return run_with_kill(monkeypatch, lambda: save_checkpoint(run_dir, step, model, opts, {"config": {}}, {},
                                                              keep_last=keep_last), kill_at)


# (name, saves before the killed one as (step, weights), the killed save (step, weights), keep_last)
SCENARIOS = [
    ("new step", [(1, 1), (2, 2)], (3, 3), 0),
    ("keep_last=1", [(1, 1), (2, 2)], (3, 3), 1),
    ("re-save of the newest step", [(1, 1), (2, 2)], (2, 20), 1),
]


@pytest.mark.parametrize("name, before, killed, keep_last", SCENARIOS, ids=[s[0] for s in SCENARIOS])
def test_a_kill_before_any_operation_of_a_save_loses_nothing(tmp_path, monkeypatch, name, before, killed, keep_last):
    """
    For every k: save the steps `before`, kill the next save before its k-th file-system operation, then check what a
    resume sees: the killed save's weights if its commit marker (meta.json) was in place, else the previous newest
    step's, and never fewer checkpoints than keep_last allows; then the resumed run's next save (the same step again)
    leaves exactly the expected directories, without .tmp/.old leftovers, holding the right weights.
    Catches the old sequence, which deleted every step_*.tmp and step_*.old at the start of a save (so a kill between
    the two renames of a re-save lost both complete copies and the resume started fresh or from an older step), and
    a commit that deletes the old copy before the new one is renamed into place.
    """
    step, content = killed
    probe = str(tmp_path / "probe")
    for s, c in before:
        save_with_kill(monkeypatch, probe, s, c, keep_last, None)
    total = len(save_with_kill(monkeypatch, probe, step, content, keep_last, None)[0])
    assert total >= 10  # three tensor files and meta.json written and fsynced, the directory fsynced, the commit
    for k in range(total + 1):
        run_dir = str(tmp_path / f"kill{k}")
        for s, c in before:
            save_with_kill(monkeypatch, run_dir, s, c, keep_last, None)
        done, cut = save_with_kill(monkeypatch, run_dir, step, content, keep_last, kill_at=k)
        assert cut == (k < total)
        marker = os.path.join(run_dir, "checkpoints", f"step_{step:06d}.tmp", "meta.json")
        committed = any(n == "replace" and a[1] == marker for n, a in done)
        ckpt = load_latest(run_dir, "cpu")
        assert ckpt is not None, (name, k, done[-1:])
        prev_step, prev_content = before[-1]
        want = (step, content) if committed else (prev_step, prev_content)
        assert (ckpt["meta"]["step"], saved_step(ckpt)) == want, (name, k, done[-1:])
        # the resumed run saves the killed step again: all earlier complete steps survive it, nothing is left over
        save_with_kill(monkeypatch, run_dir, step, content, keep_last, None)
        names = sorted(os.listdir(os.path.join(run_dir, "checkpoints")))
        steps = sorted({s for s, _ in before} | {step})
        expect = steps[-keep_last:] if keep_last else steps
        assert names == [f"step_{s:06d}" for s in expect], (name, k, names)
        assert saved_step(load_latest(run_dir, "cpu")) == content


def test_readers_take_the_newest_complete_copy(tmp_path):
    """
    The copies a kill can leave, planted by hand: a complete .tmp beats the plain directory and .old (it was
    written last), the plain directory beats .old, an incomplete .tmp (no meta.json) counts for nothing, and an
    .old alone is found. Catches a reader that only lists plain step_XXXXXX directories.
    """
    run_dir = str(tmp_path / "run")
    root = os.path.join(run_dir, "checkpoints")
    os.makedirs(root)
    for content, suffix in ((1, ".old"), (2, ""), (3, ".tmp")):
        model, opts = model_at(content)
        src = str(tmp_path / f"src{content}")
        save_checkpoint(src, 5, model, opts, {"config": {}}, {})
        os.rename(os.path.join(src, "checkpoints", "step_000005"), os.path.join(root, "step_000005" + suffix))
    assert saved_step(load_latest(run_dir, "cpu")) == 3
    os.remove(os.path.join(root, "step_000005.tmp", "meta.json"))  # the new copy was not complete
    assert saved_step(load_latest(run_dir, "cpu")) == 2
    shutil.rmtree(os.path.join(root, "step_000005"))
    assert [os.path.basename(p) for p in list_checkpoints(run_dir)] == ["step_000005.old"]
    assert step_of(list_checkpoints(run_dir)[0]) == 5 and saved_step(load_latest(run_dir, "cpu")) == 1


# ----------------------------------------------------------------------------- end to end: SIGKILL base_train

KILLER = """
import os, runpy, shutil, signal, sys
import torch
import nanotrain.checkpoint as ck
kill_at, target = int(os.environ["KILL_AT"]), int(os.environ["KILL_STEP"])
count, active = [0], [False]
def counting(real):
    def op(*args, **kwargs):
        if active[0]:
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1
        return real(*args, **kwargs)
    return op
for mod, name in [(os, "fsync"), (os, "rename"), (os, "replace"), (os, "unlink"), (os, "remove"), (os, "rmdir"),
                  (shutil, "rmtree"), (torch, "save")]:  # helpers.FS_OPS
    setattr(mod, name, counting(getattr(mod, name)))
real_save = ck.save_checkpoint
def save(run_dir, step, *args, **kwargs):
    active[0] = step == target
    try:
        return real_save(run_dir, step, *args, **kwargs)
    finally:
        if active[0]:
            print(f"save operations: {count[0]}", file=sys.stderr, flush=True)
        active[0] = False
ck.save_checkpoint = save
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

E2E_ARGS = [*TINY_TRAIN, "--num_iterations=4", "--save_every=2", "--eval_every=-1"]


def _killed_then_resumed(base, name, args, kill_at, source=None):
    """
    Runs base_train under KILLER (SIGKILL before file-system operation `kill_at` of the save of step 4; a copy of
    the finished run `source` is resumed, which saves step 4 again), then --resume=True to the end. Returns (the
    killed run, whether a complete copy of step 4 existed after the kill, the resumed run, the run's directory).
    """
    run = str(base / "base" / name)
    extra = []
    if source is not None:
        shutil.copytree(source, run)
        extra = ["--resume=True"]
    script = [os.path.join(REPO, "scripts", "base_train.py"), *args, *extra, f"--run_name={name}"]
    killed = run_script(str(base / "killer.py"), *script, base_dir=base, env={"KILL_AT": str(kill_at), "KILL_STEP": "4"})
    had_step4 = any(step_of(p) == 4 for p in list_checkpoints(run))
    resumed = run_script("base_train.py", *args, f"--run_name={name}", "--resume=True", base_dir=base)
    return killed, had_step4, resumed, run


@pytest.mark.slow  # ~3 min; the same kill points against the checkpoint module in-process are in the default tier
@pytest.mark.parametrize("how", ["new step", "keep_last=1", "re-save"])
def test_base_train_killed_at_every_save_operation_resumes_bit_exact(shared_base_dir, tmp_path, how):
    """
    base_train (4 steps, checkpoints at 2 and 4) SIGKILLed before each file-system operation of the save of step 4
    (or, "re-save", of the save of step 4 again by a resume of the finished run, with --keep_last=1), then resumed
    with --resume=True: never "starting fresh"; it trains steps 3 and 4 again exactly when no complete copy of step
    4 was left; and its final model.pt and optim.pt equal the uninterrupted run's bit for bit.
    """
    base = tmp_path
    for d in ("data", "tokenizer"):
        os.symlink(shared_base_dir / d, base / d)
    (base / "killer.py").write_text(KILLER)
    args = [*E2E_ARGS, "--keep_last=0" if how == "new step" else "--keep_last=1"]
    straight = run_script("base_train.py", *args, "--run_name=straight", base_dir=base)
    assert straight.returncode == 0, straight.stderr[-2000:]
    source = str(base / "base" / "straight") if how == "re-save" else None
    probe = _killed_then_resumed(base, "probe", args, 10**6, source)[0]
    assert probe.returncode == 0, probe.stderr[-2000:]
    total = int(probe.stderr.split("save operations: ")[-1].split()[0])
    assert total >= 10, probe.stderr[-2000:]
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [pool.submit(_killed_then_resumed, base, f"k{k}", args, k, source) for k in range(total)]
        results = [j.result() for j in jobs]
    final = os.path.join(base, "base", "straight", "checkpoints", "step_000004")
    for k, (killed, had_step4, resumed, run) in enumerate(results):
        assert killed.returncode == -signal.SIGKILL, (k, killed.stderr[-2000:])
        assert resumed.returncode == 0, (k, resumed.stderr[-2000:])
        assert "starting fresh" not in resumed.stdout, (k, resumed.stdout[-2000:])
        assert ("step 00003/00004 (" in resumed.stdout) == (not had_step4), (k, had_step4, resumed.stdout[-2000:])
        for f in ("model.pt", "optim.pt"):
            a = torch.load(os.path.join(final, f), weights_only=True)
            b = torch.load(os.path.join(run, "checkpoints", "step_000004", f), weights_only=True)
            assert same(a, b), (k, f)
        left = sorted(os.listdir(os.path.join(run, "checkpoints")))
        assert not [n for n in left if n.endswith((".tmp", ".old"))], (k, left)
