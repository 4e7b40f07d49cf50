"""Tests of nanotrain.checkpoint: atomic layout, round trip, corrupt checkpoints, retention, no pickle."""

import json
import os
import pickle
import random
import warnings

import pytest
import torch

from nanotrain.checkpoint import list_checkpoints, load_latest, save_checkpoint
from nanotrain.common import rng_state, set_rng_state
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers

pytestmark = pytest.mark.unit


CONFIG = GPTConfig(max_seq_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, model_dim=32)


def resume_meta(**config):
    """The meta a training stage saves (the keys resume_checkpoint needs: RESUME_META_KEYS), with `config`."""
    return {"config": config, "model_config": vars(CONFIG), "tokens_seen": 0, "train_time": 0.0}


def setup():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    opts = setup_optimizers(model)
    model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))).backward()
    for o in opts:
        o.step()
    return model, opts


def test_round_trip_and_layout(tmp_path):
    model, opts = setup()
    state = {"rng": rng_state("cpu"), "loader": {"epoch": 1, "doc_index": 7, "offset": 3}}
    path = save_checkpoint(str(tmp_path), 5, model, opts, {"config": {"depth": 1}}, state)
    assert sorted(os.listdir(path)) == ["meta.json", "model.pt", "optim.pt", "rank_00000.pt"]
    assert not [p for p in os.listdir(tmp_path / "checkpoints") if p.endswith(".tmp")]
    ck = load_latest(str(tmp_path), "cpu")
    assert ck["meta"]["step"] == 5 and ck["meta"]["config"] == {"depth": 1} and "git_commit" in ck["meta"]
    assert all(torch.equal(a, b) for a, b in zip(ck["model"].values(), model.state_dict().values()))
    assert ck["rank_state"]["loader"] == {"epoch": 1, "doc_index": 7, "offset": 3}
    model2, opts2 = setup()
    for o, s in zip(opts2, ck["optim"]):
        o.load_state_dict(s)
    assert opts2[0].state_dict()["state"].keys() == opts[0].state_dict()["state"].keys()


def test_rng_state_round_trip():
    """Restoring the saved RNG states reproduces the same random numbers (Python and torch)."""
    s = rng_state("cpu")
    a = (random.random(), torch.rand(3))
    set_rng_state(s, "cpu")
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_partial_and_corrupt_checkpoints_are_skipped(tmp_path):
    """A directory without meta.json (interrupted save) is not listed; a corrupt model.pt falls back with a warning."""
    model, opts = setup()
    save_checkpoint(str(tmp_path), 1, model, opts, {}, {})
    save_checkpoint(str(tmp_path), 2, model, opts, {}, {})
    os.makedirs(tmp_path / "checkpoints" / "step_000003.tmp")  # an interrupted save
    os.makedirs(tmp_path / "checkpoints" / "step_000004")  # no meta.json: incomplete
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["step_000001", "step_000002"]
    with open(tmp_path / "checkpoints" / "step_000002" / "model.pt", "wb") as f:
        f.write(b"garbage")
    with pytest.warns(UserWarning, match="skipping unreadable checkpoint"):
        ck = load_latest(str(tmp_path), "cpu")
    assert ck["meta"]["step"] == 1


def test_keep_last(tmp_path):
    model, opts = setup()
    for s in range(1, 6):
        save_checkpoint(str(tmp_path), s, model, opts, {}, {}, keep_last=2)
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["step_000004", "step_000005"]


def test_loading_never_unpickles_arbitrary_objects(tmp_path):
    """A model.pt holding a pickled arbitrary object is refused (weights_only=True), so the checkpoint is skipped."""
    model, opts = setup()
    path = save_checkpoint(str(tmp_path), 1, model, opts, {}, {})

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))
    with open(os.path.join(path, "model.pt"), "wb") as f:
        pickle.dump(Evil(), f)
    with pytest.warns(UserWarning):
        assert load_latest(str(tmp_path), "cpu") is None
    assert not (tmp_path / "pwned").exists()
    assert json.load(open(os.path.join(path, "meta.json")))["step"] == 1


