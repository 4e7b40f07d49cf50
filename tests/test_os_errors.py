"""
The operating system's errors on a script's own paths (a full disk, a read-only file system, no permission, a file
where a directory belongs or the reverse), Ctrl-C, and the base directory: every script ends with ONE `error: ...`
line naming the path and what to do, a non-zero exit code and no temporary file (nanotrain.common.run_script,
os_error_line); a finished training stage whose report card cannot be written exits 0 with one `warning: ...` line.
Also: lone surrogates in a JSONL corpus, the --skip_bad_rows hint only where a script has the flag, matplotlib's
cache directory under the base directory.

Errors come from two places: injected into a script run as a subprocess (tests/inject_os_error.py makes a chosen
open/write/makedirs/replace raise as the system would), and real ones: a small tmpfs filled up and a read-only bind
mount, inside `unshare --user --map-root-user --mount` (tests skip, saying why, where that is not allowed). Root
ignores file permissions, so EACCES is always injected. The per-script matrix is in the slow tier; the default tier
keeps the in-process units, one real full disk (base_train) and the report card's warning end to end.
"""

import errno
import functools
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, TINY_TRAIN, TINY_VOCAB, run_script

from nanotrain.common import get_base_dir
from nanotrain.common import run_script as run_main
from nanotrain.errors import UserError, os_error_line

INJECT = os.path.join(REPO, "tests", "inject_os_error.py")
FAST = [*TINY_TRAIN, "--num_iterations=2"]  # the tiny base_train run, 2 steps


def error_lines(stderr, prefix="error:"):
    """The lines of `stderr` that start with `prefix`."""
    return [line for line in stderr.splitlines() if line.startswith(prefix)]


def assert_one_line(r, prefix="error:", code=None):
    """The script ended with exactly one `prefix` line on stderr, no traceback and (if given) exit code `code`, else
    a non-zero one. Returns that line."""
    lines = error_lines(r.stderr, prefix)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert len(lines) == 1, r.stderr[-3000:]
    assert r.returncode == code if code is not None else r.returncode != 0, (r.returncode, r.stderr[-2000:])
    return lines[0]


def temp_files(root):
    """Paths under `root` whose names mark an unfinished write (".tmp" in the name), symlinks not followed."""
    out = []
    for dirpath, dirnames, names in os.walk(root):
        out += [os.path.join(dirpath, n) for n in names + dirnames if ".tmp" in n]
    return out


def new_base(tmp_path, shared_base_dir, name="base", tokenizer=True):
    """A base dir linking the shared corpus (and tokenizer)."""
    base = tmp_path / name
    base.mkdir()
    os.symlink(shared_base_dir / "data", base / "data")
    if tokenizer:
        os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    return base


