"""Experiment logging: --wandb_project sends metrics.jsonl's rows to a wandb run (nanotrain.run.MetricsLog)."""

import glob
import json
import os
import sys

import pytest

from nanotrain.errors import UserError
from nanotrain.run import open_run_log

pytestmark = pytest.mark.unit


def test_missing_wandb_package_is_one_line(tmp_path, monkeypatch):
    """With --wandb_project set and no wandb package: UserError, one line naming the flag and the install command;
    without the flag nothing imports wandb."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(UserError) as e:
        open_run_log(str(tmp_path), {"wandb_project": "nt"}, None, True)
    assert "--wandb_project=nt" in str(e.value) and "pip install wandb" in str(e.value) and "\n" not in str(e.value)
    open_run_log(str(tmp_path), {"wandb_project": ""}, None, True).close()


def test_wandb_offline_run_gets_the_metrics_rows(tmp_path, monkeypatch):
    """WANDB_MODE=offline, the real package (pinned in requirements.txt): the run is created under <run_dir>/wandb
    named <stage>/<run>, and its summary holds the rows logged to metrics.jsonl (a step's row reaches the summary
    when the next step is logged). Catches rows sent to one of the two only. Skipped where wandb is not installed."""
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "base" / "r"
    run_dir.mkdir(parents=True)
    m = open_run_log(str(run_dir), {"wandb_project": "nt", "depth": 2}, None, True)
    assert m.wandb is not None and m.wandb.name == "base/r"
    m.log(step=0, val_bpb=3.5)
    m.log(step=1, loss=2.0, dt=0.1)
    m.log(step=2, loss=1.5, dt=0.1)
    summary = dict(m.wandb.summary)
    m.close()
    assert summary["loss"] == 2.0 and summary["val_bpb"] == 3.5
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": 0, "val_bpb": 3.5}, {"step": 1, "loss": 2.0, "dt": 0.1}, {"step": 2, "loss": 1.5, "dt": 0.1}]
    assert glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))


def test_every_training_stage_has_the_flag():
    """base_train, mid_train, chat_sft and chat_rl each define --wandb_project (off by default), the setting
    open_run_log reads: a stage without it would silently never log to wandb."""
    import ast

    from helpers import REPO
    for script in ("base_train.py", "mid_train.py", "chat_sft.py", "chat_rl.py"):
        tree = ast.parse(open(os.path.join(REPO, "scripts", script)).read())
        values = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                  if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
        assert values.get("wandb_project") == "", script