def test_resume_checks_settings_and_world_size(tmp_path, capsys):
    """
    resume_checkpoint finds the newest complete checkpoint (or warns and returns None on an empty run), and
    check_resume refuses a checkpoint whose listed settings or world size differ, naming the flag, while settings
    outside the list may change. Catches a check that compares the wrong dict (this run's settings against
    themselves), ignores the world size, or refuses every change.
    """
    from nanotrain.checkpoint import check_resume, resume_checkpoint
    from nanotrain.errors import UserError
    run = str(tmp_path / "run")
    assert resume_checkpoint(run, "cpu") is None and "no checkpoint yet" in capsys.readouterr().out
    model, opts = setup()
    state = {"rng": rng_state("cpu")}
    save_checkpoint(run, 3, model, opts, resume_meta(data="a", seq=16, lr=0.1), state)
    ckpt = resume_checkpoint(run, "cpu")
    assert ckpt["meta"]["step"] == 3
    check_resume(ckpt, run, {"data": "a", "seq": 16, "lr": 0.5}, ("data", "seq"), 1)  # lr is not checked
    with pytest.raises(UserError, match="has seq=16 but this run has --seq=32"):
        check_resume(ckpt, run, {"data": "a", "seq": 32, "lr": 0.1}, ("data", "seq"), 1)
    with pytest.raises(UserError, match="world_size 1; resume with the same number of processes \\(2\\)"):
        check_resume(ckpt, run, {"data": "a", "seq": 16, "lr": 0.1}, ("data", "seq"), 2)


def test_missing_rank_file_falls_back_to_the_previous_checkpoint(tmp_path):
    """
    A resume whose newest checkpoint lacks this rank's rank_00000.pt (deleted or never written) uses the previous
    complete checkpoint, with a warning naming the missing file. The old code returned the newest checkpoint with no
    rank state, and the resume then failed with a misleading "written with world_size 1" message.
    """
    from nanotrain.checkpoint import resume_checkpoint
    model, opts = setup()
    for step in (5, 10):
        save_checkpoint(str(tmp_path), step, model, opts, resume_meta(), {"loader": {"step": step}})
    os.remove(tmp_path / "checkpoints" / "step_000010" / "rank_00000.pt")
    with pytest.warns(UserWarning, match="rank_00000.pt is missing"):
        ck = resume_checkpoint(str(tmp_path), "cpu")
    assert ck["meta"]["step"] == 5 and ck["rank_state"]["loader"] == {"step": 5}