def run_injected(script, rules, *args, base_dir, env=None, timeout=300):
    """scripts/<script> with the OSErrors of `rules` injected (tests/inject_os_error.py), NANOTRAIN_BASE_DIR=base_dir."""
    full_env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    cmd = [sys.executable, INJECT, json.dumps(rules), os.path.join(REPO, "scripts", script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


@functools.lru_cache(maxsize=None)
def mount_problem():
    """None where this process may mount a tmpfs and a read-only bind mount in a user namespace, else why not."""
    probe = ("d=$(mktemp -d) && mount -t tmpfs -o size=64k tmpfs $d && mount --bind $d $d && "
             "mount -o remount,ro,bind $d && ! touch $d/x 2>/dev/null")
    try:
        r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", probe],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare is not available: {e}"
    return None if r.returncode == 0 else f"cannot mount in a user namespace here: {r.stderr.strip()[:200]}"


def run_mounted(setup, script, *args, base_dir, listing, env=None, timeout=300):
    """
    Runs scripts/<script> in a private mount namespace after the shell commands `setup` (which mount over paths
    under the test's tmp dir), then writes `find` of the base dir (as the script left it, inside the namespace) to
    the file `listing`. Skips the test where mounting is not allowed.
    """
    problem = mount_problem()
    if problem:
        pytest.skip(problem)
    full_env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    shell = f'set -e; {setup}; set +e; "$@"; rc=$?; find "{base_dir}" > "{listing}"; exit $rc'
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", shell, "sh", sys.executable,
           os.path.join(REPO, "scripts", script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)


def full_tmpfs(path, links=(), size="1m"):
    """Shell commands: a tmpfs of `size` on `path` holding the symlinks (name, target) of `links`, then filled up."""
    cmds = [f'mount -t tmpfs -o size={size} tmpfs "{path}"']
    cmds += [f'ln -s "{target}" "{path}/{name}"' for name, target in links]
    cmds.append(f'(cat /dev/zero > "{path}/filler") 2>/dev/null || true')
    return " && ".join(cmds)


def read_only(path):
    return f'mount --bind "{path}" "{path}" && mount -o remount,ro,bind "{path}"'


# ----------------------------------------------------------------------------- the one line: units

@pytest.mark.parametrize("code,trains,expect", [
    (errno.ENOSPC, True, "then run again with --resume=True"),
    (errno.EDQUOT, False, "free some space"),
    (errno.EROFS, False, "point NANOTRAIN_BASE_DIR"),
    (errno.EACCES, False, "fix the permissions"),
    (errno.EPERM, False, "fix the permissions"),
])
def test_os_error_line_names_the_path_and_what_to_do(tmp_path, monkeypatch, code, trains, expect):
    """Each errno of the user's environment gives one line with the path, the system's reason and the advice; the
    --resume=True advice only for a training script. Catches a line without the path (the write error of a full disk
    carries none unless named), advice of the wrong errno, or --resume suggested to scripts that do not train."""
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    path = str(tmp_path / "run" / "metrics.jsonl")
    line = os_error_line(OSError(code, os.strerror(code), path), trains=trains)
    assert line.startswith(f"{path}: {os.strerror(code)} ({errno.errorcode[code]}): ") and expect in line
    assert "\n" not in line and ("--resume=True" in line) == (trains and code == errno.ENOSPC)


def test_os_error_line_says_what_kind_of_thing_is_in_the_way(tmp_path):
    """EISDIR names the directory where a file belongs; ENOTDIR names the ancestor that is a file (not the path the
    system reported); EEXIST a file where a directory belongs; a rename's error names its target (filename2). Any
    other errno is no line (a traceback). Catches naming the reported path for ENOTDIR, the vanished temp file of a
    rename, or swallowing an unexpected OSError."""
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    d, f = str(tmp_path / "d"), str(tmp_path / "f")
    assert os_error_line(IsADirectoryError(errno.EISDIR, "Is a directory", d)) == (
        f"{d}: Is a directory (EISDIR): that is a directory where a file is expected: move it away, then run again")
    deep = os.path.join(f, "checkpoints", "step_000001")
    assert f"{f} is a regular file where a directory is expected" in os_error_line(
        NotADirectoryError(errno.ENOTDIR, "Not a directory", deep))
    assert os_error_line(FileExistsError(errno.EEXIST, "File exists", f)).startswith(
        f"{f}: File exists (EEXIST): that is a regular file where a directory is expected")
    line = os_error_line(OSError(errno.EISDIR, "Is a directory", f + ".tmp123", None, d))
    assert line.startswith(f"{d}: ") and ".tmp123" not in line
    assert os_error_line(OSError(errno.EIO, "Input/output error", f)) is None
    assert os_error_line(ValueError("x")) is None


def test_run_script_ends_os_errors_and_ctrl_c_with_one_line(capsys):
    """run_script: an OSError of the environment exits 1 with one `error:` line, KeyboardInterrupt exits 130 with one
    line (a training script's says --resume=True), another OSError keeps its traceback (propagates). Catches exit
    code 0 or 2 for these, a second line, or a real I/O error hidden behind a line."""
    def raising(exc):
        def main():
            raise exc
        return main
    with pytest.raises(SystemExit) as e:
        run_main(raising(OSError(errno.ENOSPC, "No space left on device", "/x/metrics.jsonl")), trains=True)
    err = capsys.readouterr().err
    assert e.value.code == 1 and err.count("\n") == 1 and err.startswith("error: /x/metrics.jsonl: No space")
    assert "--resume=True" in err
    with pytest.raises(SystemExit) as e:
        run_main(raising(KeyboardInterrupt()))
    assert e.value.code == 130 and capsys.readouterr().err == "error: interrupted (Ctrl-C)\n"
    with pytest.raises(SystemExit) as e:
        run_main(raising(KeyboardInterrupt()), trains=True)
    err = capsys.readouterr().err
    assert e.value.code == 130 and err.count("\n") == 1 and "second Ctrl-C" in err and "--resume=True" in err
    with pytest.raises(OSError, match="Input/output"):
        run_main(raising(OSError(errno.EIO, "Input/output error", "/x")))


# ----------------------------------------------------------------------------- the base directory

def test_base_dir_relative_is_made_absolute_and_a_file_is_one_error(tmp_path, monkeypatch):
    """A relative NANOTRAIN_BASE_DIR is resolved against the current directory (so a message names where it looked);
    a regular file there, or a file on its path, is a UserError naming it, not a FileExistsError traceback. Catches
    returning the relative path, or letting makedirs' OSError through."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", "rel/base")
    assert get_base_dir() == str(tmp_path / "rel" / "base") and os.path.isdir(tmp_path / "rel" / "base")
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", "file")
    with pytest.raises(UserError, match=f"{tmp_path / 'file'} .*is a regular file, not a directory"):
        get_base_dir()
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", "file/below")
    with pytest.raises(UserError, match=f"cannot create the base directory {tmp_path / 'file' / 'below'}.*"
                                        f"{tmp_path / 'file'} is a regular file where a directory is expected"):
        get_base_dir()


# ----------------------------------------------------------------------------- run directory, metrics, lock

def test_lock_is_a_directory_raises_its_os_error_and_holds_nothing(tmp_path):
    """A run's .lock that is a directory: lock_run_dir raises IsADirectoryError naming it (run_script's one line),
    not a traceback from inside the lock, and holds no lock (a later call after moving it away takes it). Catches
    remembering a lock that was never taken."""
    from nanotrain.run import lock_run_dir
    (tmp_path / ".lock").mkdir()
    with pytest.raises(IsADirectoryError) as e:
        lock_run_dir(str(tmp_path), "cpu")
    assert e.value.filename == str(tmp_path / ".lock")
    os.rmdir(tmp_path / ".lock")
    lock_run_dir(str(tmp_path), "cpu")
    assert "pid" in (tmp_path / ".lock").read_text()


class _FullDisk:
    """An open file whose writes and flushes fail as on a full disk (ENOSPC, no file name)."""

    def __init__(self, file):
        self.file, self.closed_by_log = file, False

    @property
    def closed(self):
        return self.file.closed

    def write(self, s):
        raise OSError(errno.ENOSPC, "No space left on device")

    flush = writelines = write

    def close(self):
        self.closed_by_log = True
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_metrics_log_full_disk_names_the_file_and_a_failed_resume_rewrite_leaves_no_temp(tmp_path, monkeypatch):
    """MetricsLog.log on a full disk raises ENOSPC naming metrics.jsonl and closes the file (a row that cannot be
    written is not retried at exit, which would print a second message); a resume's rewrite that fails removes its
    metrics.jsonl.tmp. Catches the nameless write error, an open file left behind, or the temp file left."""
    import nanotrain.run as run
    log = run.MetricsLog(str(tmp_path))
    log.file = full = _FullDisk(log.file)
    with pytest.raises(OSError) as e:
        log.log(step=1, loss=1.0, dt=0.1)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "metrics.jsonl")
    assert full.closed_by_log and log.file.closed
    log.log(step=2, loss=1.0, dt=0.1)  # closed: nothing more is written (the script is already ending)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0, "dt": 0.1}\n')

    def failing_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return _FullDisk(f) if "w" in mode else f
    monkeypatch.setattr(run, "open", failing_open, raising=False)
    with pytest.raises(OSError) as e:
        run.MetricsLog(str(tmp_path), resume_step=1)
    assert e.value.filename == str(tmp_path / "metrics.jsonl") and temp_files(tmp_path) == []


def test_cache_entry_that_is_a_directory_is_refused_before_the_search(tmp_path, monkeypatch):
    """The auto batch size's cache: an entry that is a directory, or a cache directory that is a file, raises the
    OSError naming it when the cache is read, before the (long) search, not when the result is written. Catches the
    old order: a warning at the read, the whole search, then a traceback at the write."""
    from nanotrain.auto_batch_size.cache import read_cached
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    key = {"candidates": [1, 2]}
    from nanotrain.auto_batch_size.cache import cache_path
    os.makedirs(cache_path(key))
    with pytest.raises(IsADirectoryError) as e:
        read_cached(key, 1e9, log=print)
    assert e.value.filename == cache_path(key)
    os.rmdir(cache_path(key))
    os.rmdir(os.path.dirname(cache_path(key)))
    (tmp_path / "auto_batch_cache").write_text("x")
    with pytest.raises(NotADirectoryError) as e:
        read_cached(key, 1e9, log=print)
    assert e.value.filename == str(tmp_path / "auto_batch_cache")
    assert "is a regular file where a directory is expected" in os_error_line(e.value)


# ----------------------------------------------------------------------------- the report card

def test_report_card_that_cannot_be_written_is_a_warning_and_leaves_no_temp_png(tmp_path, monkeypatch, capsys):
    """write_section_or_warn: a PNG write failing on a full disk (matplotlib writes through an open file: no file name)
    is one `warning:` line naming the PNG and how to write the card later, returns None, and leaves no temp PNG.
    Catches the old 0-byte temp file left behind, or the error escaping (a finished run exiting 1)."""
    import matplotlib.figure

    from nanotrain.report.card import write_section_or_warn
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    run_dir = tmp_path / "base" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "dt": 0.1, "tok_per_sec": 5.0}\n')

    def savefig(self, fname, **kwargs):
        open(fname, "wb").close()  # created, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    assert write_section_or_warn("r", "base", str(run_dir), {"wall_time_s": 1.0}) is None
    err = capsys.readouterr().err
    assert len(error_lines(err, "warning:")) == 1 and err.count("\n") == 1
    assert str(tmp_path / "report" / "r" / "base_loss.png") in err and "python -m nanotrain.report r" in err
    assert temp_files(tmp_path) == []


def test_report_card_matplotlib_cache_goes_under_the_base_dir(tmp_path, monkeypatch):
    """use_plot_cache_dir sets MPLCONFIGDIR to <base>/matplotlib when unset and keeps a user's value. Catches
    matplotlib writing its font cache under $HOME (the default), or overriding the user's choice."""
    from nanotrain.report.plots import use_plot_cache_dir
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    monkeypatch.delenv("MPLCONFIGDIR", raising=False)
    use_plot_cache_dir()
    assert os.environ["MPLCONFIGDIR"] == str(tmp_path / "matplotlib")
    monkeypatch.setenv("MPLCONFIGDIR", "/mine")
    use_plot_cache_dir()
    assert os.environ["MPLCONFIGDIR"] == "/mine"


@pytest.mark.smoke
@pytest.mark.slow  # ~12 s with its set-up; test_report_card_that_cannot_be_written_is_a_warning_and_leaves_no_temp_png
# keeps the warning and the clean-up in the default run
def test_finished_run_with_a_full_disk_at_the_report_card_exits_0(shared_base_dir, tmp_path):
    """End to end: base_train whose report card PNG cannot be written (injected full disk) trains, saves its final
    checkpoint and exits 0 with one `warning:` line and no temp file; matplotlib wrote nothing under $HOME but its
    cache under the base dir. Catches the old exit 1 with a traceback and a 0-byte temp PNG, and caches in $HOME."""
    base = new_base(tmp_path, shared_base_dir)
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "MPLCONFIGDIR": "", "XDG_CACHE_HOME": "", "XDG_CONFIG_HOME": ""}
    r = run_injected("base_train.py", [{"call": "write", "match": "base_loss.png", "errno": "ENOSPC"}], *FAST,
                     "--run_name=r", base_dir=base, env=env)
    line = assert_one_line(r, "warning:", code=0)
    assert "base_loss.png: No space left on device" in line and "error:" not in r.stderr
    assert os.path.isdir(base / "base" / "r" / "checkpoints" / "step_000002")
    assert temp_files(base) == [] and os.listdir(home) == [] and os.path.isdir(base / "matplotlib")


