"""--wandb_project without network, and where wandb's files go (nanotrain.run.start_wandb)."""

import os
import time

import pytest
from helpers import TINY_TRAIN, run_script

from nanotrain.errors import UserError
from nanotrain.run import open_run_log


def _files_under(path):
    return sorted(os.path.relpath(os.path.join(r, f), path) for r, _, fs in os.walk(path) for f in fs)


@pytest.mark.unit
def test_unreachable_server_is_one_line_and_files_stay_under_the_base_dir(base_dir, tmp_path, monkeypatch):
    """
    Online mode with a server that refuses the connection: one UserError line naming the flag, the server and
    WANDB_MODE=offline, in well under 30 s (wandb.init's own wait was 90 s and retries). Offline mode with HOME pointed
    at an empty folder: the run starts and nothing is written under HOME, its settings/cache under <base>/wandb/.
    Catches calling wandb.init without a check (a traceback after its timeout) and wandb's default dirs in $HOME.
    """
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR", "WANDB_MODE",
                "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        monkeypatch.setenv(var, "")  # recorded, so that what start_wandb sets is undone after the test
        monkeypatch.delenv(var)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = base_dir / "base" / "r"
    run_dir.mkdir(parents=True)
    t0 = time.time()
    with pytest.raises(UserError) as e:
        open_run_log(str(run_dir), {"wandb_project": "nt"}, None, True)
    msg = str(e.value)
    assert time.time() - t0 < 30 and "\n" not in msg
    assert "--wandb_project=nt: cannot reach the wandb server http://127.0.0.1:9" in msg and "WANDB_MODE=offline" in msg
    monkeypatch.setenv("WANDB_MODE", "offline")
    m = open_run_log(str(run_dir), {"wandb_project": "nt"}, None, True)
    m.log(step=0, loss=1.0)
    m.close()
    assert _files_under(home) == []
    assert os.environ["WANDB_CONFIG_DIR"] == str(base_dir / "wandb" / "config")
    assert os.listdir(run_dir / "wandb")


@pytest.mark.smoke
def test_base_train_without_network_is_one_line(base_dir):
    """base_train --wandb_project=nt with no route to the wandb server: exit 2 and one stderr line, within 30 s of
    the script's own start-up, nothing trained."""
    pytest.importorskip("wandb")
    env = {"WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_MODE": "online", "HOME": str(base_dir)}
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=2", "--wandb_project=nt", base_dir=base_dir,
                   env=env, timeout=120)
    lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("Overriding: ")]
    assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
    assert lines[0].startswith("error: --wandb_project=nt: cannot reach the wandb server")
    assert "step 00001" not in r.stdout
