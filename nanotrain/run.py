"""
A run directory's life (<base_dir>/<stage>/<run>/): created and locked by the one process that trains it
(lock_run_dir), its config.json and metrics.jsonl (open_run_log, MetricsLog), the step's log line (step_log_line),
and the end of a stage (finish_run: the replica check under DDP, the summary; the scripts then write the report card).
What is inside checkpoints/ is nanotrain.checkpoint's.
"""

import contextlib
import errno
import json
import math
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

from nanotrain.common import all_reduce_scalar, any_rank, atomic_write_json, get_base_dir, is_distributed, print0
from nanotrain.downloads import behind_proxy, check_reachable
from nanotrain.errors import UserError, os_errors_name, replacing
from nanotrain.fsdp import is_fsdp

try:  # POSIX (Linux, macOS); elsewhere runs are not locked
    import fcntl
except ImportError:
    fcntl = None

LOCK_FILE = ".lock"
_held_locks = {}  # real path of a run directory -> the open lock file this process holds until it exits


def get_run_dir(stage, run):
    """
    <base_dir>/<stage>/<run>, created if missing. stage is "base", "mid", "sft" or "rl". Raises NotADirectoryError
    (ENOTDIR, naming the path; nanotrain.common.run_script prints it as one line) when its checkpoints/ exists but is
    not a directory: found before the training, not at its first save.
    """
    path = os.path.join(get_base_dir(), stage, run)
    os.makedirs(path, exist_ok=True)
    ckpts = os.path.join(path, "checkpoints")
    if os.path.lexists(ckpts) and not os.path.isdir(ckpts):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), ckpts)
    return path


def lock_run_dir(run_dir, device, rank=0):
    """
    Makes this process the only writer of `run_dir` until it exits: rank 0 takes an exclusive fcntl.flock on
    <run_dir>/.lock and writes its pid, host, start time and command line into it. The kernel releases the lock
    however the process ends (SIGKILL included), so a finished or killed run never blocks the next one. Collective
    under DDP (every rank calls it; `device` carries the agreement, so every rank raises when rank 0 fails). Taking it
    again in the same process is a no-op.
    Raises UserError naming the holder (pid, host, start, command) when another process holds the lock. Raises the
    OSError on rank 0 when the lock file cannot be opened or written (a directory named .lock, a read-only or full
    file system; the lock is then not held), and UserError on the other ranks.
    """
    key = os.path.realpath(run_dir)
    taken, holder, error = True, "", None
    if rank == 0 and fcntl is not None and key not in _held_locks:
        path = os.path.join(run_dir, LOCK_FILE)
        f = None
        try:
            f = open(path, "a+")
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            taken = False
        except OSError as exc:
            error = exc
        if taken and error is None:
            try:
                with os_errors_name(path):
                    f.seek(0)
                    f.truncate()
                    f.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                            f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(sys.argv)}\n")
                    f.flush()
                _held_locks[key] = f
            except OSError as exc:
                error = exc
        if error is not None and f is not None:
            with contextlib.suppress(OSError):  # the unwritten line of a full disk fails again on close
                f.close()
    state = int(all_reduce_scalar(2 if error is not None else 0 if taken else 1, "max", device))  # 1: held, 2: error
    if error is not None:
        raise error
    if state == 2:
        raise UserError(f"the run directory {run_dir} could not be locked on rank 0 (see its error)")
    if state == 1:
        raise UserError(f"the run directory {run_dir} is in use by {holder or 'another process'}; wait for it to "
                        f"end or choose another --run_name")