@pytest.mark.smoke
def test_full_disk_real_tmpfs_base_train_is_one_line(shared_base_dir, tmp_path):
    """A real full file system (a filled 1 MiB tmpfs as the base dir): base_train exits 1 with one `error:` line
    naming a file under the base dir and the advice, no traceback and no temp file. Catches any write of the start of
    a run (lock, config.json) that escapes as a traceback or leaves its temp file."""
    base = tmp_path / "base"
    base.mkdir()
    listing = tmp_path / "listing"
    setup = full_tmpfs(base, [("data", shared_base_dir / "data"), ("tokenizer", shared_base_dir / "tokenizer")])
    r = run_mounted(setup, "base_train.py", *FAST, "--run_name=r", base_dir=base, listing=listing)
    line = assert_one_line(r, code=1)
    assert line.startswith(f"error: {base}/") and "No space left on device (ENOSPC)" in line
    assert "free some space" in line and ".tmp" not in listing.read_text()


# ----------------------------------------------------------------------------- Ctrl-C

def _interrupt(code, signals, wait_for="ready"):
    """Runs `python -c code`, waits for `wait_for` on stdout, sends SIGINT `signals` times; returns (rc, stderr)."""
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=REPO)
    try:
        while wait_for not in p.stdout.readline():
            assert p.poll() is None, p.stderr.read()
        for _ in range(signals):
            p.send_signal(signal.SIGINT)
            time.sleep(0.2)
        _, err = p.communicate(timeout=30)
    finally:
        p.kill()
    return p.returncode, err