def test_resume_refuses_when_no_checkpoint_can_be_read(tmp_path, capsys):
    """
    Checkpoints exist but none can be read: resume_checkpoint raises UserError pointing at --resume=False (the old
    code warned and returned None, so the run restarted from step 1 over its own metrics). An empty run directory
    is still a fresh start.
    """
    from nanotrain.checkpoint import resume_checkpoint
    from nanotrain.errors import UserError
    model, opts = setup()
    path = save_checkpoint(str(tmp_path), 5, model, opts, resume_meta(), {})
    with open(os.path.join(path, "model.pt"), "r+b") as f:
        f.truncate(100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the reason is in the one error line, not in warnings before it
        with pytest.raises(UserError, match="none of the 1 checkpoints.*newest: .*model.pt is not a plain tensor file: truncated.*"
                                            "--resume=False") as info:
            resume_checkpoint(str(tmp_path), "cpu")
    assert "\n" not in str(info.value)
    assert resume_checkpoint(str(tmp_path / "new_run"), "cpu") is None


def test_resume_applies_this_runs_learning_rates(tmp_path):
    """
    load_optimizers keeps the lr and weight decay of this run's flags (setup_optimizers) over the checkpoint's and
    reports each change; with unchanged flags it changes nothing and reports nothing. The old code let the loaded
    state dict bring the saved lrs back, so --matrix_lr on resume was silently ignored while config.json recorded it.
    """
    from nanotrain.checkpoint import load_optimizers
    model, opts = setup()
    states = [o.state_dict() for o in opts]
    same = setup_optimizers(model)
    assert load_optimizers(model, same, states) == []
    assert [g["initial_lr"] for o in same for g in o.param_groups] == [g["initial_lr"] for o in opts
                                                                       for g in o.param_groups]
    halved = setup_optimizers(model, matrix_lr=0.01, embedding_lr=0.1, unembedding_lr=0.004)
    wanted = [g["initial_lr"] for o in halved for g in o.param_groups]
    changes = load_optimizers(model, halved, states)
    assert [g["initial_lr"] for o in halved for g in o.param_groups] == wanted
    assert len(changes) == 3 and any("Muon group 0: initial_lr 0.02 -> 0.01" == c for c in changes), changes
    assert halved[1].state_dict()["state"].keys() == states[1]["state"].keys()  # the momentum buffers did load


def test_lock_run_dir_refuses_a_second_process_until_the_first_exits(tmp_path):
    """
    A run directory locked by another live process cannot be locked: UserError names that process's pid; once it
    has exited (here killed, so nothing released the lock by hand) the lock is free. The old code had no lock, so two
    runs of one name interleaved their checkpoints and metrics.
    """
    import subprocess
    import sys

    from nanotrain.errors import UserError
    from nanotrain.run import lock_run_dir
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from nanotrain.run import lock_run_dir; lock_run_dir(sys.argv[1], 'cpu'); "
        "print('locked', flush=True); time.sleep(60)"), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"in use by pid {holder.pid} on "):
            lock_run_dir(str(tmp_path), "cpu")
    finally:
        holder.kill()
        holder.wait()
    lock_run_dir(str(tmp_path), "cpu")
    lock_run_dir(str(tmp_path), "cpu")  # again in the same process: a no-op


def _full_disk_message(tmp_path, monkeypatch, fail_on):
    """save_checkpoint a second time with torch.save failing (ENOSPC) on the file named `fail_on`."""
    import errno

    import nanotrain.checkpoint as ckpt_module
    from nanotrain.errors import UserError
    model, opts = setup()
    save_checkpoint(str(tmp_path), 5, model, opts, {"config": {}}, {})
    real_save = torch.save

    def save(obj, f):  # f: the open file (save_checkpoint fsyncs it after torch.save)
        if os.path.basename(f.name) == fail_on:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f)
    monkeypatch.setattr(ckpt_module.torch, "save", save)
    with pytest.raises(UserError) as info:
        save_checkpoint(str(tmp_path), 10, model, opts, {"config": {}}, {})
    monkeypatch.setattr(ckpt_module.torch, "save", real_save)
    return str(info.value)


@pytest.mark.parametrize("fail_on", ["rank_00000.pt", "model.pt", "optim.pt"])
def test_disk_full_during_a_save_is_one_line_and_leaves_no_partial_files(tmp_path, monkeypatch, fail_on):
    """
    A write that fails with ENOSPC in any file of a checkpoint: one UserError line that says "disk full" and names
    the intact previous checkpoint, no step_000010.tmp left to keep the disk full, and the step-5 checkpoint still
    loads. The old code raised torch's error and left the .tmp directory (so the next resume hit a full disk too).
    """
    msg = _full_disk_message(tmp_path, monkeypatch, fail_on)
    assert "disk full" in msg and "step_000005 is intact" in msg and "\n" not in msg, msg
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_000005"]
    assert load_latest(str(tmp_path), "cpu")["meta"]["step"] == 5


def test_a_really_full_filesystem(tmp_path):
    """
    The same on a real full filesystem (a 3 MiB tmpfs; skipped where mounting is not allowed): torch's zip writer
    reports it as an opaque RuntimeError ("unexpected pos ..."), which must still read "disk full".
    """
    import subprocess

    from nanotrain.errors import UserError
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        model, opts = setup()
        save_checkpoint(str(mnt), 5, model, opts, {"config": {}}, {})
        with open(mnt / "filler", "wb", buffering=0) as f:  # fill what is left, as another process would (unbuffered:
            # nothing left over for close() to fail on)
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        with pytest.raises(UserError, match="disk full.*step_000005 is intact") as info:
            save_checkpoint(str(mnt), 10, model, opts, {"config": {}}, {})
        assert "\n" not in str(info.value)
        assert sorted(os.listdir(mnt / "checkpoints")) == ["step_000005"]
        assert load_latest(str(mnt), "cpu")["meta"]["step"] == 5
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


