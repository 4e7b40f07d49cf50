"""
The report card's PNG plots (matplotlib, Agg) of a run's metrics.jsonl: the losses and the validation metric, RL's
reward and sample length, tokens/s, each against the step. Written atomically; matplotlib keeps its caches in
<base_dir>/matplotlib unless MPLCONFIGDIR is set.
"""

import json
import os

from nanotrain.common import get_base_dir
from nanotrain.errors import UserError, replacing


def read_metrics(run_dir):
    """
    The rows of <run_dir>/metrics.jsonl split into (train rows, val rows): train rows have "loss" and "dt" (seconds),
    val rows "val_bpb", "val_loss" or (RL) "eval_pass1". Missing file -> ([], []). A torn last line (a run killed
    mid-write) is skipped; a corrupt line elsewhere raises UserError naming file:line.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        lines = f.read().splitlines()
    train, val = [], []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                continue
            raise UserError(f"{path}:{i + 1}: not a JSON object") from None
        if "loss" in row and "dt" in row:
            train.append(row)
        if "val_bpb" in row or "val_loss" in row or "eval_pass1" in row:
            val.append(row)
    return train, val



def _save_png(fig, out_dir, name, written):
    """Lays out `fig`, saves it to <out_dir>/<name> through a temp file and os.replace, closes it and appends `name`
    to `written`; on any error the temp file is removed and the error raised (an OSError without a file name, e.g. a
    full disk, then names the PNG)."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    with replacing(os.path.join(out_dir, name), ".png") as tmp:
        fig.savefig(tmp, dpi=100)
    plt.close(fig)
    written.append(name)


def use_plot_cache_dir():
    """
    Points matplotlib's config and cache directory (MPLCONFIGDIR) at <base_dir>/matplotlib unless the user set it, so
    the report card writes nothing under $HOME. Must run before matplotlib is imported (it reads the variable then).
    """
    if not os.environ.get("MPLCONFIGDIR"):
        os.environ["MPLCONFIGDIR"] = os.path.join(get_base_dir(), "matplotlib")


def write_plots(run_dir, out_dir, stage):
    """
    Writes <out_dir>/<stage>_loss.png (train loss and the validation metric against the step: RL's is the held-out
    pass@1), <out_dir>/<stage>_reward.png (RL: mean reward and mean sample length against the step) and
    <out_dir>/<stage>_tokens_per_sec.png (tokens/s against the step) from <run_dir>/metrics.jsonl, each only when
    there is something to plot. Returns the list of file names written. matplotlib's caches go under the base
    directory (use_plot_cache_dir).
    """
    use_plot_cache_dir()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = read_metrics(run_dir)
    written = []
    if train or val:
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        if train:
            axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
        # RL's loss is REINFORCE's surrogate (advantage-weighted log-probabilities), not a cross-entropy in nats
        loss_label = "policy loss (REINFORCE surrogate)" if stage == "rl" else "train loss (nats/token)"
        axes[0].set(xlabel="step", ylabel=loss_label, title=f"{stage}: {loss_label.split(' (')[0]}")
        key = next((k for k in ("val_bpb", "val_loss", "eval_pass1") if any(k in r for r in val)), "val_loss")
        rows = [r for r in val if key in r]
        if rows:
            axes[1].plot([r["step"] for r in rows], [r[key] for r in rows], "o-", color="tab:orange")
        label = {"eval_pass1": "held-out pass@1"}.get(key, key.replace("_", " "))
        axes[1].set(xlabel="step", ylabel=label, title=f"{stage}: {label}")
        if key == "eval_pass1":  # an accuracy: the whole [0, 1] range, so one point is not drawn on a zoomed axis
            axes[1].set_ylim(-0.02, 1.02)
        if len(rows) == 1 and train:  # one evaluation: the x axis still spans the run's steps
            axes[1].set_xlim(0, max(r["step"] for r in train + rows) or 1)
        _save_png(fig, out_dir, f"{stage}_loss.png", written)
    rows = [r for r in train if "reward" in r]
    if rows:  # RL: the mean reward and the mean sample length per step
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        axes[0].plot([r["step"] for r in rows], [r["reward"] for r in rows], lw=1)
        axes[0].set(xlabel="step", ylabel="mean reward", title=f"{stage}: reward of the samples")
        axes[1].plot([r["step"] for r in rows], [r["mean_length"] for r in rows], lw=1, color="tab:green")
        axes[1].set(xlabel="step", ylabel="tokens", title=f"{stage}: mean sample length")
        _save_png(fig, out_dir, f"{stage}_reward.png", written)
    rows = [r for r in train if "tok_per_sec" in r]
    if rows:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        ax.plot([r["step"] for r in rows], [r["tok_per_sec"] for r in rows], lw=1)
        ax.set(xlabel="step", ylabel="tokens/s", title=f"{stage}: training throughput")
        ax.set_ylim(bottom=0)
        _save_png(fig, out_dir, f"{stage}_tokens_per_sec.png", written)
    return written