def test_ctrl_c_during_start_up_is_one_line_and_130():
    """A Ctrl-C while a script starts up (nanotrain.interrupt imported first, torch still loading) or exits (after
    main(), in an atexit handler) ends it with one line and 130; in a training script (nanotrain.stop) the first asks
    to stop and the second ends it so. Catches a KeyboardInterrupt traceback (or "Exception ignored in atexit
    callback"), exit code 0 or 1, or the first Ctrl-C of a training script ending it."""
    rc, err = _interrupt("import nanotrain.interrupt, time; print('ready'); time.sleep(30)", 1)
    assert rc == 130 and err.strip() == "error: interrupted (Ctrl-C)"
    rc, err = _interrupt("import nanotrain.stop, time; print('ready'); time.sleep(30)", 2)
    assert rc == 130 and "Traceback" not in err and len(error_lines(err)) == 1 and "second Ctrl-C" in err
    rc, err = _interrupt("import nanotrain.stop, time; print('ready'); time.sleep(1)", 1)
    assert rc == 0 and err == ""  # one signal: only a request to stop
    # after main() returned, while the process exits (atexit handlers): one line too, not "Exception ignored ..."
    rc, err = _interrupt("import nanotrain.interrupt, atexit, time; from nanotrain.common import run_script; "
                         "atexit.register(lambda: (print('ready', flush=True), time.sleep(30))); "
                         "run_script(lambda: None)", 1)
    assert rc == 130 and err.strip() == "error: interrupted (Ctrl-C)"


