"""What a resume restores: NumPy's RNG state with the others, and a checkpoint of an OSFT run without its osft.pt
skipped for the previous one like any other damaged file (nanotrain.common.rng_state, nanotrain.checkpoint)."""

import os
import warnings

import numpy as np
import pytest
import torch

from nanotrain.checkpoint import load_latest, resume_checkpoint, save_checkpoint
from nanotrain.common import rng_state, set_rng_state
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import setup_optimizers
from nanotrain.osft import OSFT

pytestmark = pytest.mark.unit

CONFIG = GPTConfig(max_seq_len=16, vocab_size=64, n_layer=1, n_head=1, n_kv_head=1, model_dim=32)


def test_numpy_rng_state_round_trips_through_a_checkpoint_file(tmp_path):
    """The saved state, written with torch.save and read back with weights_only=True, makes NumPy's global generator
    repeat its numbers (normal draws too: the cached Gaussian). Catches a state without NumPy's generator (the
    draws after a resume differ) and one whose arrays weights_only cannot load."""
    np.random.seed(3)
    np.random.standard_normal()  # leaves a cached Gaussian in the state
    torch.save(rng_state("cpu"), tmp_path / "rng.pt")
    want = (np.random.standard_normal(3), np.random.randint(0, 2**31, 4))
    np.random.seed(99)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True), "cpu")
    got = (np.random.standard_normal(3), np.random.randint(0, 2**31, 4))
    assert np.array_equal(want[0], got[0]) and np.array_equal(want[1], got[1])


def test_missing_osft_file_falls_back_to_the_previous_checkpoint(tmp_path):
    """
    Two checkpoints of a run with --osft_rank_ratio=0.5, osft.pt deleted from the newer: a resume takes step 1 with a
    warning naming osft.pt (as for a torn model.pt), not step 2 without its bases (which setup_osft refused, with no
    fallback). A run without OSFT does not need the file. Catches loading osft.pt only "when it exists".
    """
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    opts = setup_optimizers(model)
    osft = OSFT(model, 0.5, "attn,mlp")
    meta = {"config": {"osft_rank_ratio": 0.5}, "model_config": vars(CONFIG), "tokens_seen": 0, "train_time": 0.0}
    for step in (1, 2):
        path = save_checkpoint(str(tmp_path / "run"), step, model, opts, meta, {}, osft_state=osft.state_dict())
    os.remove(os.path.join(path, "osft.pt"))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ckpt = resume_checkpoint(str(tmp_path / "run"), "cpu")
    assert ckpt["meta"]["step"] == 1 and ckpt["osft"] is not None
    assert any("skipping unreadable checkpoint" in str(x.message) and "osft.pt is missing" in str(x.message)
               for x in w), [str(x.message) for x in w]
    plain = dict(meta, config={"osft_rank_ratio": 0.0})
    save_checkpoint(str(tmp_path / "plain"), 1, model, opts, plain, {})
    assert load_latest(str(tmp_path / "plain"), "cpu")["meta"]["step"] == 1