class MetricsLog:
    """
    metrics.jsonl in the run directory, one JSON object per line, written by rank 0. A fresh run starts it empty; a
    resumed run keeps the rows before the step it resumes from and that step's training row (rows with "dt"); the
    evaluation rows of that step and everything later are dropped, because the resumed run evaluates at its first
    step again (the saving run may or may not have: a regular save comes before the evaluation, a stop request
    saves and leaves before it), so every evaluation appears exactly once.

    On resume, an unparseable last line is the torn row of a killed run and is dropped. Any other line that is not a
    JSON object with an int "step" (a file rewritten as one JSON list, rows of another tool) cannot be placed before
    or after the resume step: the resume stops with UserError naming file:line, before anything is changed, so the
    user decides what becomes of those rows (repair or remove them, then resume again).
    """

    def __init__(self, run_dir, resume_step=None, master=True):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.file = None
        self.wandb = None  # a wandb run receiving the same rows (open_run_log with settings["wandb_project"])
        if not master:
            return
        if resume_step is None:
            if os.path.exists(self.path):
                os.remove(self.path)
        elif os.path.exists(self.path):
            with open(self.path, encoding="utf-8", errors="surrogateescape") as f:
                lines = [(n, ln if ln.endswith("\n") else ln + "\n") for n, ln in enumerate(f, 1) if ln.strip()]
            keep = []
            for i, (number, line) in enumerate(lines):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    if i == len(lines) - 1:  # the torn last row of a killed run
                        continue
                    row = None
                if not (isinstance(row, dict) and type(row.get("step")) is int):
                    raise UserError(f"{self.path}:{number}: expected a JSON object with an int \"step\", got "
                                    f"{line.strip()[:60]!r}; nothing was changed: repair or remove that line, then "
                                    f"resume again")
                if row["step"] < resume_step or (row["step"] == resume_step and "dt" in row):
                    keep.append(line)
            with replacing(self.path) as tmp, open(tmp, "w", encoding="utf-8", errors="surrogateescape") as f:
                f.writelines(keep)
        self.file = open(self.path, "a")

    def log(self, **row):
        """
        Appends `row` (JSON) as one line, flushed. A value that is a float but not finite (NaN, inf) is written as
        it is, never silently: one warning line on stderr names the field, the step and the file. Raises an OSError
        naming the file when it cannot be written (a full disk); the file is then closed, and a resume drops the torn
        last line.
        """
        bad = [k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad and self.file is not None:
            print(f"warning: {', '.join(f'{k}={row[k]}' for k in bad)} at step {row.get('step')} written to "
                  f"{self.path}: not a finite number", file=sys.stderr, flush=True)
        if self.file is not None and not self.file.closed:
            try:
                with os_errors_name(self.path):
                    self.file.write(json.dumps(row) + "\n")
                    self.file.flush()
            except OSError:
                self.close()
                raise
            if self.wandb is not None:
                self.wandb.log({k: v for k, v in row.items() if k != "step" and v is not None}, step=row.get("step"))

    def close(self):
        """Closes the file; a row that still cannot be written (a full disk) is dropped: the file is closed anyway."""
        if self.file is not None and not self.file.closed:
            with contextlib.suppress(OSError):
                self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def open_run_log(run_dir, settings, resume_step, master, device=None):
    """
    The start of a stage's records: prints the run directory and (rank 0) the final settings, writes them to
    <run_dir>/config.json atomically, and returns the MetricsLog of the run (resume_step: the step a resumed run
    continues from, None for a fresh run). With `device` (the scripts pass theirs) it is collective under DDP: when
    rank 0 fails (an OSError such as a full or read-only disk, or the UserError of a metrics.jsonl it refuses), every
    rank raises, rank 0 its own error and the others UserError, instead of the others waiting in the next collective.
    """
    print0(f"Run directory: {run_dir}")
    error, metrics = None, None
    try:
        metrics = MetricsLog(run_dir, resume_step, master)  # first: one it refuses leaves config.json as it was
        if master:
            print0("Config: " + json.dumps(settings, sort_keys=True))
            atomic_write_json(os.path.join(run_dir, "config.json"), settings)
            if settings.get("wandb_project"):
                metrics.wandb = start_wandb(settings["wandb_project"], run_dir, settings)
    except (OSError, UserError) as exc:
        error = exc
        if metrics is not None:
            metrics.close()
    if device is not None and any_rank(error is not None, device) and error is None:
        raise UserError(f"rank 0 could not open the records of {run_dir} (see its error)")
    if error is not None:
        raise error
    return metrics


WANDB_DIRS = {"WANDB_CONFIG_DIR": "config", "WANDB_CACHE_DIR": "cache", "WANDB_DATA_DIR": "data",
              "WANDB_ARTIFACT_DIR": "artifacts"}  # wandb's files outside the run, under <base_dir>/wandb/
WANDB_TIMEOUT_S = 5.0  # the TCP check of the wandb server, and (x4) wandb's own wait for its run to start


def start_wandb(project, run_dir, settings):
    """
    A Weights & Biases run in `project` named <stage>/<run> (the run directory's last two parts), its files under
    run_dir/wandb, `settings` as its config; wandb's other files (settings, cache, artifacts) under
    <base_dir>/wandb/ unless the WANDB_*_DIR variables say otherwise, never $HOME. WANDB_MODE=offline keeps it on disk.
    Online, the server (WANDB_BASE_URL, default https://api.wandb.ai) is first checked with a TCP connection of at
    most WANDB_TIMEOUT_S seconds (not behind a proxy, where that check cannot be made). Raises UserError (one line,
    within ~30 s) when the wandb package is not installed, the server cannot be reached, or wandb.init fails (no API
    key, a refused login, its own timeout).
    """
    try:
        import wandb
    except ImportError:
        raise UserError(f"--wandb_project={project}: the wandb package is not installed (pip install wandb==0.31.0), "
                        f"or leave --wandb_project empty") from None
    for var, sub in WANDB_DIRS.items():
        os.environ.setdefault(var, os.path.join(get_base_dir(), "wandb", sub))
    hint = "set WANDB_MODE=offline to keep the run on disk (wandb sync later), or leave --wandb_project empty"
    mode = os.environ.get("WANDB_MODE", "online").strip().lower()
    if mode not in ("offline", "disabled", "dryrun"):
        server = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
        if not behind_proxy(server):
            try:
                check_reachable(server, WANDB_TIMEOUT_S)
            except (OSError, ValueError) as e:
                raise UserError(f"--wandb_project={project}: cannot reach the wandb server {server} (offline? {e}); "
                                f"{hint}") from None
    name = "/".join(os.path.normpath(os.path.abspath(run_dir)).split(os.sep)[-2:])
    try:
        return wandb.init(project=project, name=name, dir=run_dir, config=settings,
                          settings=wandb.Settings(init_timeout=4 * WANDB_TIMEOUT_S))
    except Exception as e:  # wandb's errors have no common base: no API key, a refused login, a timeout
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"--wandb_project={project}: wandb could not start its run ({type(e).__name__}: {reason}); "
                        f"{hint}") from None