# ----------------------------------------------------------------------------- lone surrogates, --skip_bad_rows

def test_lone_surrogate_in_a_jsonl_corpus_becomes_u_fffd_for_every_reader(tmp_path):
    """A JSONL document with a lone surrogate escape (valid JSON) reads as U+FFFD, a pair of escapes as its one
    character; the tokenizer then trains on it (rustbpe refuses a str that is not valid Unicode) and encodes it as
    base_train's loader would. Catches passing the surrogate through (tok_train crashed) or dropping the document."""
    from nanotrain.dataset import iter_documents
    from nanotrain.tokenizer import Tokenizer
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "a\\ud800b"}\n{"text": "smile \\ud83d\\ude00 ok"}\n')
    texts = [t for _, t in iter_documents([str(path)])]
    assert texts == ["a\ufffdb", "smile \U0001F600 ok"]
    tok = Tokenizer.train_from_iterator(iter(texts * 20), 270)
    assert tok.decode(tok.encode(texts[0])) == "a\ufffdb"


def test_skip_bad_rows_is_suggested_only_where_the_script_has_the_flag(tmp_path):
    """A bad JSONL row's error suggests --skip_bad_rows=True for chat_sft (which passes its flag, False by default),
    never for mid_train and chat_eval, which have no such flag (they call without it). Catches suggesting a flag the
    script refuses as unknown."""
    from nanotrain.tasks.jsonl import load_jsonl
    from nanotrain.tasks.registry import load_task_mixture
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": []}\n')
    with pytest.raises(UserError) as e:
        load_jsonl(str(path))  # chat_eval
    assert str(e.value).startswith(f"{path}:1: ") and "--skip_bad_rows" not in str(e.value)
    with pytest.raises(UserError) as e:
        load_task_mixture(f"jsonl:{path}", "train", 0)  # mid_train
    assert "--skip_bad_rows" not in str(e.value)
    with pytest.raises(UserError, match=r"--skip_bad_rows=True skips such lines"):
        load_task_mixture(f"jsonl:{path}", "train", 0, False)  # chat_sft