# ----------------------------------------------------------------------------- damaged and foreign files

class Planted:
    """Unpickling it (pickle.load, torch.load(weights_only=False)) would create the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def one_line_error(fn, *args, **kwargs):
    """The CheckpointError fn raises, after checking it is one line without torch's advice to drop weights_only."""
    from nanotrain.tensor_file import CheckpointError
    with pytest.raises(CheckpointError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg and "weights_only" not in msg and msg.startswith(info.value.file), msg
    return info.value


@pytest.mark.parametrize("damage", ["truncated", "random bytes", "empty", "missing"])
def test_a_damaged_tensor_file_is_one_line_naming_it(tmp_path, damage):
    """
    model.pt cut short, replaced by random bytes, emptied or deleted: load_checkpoint raises CheckpointError (a
    UserError) naming model.pt and what is wrong, in one line. The old code raised torch's errors: a RuntimeError of
    the zip reader, or for random bytes an UnpicklingError of several paragraphs that even suggests loading with
    weights_only=False.
    """
    from nanotrain.checkpoint_format import load_checkpoint
    model, opts = setup()
    path = save_checkpoint(str(tmp_path), 1, model, opts, resume_meta(), {})
    file = os.path.join(path, "model.pt")
    if damage == "missing":
        os.remove(file)
    else:
        data = open(file, "rb").read()
        new = {"truncated": data[: len(data) // 2], "random bytes": random.Random(0).randbytes(5000),
               "empty": b""}[damage]
        open(file, "wb").write(new)
    err = one_line_error(load_checkpoint, path, "cpu")
    assert err.file == file
    assert err.problem.startswith({"truncated": "is not a plain tensor file: truncated, damaged, or holding ",
                                   "random bytes": "is not a plain tensor file: truncated, damaged, or holding ",
                                   "empty": "is empty", "missing": "is missing"}[damage]), err.problem


@pytest.mark.parametrize("how", ["pickle", "pickle protocol 2", "torch.save"])
@pytest.mark.parametrize("name", ["model.pt", "optim.pt", "rank_00000.pt"])
def test_a_planted_pickle_is_refused_in_one_line_and_never_run(tmp_path, how, name):
    """
    Any file of a checkpoint replaced by a pickle of an object whose __reduce__ would create a marker file (a plain
    pickle of today's or the old protocol, or torch.save's zip archive of it): refused (weights_only=True holds)
    with one line "<file> is not a plain tensor file: ...; refusing to load it (...)", naming the global torch
    refused, and the marker is never created. The old message was torch's multi-paragraph
    advice, which suggests weights_only=False, or for a protocol-4 pickle an "Unsupported operand 149".
    """
    from nanotrain.checkpoint_format import load_checkpoint
    model, opts = setup()
    path = save_checkpoint(str(tmp_path), 1, model, opts, resume_meta(), {})
    marker = tmp_path / "marker"
    file = os.path.join(path, name)
    if how == "torch.save":
        torch.save(Planted(marker), file)
    else:
        with open(file, "wb") as f:
            pickle.dump(Planted(marker), f, protocol=2 if how == "pickle protocol 2" else None)
    err = one_line_error(load_checkpoint, path, "cpu")
    assert err.file == file and err.problem.startswith(
        "is not a plain tensor file: truncated, damaged, or holding arbitrary Python objects; refusing to load it ("), \
        err.problem
    assert "system" in err.problem or how != "torch.save"  # torch names the global inside its own archive format
    assert not marker.exists()


@pytest.mark.parametrize("edit, keys, fragment", [
    (lambda m: m.pop("model_config"), ("model_config",), "lacks the key 'model_config'"),
    (lambda m: m.pop("config"), ("config", "model_config"), "lacks the key 'config'"),
    (lambda m: [m.pop("config"), m.pop("train_time")], ("config", "train_time"),
     "lacks the keys 'config', 'train_time'"),
    (lambda m: m.pop("world_size"), (), "lacks the key 'world_size'"),
    (lambda m: m.update(step="1"), (), "has step='1'; expected an int >= 0"),
    (lambda m: m.update(step=7), (), "has step=7 but is in the directory step_000001"),
    (lambda m: m.update(config=[1, 2]), (), "has \"config\" '[1, 2]'; expected an object"),
    (lambda m: m["model_config"].pop("n_head"), (), "has \"model_config\" {"),
    (lambda m: m["model_config"].update(window=4), (), "'window': 4}; expected an object of the ints >= 1"),
    (lambda m: m["model_config"].update(n_layer="1"), (), "expected an object of the ints >= 1 max_seq_len, "),
    (lambda m: m["model_config"].update(n_head=3), (), "has a \"model_config\" that makes no model"),
])
def test_a_meta_json_without_what_its_reader_needs_is_unreadable(tmp_path, edit, keys, fragment):
    """
    A meta.json that lacks a key the caller needs (meta_keys; "step" and "world_size" always), has a step other
    than its directory's, or a malformed model_config is a CheckpointError naming meta.json, so a resume or an
    inference falls back past it like past a torn file. The old code loaded it and failed later with a KeyError
    ('config', 'model_config') or a TypeError in GPTConfig(**...).
    """
    from nanotrain.checkpoint_format import load_checkpoint
    model, opts = setup()
    path = save_checkpoint(str(tmp_path), 1, model, opts, resume_meta(), {})
    file = os.path.join(path, "meta.json")
    meta = json.load(open(file))
    edit(meta)
    json.dump(meta, open(file, "w"))
    err = one_line_error(load_checkpoint, path, "cpu", meta_keys=keys)
    assert err.file == file and fragment in err.problem, err.problem


@pytest.mark.parametrize("text, fragment", [("[1, 2]", "holds a JSON list, not an object"),
                                            ('{"step": 1, "wor', "is not valid JSON (")])
def test_a_meta_json_that_is_not_an_object(tmp_path, text, fragment):
    from nanotrain.checkpoint_format import load_checkpoint
    model, opts = setup()
    path = save_checkpoint(str(tmp_path), 1, model, opts, resume_meta(), {})
    open(os.path.join(path, "meta.json"), "w").write(text)
    err = one_line_error(load_checkpoint, path, "cpu")
    assert err.file == os.path.join(path, "meta.json") and fragment in err.problem, err.problem


@pytest.mark.parametrize("state, fragment", [
    ({}, "holds an empty dict, not the model's weights"),
    ([torch.zeros(1)], "holds a list, not the model's weights"),
    ({"wte.weight": 3}, "is not a state dict of tensors (entry 'wte.weight' is a int)"),
    ("drop", "does not fit the model_config of "),
    ("shape", "1 of the wrong shape (e.g. lm_head.weight)"),
])
def test_model_weights_that_do_not_fit_are_unreadable(tmp_path, state, fragment):
    """
    model.pt holding no weights (torch.save({})), not a dict of tensors, or names and shapes other than those of the
    GPT of the meta's model_config (a tensor missing, one of the wrong shape): a CheckpointError naming model.pt.
    The old code loaded it and build_model failed with load_state_dict's multi-line RuntimeError (missing keys).
    """
    from nanotrain.checkpoint_format import load_checkpoint
    model, opts = setup()
    path = save_checkpoint(str(tmp_path), 1, model, opts, resume_meta(), {})
    file = os.path.join(path, "model.pt")
    if state == "drop":
        state = dict(model.state_dict())
        state.pop("wte.weight")
    elif state == "shape":
        state = dict(model.state_dict(), **{"lm_head.weight": torch.zeros(3, 3)})
    torch.save(state, file)
    err = one_line_error(load_checkpoint, path, "cpu")
    assert err.file == file and fragment in err.problem, err.problem


def test_resume_falls_back_past_a_bad_meta_and_a_planted_pickle(tmp_path):
    """
    Checkpoints 1, 2, 3 of a run: step 3's meta.json lacks "config", step 2's optim.pt is a planted pickle.
    resume_checkpoint warns once per skipped checkpoint, one line each naming its bad file, and resumes from step 1;
    the marker file is never created. The old code resumed from step 3 and failed in check_resume with
    KeyError: 'config'.
    """
    from nanotrain.checkpoint import resume_checkpoint
    model, opts = setup()
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step, model, opts, resume_meta(), {"loader": {"step": step}})
    meta_file = tmp_path / "checkpoints" / "step_000003" / "meta.json"
    meta = json.load(open(meta_file))
    del meta["config"]
    json.dump(meta, open(meta_file, "w"))
    torch.save(Planted(tmp_path / "marker"), tmp_path / "checkpoints" / "step_000002" / "optim.pt")
    with pytest.warns(UserWarning) as record:
        ck = resume_checkpoint(str(tmp_path), "cpu")
    assert ck["meta"]["step"] == 1 and ck["rank_state"]["loader"] == {"step": 1}
    messages = [str(w.message) for w in record if "skipping unreadable checkpoint" in str(w.message)]
    assert len(messages) == 2 and all("\n" not in m for m in messages), messages
    assert "step_000003/meta.json lacks the key 'config'" in messages[0]
    assert "step_000002/optim.pt is not a plain tensor file" in messages[1]
    assert not (tmp_path / "marker").exists()


# ----------------------------------------------------------------------------- metrics.jsonl on resume
# (MetricsLog lives in nanotrain/training.py; it is here because it is what a resume reads besides the checkpoint)

@pytest.mark.parametrize("bad", ['[{"step": 1, "loss": 1.0}]', '{"loss": 2.0, "dt": 0.1}', '{"step": "2", "dt": 1}',
                                 '{"step": 2.0, "dt": 0.1}', '"step"', "3", "null", '{"step": true, "dt": 1}',
                                 '{"step": 2, "lo'])
def test_metrics_rows_that_are_not_objects_with_an_int_step_stop_the_resume_in_one_line(tmp_path, bad):
    """
    On resume, a metrics.jsonl line that is a JSON list, lacks "step", has a step that is not an int (a str, a
    float, a bool), or is torn in the middle of the file stops the resume with one UserError line naming file:line,
    and the file is left byte for byte as it was. A torn LAST line (a killed run's) is still dropped silently. The
    old code raised TypeError (a list) or KeyError: 'step'.
    """
    from nanotrain.errors import UserError
    from nanotrain.run import MetricsLog
    good = [{"step": 1, "loss": 5.0, "dt": 0.1}, {"step": 2, "loss": 4.0, "dt": 0.1}, {"step": 3, "loss": 3.0}]
    path = tmp_path / "metrics.jsonl"
    text = "\n".join([json.dumps(good[0]), json.dumps(good[1]), bad, json.dumps(good[2])]) + "\n"
    path.write_text(text)
    with pytest.raises(UserError, match=f"{path}:3: expected a JSON object with an int \"step\"") as info:
        MetricsLog(str(tmp_path), resume_step=2)
    assert "\n" not in str(info.value) and path.read_text() == text
    path.write_text("\n".join(json.dumps(r) for r in good) + '\n{"step": 4, "lo')  # a killed run's torn last row
    log = MetricsLog(str(tmp_path), resume_step=2)
    log.close()
    assert [json.loads(ln) for ln in path.read_text().splitlines()] == good[:2]


def test_metrics_rows_all_good_give_no_warning_and_a_last_row_without_newline_stays_a_row(tmp_path, capsys):
    """A clean log is resumed silently; a last complete row without its newline does not merge with the next row."""
    from nanotrain.run import MetricsLog
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 5.0, "dt": 0.1}\n{"step": 2, "loss": 4.0, "dt": 0.1}')
    log = MetricsLog(str(tmp_path), resume_step=3)
    log.log(step=3, loss=3.0, dt=0.1)
    log.close()
    assert [json.loads(ln)["step"] for ln in path.read_text().splitlines()] == [1, 2, 3]
    assert capsys.readouterr().err == ""