def finish_run(model, run_dir, metrics, summary):
    """
    The end of a training stage: checks that DDP replicas agree (check_replicas), prints the stage's summary line
    and where the outputs are, and closes the metrics log. The script then writes its section of the report card
    (nanotrain.report.card.write_section_or_warn: the periphery, which this module does not import).
    """
    check_replicas(model)
    print0(summary)
    print0(f"Outputs: {run_dir} (base dir {get_base_dir()})")
    metrics.close()


def save_due(step, last_step, save_every, resume_step=None):
    """
    True if a stage's loop saves a checkpoint at `step` (checked first thing at each step, before its evaluation, so
    that a crash there never loses the training): at the last step (the end, or a stop request), and every
    `save_every` steps (<= 0: never), except at step 0 and at `resume_step`, the step a resumed run starts from,
    whose checkpoint exists already (None: a fresh run). The one rule every stage saves by.
    """
    return step != 0 and (last_step or (save_every > 0 and step % save_every == 0 and step != resume_step))


def check_replicas(model):
    """
    Under DDP: compares a float64 checksum of every parameter across ranks and raises RuntimeError if any rank's
    parameters differ (replica drift). Returns the checksum (float); a no-op returning None without DDP. Under FSDP2
    (sharded parameters, no replicas; a full_tensor() is the same all-gather on every rank) nothing is compared: it
    prints a note, waits at a barrier like the DDP path and returns None.
    """
    if not is_distributed():
        return None
    if is_fsdp(model):
        print0("Replica check: skipped under FSDP (parameters are sharded across ranks, not replicated)")
        dist.barrier()
        return None
    with torch.no_grad():
        checksum = sum((p.double().flatten() * torch.linspace(1, 2, p.numel(), dtype=torch.float64,
                        device=p.device)).sum() for p in model.parameters())
    sums = [torch.zeros_like(checksum) for _ in range(dist.get_world_size())]
    dist.all_gather(sums, checksum)
    if any(s.item() != sums[0].item() for s in sums):
        raise RuntimeError(f"parameters differ across ranks: checksums {[s.item() for s in sums]}")
    print0(f"Replica check: parameters identical on all {len(sums)} ranks (checksum {sums[0].item():.10e})")
    dist.barrier()  # every rank is done communicating before any of them tears the process group down
    return sums[0].item()


class ETA:
    """
    The time left of a run, steady: the steps left times the mean wall time of this process's steps after its first
    `skip` (compilation, warm-up and the first save make those slow; until then, the mean of every step but the
    first), as nanochat's log estimates it from the mean step time rather than the last step's. update(step, dt)
    takes the step just finished (1-based, of total_steps) and its seconds, and returns the seconds left (float).
    """

    def __init__(self, total_steps, skip=5):
        self.total_steps, self.skip = total_steps, skip
        self.times = []

    def update(self, step, dt):
        self.times.append(dt)
        steady = self.times[self.skip:] or self.times[1:] or self.times
        return (self.total_steps - step) * sum(steady) / len(steady)


def step_log_line(step, total_steps, *, loss, grad_norm, lrm, dt, tokens, flops_per_token, peak_flops, world_size,
                  eta_s=None):
    """
    The one-line log of optimizer step `step` of `total_steps` and its metrics row (a dict: step, loss, lrm, dt,
    tok_per_sec, mfu). loss: the global mean (float); grad_norm: float or None (not shown); lrm: the lr multiplier;
    dt: the step's wall time in seconds; tokens: the tokens of the step on all ranks; flops_per_token: training FLOPs
    per token; peak_flops: one device's peak FLOP/s, None where it is not known (the line says "mfu n/a" and the row's
    mfu is None: never a guessed peak); eta_s: the seconds left (ETA.update), None: the steps left times
    dt. Returns (line, row).
    """
    tok_per_sec = tokens / dt
    mfu = None if peak_flops is None else flops_per_token * tokens / dt / (peak_flops * world_size)
    eta = (total_steps - step) * dt if eta_s is None else eta_s
    gn = f" | grad norm {grad_norm:.3f}" if grad_norm is not None else ""
    mfu_s = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
    line = (f"step {step:05d}/{total_steps:05d} ({100 * step / total_steps:.1f}%) | loss {loss:.6f}{gn} | "
            f"lrm {lrm:.3f} | dt {dt * 1000:.1f}ms | tok/s {tok_per_sec:,.0f} | mfu {mfu_s} | "
            f"eta {eta / 60:.1f}m")
    row = dict(step=step, loss=loss, lrm=lrm, dt=dt, tok_per_sec=tok_per_sec, mfu=mfu)
    return line, row