# ----------------------------------------------------------------------------- the per-script matrix (slow)

@pytest.fixture(scope="module")
def trained(shared_base_dir, tmp_path_factory):
    """A base dir (linking the shared corpus and tokenizer) with a 2-step base run named 'tiny'."""
    base = tmp_path_factory.mktemp("os_trained")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    r = run_script("base_train.py", *FAST, "--run_name=tiny", base_dir=base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base


# every script with arguments that make it quick, and whether it writes into the base dir
SCRIPTS = {
    "base_train.py": ([*FAST, "--run_name=new"], True),
    "mid_train.py": (["--num_iterations=1", "--device_batch_size=2", "--total_batch_size=128", "--eval_every=-1",
                      "--eval_tokens=128", "--sample_every=-1", "--save_every=-1", "--tasks=arith:1"], True),
    "chat_sft.py": (["--source=base", "--num_iterations=1", "--examples_per_step=2",
                     "--eval_every=-1", "--tasks=arith:1"], True),
    "tok_train.py": ([f"--vocab_size={TINY_VOCAB}", "--max_chars=20000"], True),
    "chat_eval.py": (["--source=base", "--max_problems=2", "--max_tokens=4", "--tasks=arith"], True),
    "base_eval.py": ([f"--eval_bundle={os.path.join(REPO, 'tests', 'data', 'core_bundle')}", "--own_eval_bundle=True",
                     "--max_per_task=1"], True),
    "export.py": (["--source=base", "--verify=False"], True),
    "sample.py": (["--max_tokens=4"], False),
    "chat_cli.py": (["--source=base", "-p", "hi", "--max_tokens=4"], False),
    "bench.py": (["--depth=1", "--max_seq_len=32", "--device_batch_size=2", "--total_batch_size=64",
                  "--warmup_steps=1", "--steps=1"], False),
    "auto_batch_plan.py": (["--depths=1", "--max_seq_len=32", "--vocab_size=512", "--total_batch_size=64"], False),
}


@pytest.mark.slow  # the default run covers the one line (test_full_disk_real_tmpfs_base_train_is_one_line) and
# the base directory (test_base_dir_relative_is_made_absolute_and_a_file_is_one_error)
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_script_read_only_base_dir_and_base_dir_a_file(script, trained, shared_base_dir, tmp_path):
    """Every script on a read-only base dir (a real read-only bind mount holding a trained run; tok_train's without
    the tokenizer link, which leads out of the mount): the scripts that write there exit 1 with one `error:` line
    naming a path under it and NANOTRAIN_BASE_DIR; the others (which only read) succeed. NANOTRAIN_BASE_DIR that is
    a regular file: one `error:` line naming it, exit 2, in every script. Catches a traceback from any script's first
    write, or a reader refusing a read-only directory."""
    args, writes = SCRIPTS[script]
    listing = tmp_path / "listing"
    base = new_base(tmp_path, shared_base_dir, tokenizer=False) if script == "tok_train.py" else trained
    r = run_mounted(read_only(base), script, *args, base_dir=base, listing=listing)
    if writes:
        line = assert_one_line(r, code=1)
        assert f"{base}/" in line and "Read-only file system (EROFS)" in line and "NANOTRAIN_BASE_DIR" in line
    else:
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert ".tmp" not in listing.read_text()
    (tmp_path / "file").write_text("x")
    r = run_script(script, *args, base_dir=tmp_path / "file")
    if script == "auto_batch_plan.py":  # it reads and writes nothing under the base dir
        assert r.returncode == 0, r.stderr[-3000:]
        return
    line = assert_one_line(r, code=2)
    assert f"{tmp_path / 'file'} (NANOTRAIN_BASE_DIR) is a regular file, not a directory" in line


@pytest.mark.slow  # the default run covers the one line for EACCES (test_os_error_line_names_the_path_and_what_to_do)
@pytest.mark.parametrize("script,rule", [
    ("base_train.py", {"call": "makedirs", "match": "/base/new", "errno": "EACCES"}),
    ("mid_train.py", {"call": "makedirs", "match": "/mid/", "errno": "EACCES"}),
    ("chat_sft.py", {"call": "makedirs", "match": "/sft/", "errno": "EPERM"}),
    ("tok_train.py", {"call": "open", "match": "tokenizer.json", "errno": "EACCES"}),
    ("chat_eval.py", {"call": "open", "match": "chat_eval.json", "errno": "EACCES"}),
    ("export.py", {"call": "makedirs", "match": "/export", "errno": "EACCES"}),
])
def test_every_writing_script_permission_denied_is_one_line(script, rule, trained, shared_base_dir, tmp_path):
    """EACCES/EPERM (injected: root ignores permissions) on each writing script's own path: one `error:` line naming
    that path (not a temp file's name) and the advice, exit 1, no temp file. Catches a traceback, or a line naming a
    temp file that no longer exists."""
    args, _ = SCRIPTS[script]
    # tok_train writes its own tokenizer dir, never the shared one
    base = new_base(tmp_path, shared_base_dir, tokenizer=False) if script == "tok_train.py" else trained
    r = run_injected(script, [rule], *args, base_dir=base)
    line = assert_one_line(r, code=1)
    assert f"({rule['errno']}): fix the permissions" in line and rule["match"] in line and ".tmp" not in line
    assert temp_files(base) == []


@pytest.mark.slow  # the default run covers a full disk end to end (test_full_disk_real_tmpfs_base_train_is_one_line)
@pytest.mark.parametrize("script", ["tok_train.py", "export.py", "chat_eval.py"])
def test_full_disk_real_tmpfs_tok_train_export_chat_eval(script, trained, shared_base_dir, tmp_path):
    """A real full tmpfs under what each script writes: tok_train's tokenizer (the base dir), export's --out, and
    chat_eval's chat_eval.json (the run copied onto a tmpfs, then filled): one `error:` line naming the file, exit 1,
    no temp file. Catches safetensors' SafetensorError, a nameless write error, or a leftover temp file."""
    args, _ = SCRIPTS[script]
    listing = tmp_path / "listing"
    if script == "tok_train.py":
        base = tmp_path / "base"
        base.mkdir()
        setup = full_tmpfs(base, [("data", shared_base_dir / "data")])
        expect = f"{base}/tokenizer"
    elif script == "export.py":
        base, out = trained, tmp_path / "out"
        out.mkdir()
        args = [*args, f"--out={out}/model.safetensors"]
        setup = full_tmpfs(out)
        expect = f"{out}/model.safetensors: No space left on device"
    else:
        base = tmp_path / "base"
        base.mkdir()
        setup = (f'mount -t tmpfs -o size=32m tmpfs "{base}" && cp -a "{trained}/." "{base}/" && '
                 f'(cat /dev/zero > "{base}/filler") 2>/dev/null || true')
        expect = f"{base}/base/tiny/chat_eval.json: No space left on device"
    r = run_mounted(setup, script, *args, base_dir=base, listing=listing)
    line = assert_one_line(r, code=1)
    assert expect in line and "free some space" in line and "--resume" not in line
    assert ".tmp" not in listing.read_text()
    if script == "export.py":
        assert os.listdir(tmp_path / "out") == []  # the mount is gone: nothing written below it either


@pytest.mark.slow  # the default run covers the kinds of path in the way (test_os_error_line_says_what_kind_...) and
# the lock (test_lock_is_a_directory_raises_its_os_error_and_holds_nothing)
def test_paths_of_the_wrong_kind_in_scripts(trained, shared_base_dir, tmp_path):
    """A file or directory in the way, end to end, each one line and a non-zero exit without a traceback: base_train
    with its .lock a directory; base_train with its run's `checkpoints` a file (refused before the first step by
    run.get_run_dir, not at the first save after the training); base_train --auto_batch_size=True with the cache directory a
    file; export with --out a directory; metrics.jsonl on a full disk in the middle of training (says
    --resume=True). Catches tracebacks from these paths, and a line that does not name the path."""
    base = new_base(tmp_path, shared_base_dir)
    run = base / "base" / "r"
    run.mkdir(parents=True)
    (run / ".lock").mkdir()
    line = assert_one_line(run_script("base_train.py", *FAST, "--run_name=r", base_dir=base), code=1)
    assert f"{run / '.lock'}: Is a directory (EISDIR): that is a directory where a file is expected" in line
    os.rmdir(run / ".lock")
    (run / "checkpoints").write_text("x")
    r = run_script("base_train.py", *FAST, "--run_name=r", base_dir=base)
    line = assert_one_line(r, code=1)
    assert f"{run / 'checkpoints'}: Not a directory (ENOTDIR): that is a regular file where a directory is" in line
    assert "step 00001" not in r.stdout
    os.remove(run / "checkpoints")
    (base / "auto_batch_cache").write_text("x")
    r = run_script("base_train.py", *[a for a in FAST if not a.startswith("--device_batch_size")], "--run_name=r",
                   "--auto_batch_size=True", "--device_memory_gb=1", base_dir=base)
    line = assert_one_line(r, code=1)
    assert f"{base / 'auto_batch_cache'}: Not a directory (ENOTDIR): that is a regular file where a" in line
    os.remove(base / "auto_batch_cache")
    (tmp_path / "outdir").mkdir()
    r = run_script("export.py", "--source=base", "--run_name=tiny", f"--out={tmp_path / 'outdir'}", base_dir=trained)
    line = assert_one_line(r, code=1)
    assert f"{tmp_path / 'outdir'}: Is a directory (EISDIR): that is a directory where a file is" in line
    assert temp_files(tmp_path / "outdir") == [] and temp_files(trained) == []
    r = run_injected("base_train.py", [{"call": "write", "match": "metrics.jsonl", "errno": "ENOSPC"}], *FAST,
                     "--run_name=m", base_dir=base)
    line = assert_one_line(r, code=1)
    assert f"{base}/base/m/metrics.jsonl: No space left on device" in line and "--resume=True" in line
    assert temp_files(base) == []


@pytest.mark.slow  # the default run covers Ctrl-C during the start-up and run_script's KeyboardInterrupt
# (test_ctrl_c_during_start_up_is_one_line_and_130, test_run_script_ends_os_errors_and_ctrl_c_with_one_line)
def test_ctrl_c_in_the_middle_of_scripts(trained, tmp_path):
    """Ctrl-C while the script works: base_train's second Ctrl-C during a step ends it at once (no checkpoint of that
    step), one line, 130; bench (no nanotrain.stop) ends with one line and 130. Catches the KeyboardInterrupt
    traceback and base_train finishing the step and saving after the second Ctrl-C."""
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(trained), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    slow_steps = ["--depth=2", "--max_seq_len=64", "--device_batch_size=1", "--total_batch_size=4096",
                  "--num_iterations=50", "--eval_every=-1", "--sample_every=-1", "--save_every=-1",
                  "--run_name=ctrlc"]
    for cmd, wait_for, signals, expect in [
            (["base_train.py", *slow_steps], "step 00001", 2, "second Ctrl-C before the checkpoint of the step in "
                                                                "progress was written (this run wrote none)"),
            (["bench.py", "--depth=1", "--max_seq_len=32", "--device_batch_size=1", "--total_batch_size=32",
              "--steps=100000", "--warmup_steps=0"], "Overriding: steps", 1, "interrupted (Ctrl-C)")]:
        p = subprocess.Popen([sys.executable, os.path.join(REPO, "scripts", cmd[0]), *cmd[1:]], env=env, cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            out = []
            while wait_for not in (out[-1] if out else ""):
                out.append(p.stdout.readline())
                assert out[-1] or p.poll() is None, "".join(out)
            time.sleep(0.0 if signals == 2 else 3.0)
            for _ in range(signals):
                p.send_signal(signal.SIGINT)
                time.sleep(0.05)
            rest, _ = p.communicate(timeout=60)
        finally:
            p.kill()
        text = "".join(out) + rest
        assert p.returncode == 130 and "Traceback" not in text, text[-3000:]
        assert len(error_lines(text)) == 1 and expect in error_lines(text)[0]
        if cmd[0] == "base_train.py":
            assert not os.path.exists(os.path.join(trained, "base", "ctrlc", "checkpoints")), text[-2000:]
