"""
safetensors export (nanotrain/export/safetensors_file.py, scripts/export.py): an exported model reloads with equal logits.
"""

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import TINY_TRAIN, run_script
from safetensors import safe_open

from nanotrain.errors import UserError
from nanotrain.export.safetensors_file import FORMAT, export_safetensors, load_safetensors
from nanotrain.gpt import GPT, GPTConfig

# n_kv_head == n_head: the attention matrices are square, so a transposed one would load without a shape error
TINY = GPTConfig(max_seq_len=16, vocab_size=96, n_layer=2, n_head=2, n_kv_head=2, model_dim=32, smear=True, backout=True,
                 x0_lambdas=True)  # every model option on


def trained_like_model(seed=0):
    """A tiny GPT with every weight random and non-zero (the zero-initialised projections would hide a swapped or
    transposed matrix)."""
    torch.manual_seed(seed)
    model = GPT(TINY)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.eval()


def logits(model):
    idx = torch.arange(2 * TINY.max_seq_len).view(2, -1) * 7 % TINY.vocab_size
    with torch.no_grad():
        return model(idx)


@pytest.mark.unit
def test_round_trip_equal_logits(tmp_path):
    """
    fp32 export -> load gives torch.equal logits, from the plain model, from its torch.compile wrapper (keys
    "_orig_mod.*") and from a DDP-style state dict ("module._orig_mod.*"); the file holds the plain names, fp32,
    and the metadata (format, model config, dtype, version, extra entries). Catches lost untied weights (a loader
    that ties lm_head to wte), transposed matrices, a silent cast to a smaller dtype and unstripped wrapper prefixes;
    the tied and transposed variants are run below and must not give equal logits.
    """
    model = trained_like_model()
    ref = logits(model)
    sd = model.state_dict()
    sources = {"plain": model, "compiled": torch.compile(model),
               "ddp": {f"module._orig_mod.{k}": v for k, v in sd.items()}}
    for name, src in sources.items():
        path = export_safetensors(src, TINY, str(tmp_path / name / "model.safetensors"), metadata={"note": "x"})
        loaded, config = load_safetensors(path)
        assert config == TINY and not loaded.training
        assert torch.equal(logits(loaded), ref), name
        with safe_open(path, framework="pt") as f:
            assert sorted(f.keys()) == sorted(sd) and f.get_tensor("wte.weight").dtype == torch.float32
            meta = f.metadata()
        assert meta["format"] == FORMAT and json.loads(meta["model_config"]) == vars(TINY)
        assert meta["dtype"] == "float32" and meta["note"] == "x" and meta["nanotrain_version"]
    assert os.listdir(tmp_path / "plain") == ["model.safetensors"]  # no temporary file left behind

    wrong = {"tied": dict(sd, **{"lm_head.weight": sd["wte.weight"].clone()}),
             "transposed": dict(sd, **{"blocks.0.attn.c_q.weight": sd["blocks.0.attn.c_q.weight"].t()})}
    for name, state in wrong.items():
        loaded, _ = load_safetensors(export_safetensors(state, TINY, str(tmp_path / f"{name}.safetensors")))
        assert not torch.equal(logits(loaded), ref), name


@pytest.mark.unit
def test_bfloat16_export_within_rounding(tmp_path):
    """
    dtype=torch.bfloat16 stores bf16 tensors (metadata dtype "bfloat16"); the reloaded fp32 weights are the bf16
    roundings (|w' - w| <= 2^-8 |w| elementwise, round to nearest: 2^-9), not all equal, and the logits are close
    but not equal. Catches an export that ignores dtype (equal logits, twice the size) or that rounds more coarsely
    (e.g. through float16's range or an int cast), and a loader that keeps bf16 weights (the GPT expects fp32 ones).
    """
    model = trained_like_model()
    path = export_safetensors(model, TINY, str(tmp_path / "m.safetensors"), dtype=torch.bfloat16)
    with safe_open(path, framework="pt") as f:
        assert f.metadata()["dtype"] == "bfloat16" and f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    loaded, _ = load_safetensors(path)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        assert q.dtype == torch.float32
        assert ((q - p).abs() <= 2**-8 * p.abs()).all(), name
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters()))
    a, b = logits(model), logits(loaded)
    assert not torch.equal(a, b)
    torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)


@pytest.mark.unit
def test_missing_corrupt_or_foreign_files_raise_user_error(tmp_path):
    """
    A missing file, a truncated one, random bytes, a safetensors file without nanotrain's metadata, and weights that do
    not fit the model config each raise UserError naming the file (not a safetensors/torch traceback). Catches a
    loader that trusts the header and builds a model from whatever tensors it finds.
    """
    path = export_safetensors(trained_like_model(), TINY, str(tmp_path / "ok.safetensors"))
    data = open(path, "rb").read()
    bad = {"missing.safetensors": None, "truncated.safetensors": data[: len(data) // 2],
           "garbage.safetensors": os.urandom(64)}
    for name, content in bad.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    meta = {"format": FORMAT, "model_config": json.dumps(dict(vars(TINY), n_layer=3))}
    save_file({k: v.contiguous() for k, v in trained_like_model().state_dict().items()},
              str(tmp_path / "mismatch.safetensors"), metadata=meta)
    for name in [*bad, "foreign.safetensors", "mismatch.safetensors"]:
        with pytest.raises(UserError, match=re.escape(str(tmp_path / name))):
            load_safetensors(str(tmp_path / name))
    with pytest.raises(UserError, match="do not match the model config"):
        export_safetensors({"wte.weight": torch.zeros(1)}, TINY, str(tmp_path / "x.safetensors"))


@pytest.mark.smoke
@pytest.mark.slow  # the default run keeps the in-process export, reload and errors (test_round_trip_equal_logits, ...)
def test_export_script_end_to_end(base_dir):
    """
    base_train 2 steps -> scripts/export.py --source=base writes <run_dir>/export/model.safetensors whose reloaded
    model gives torch.equal logits to the checkpoint loaded by nanotrain.checkpoint.load_model (the script verifies the
    same and says so), with the tokenizer hash and the source checkpoint in the metadata. A corrupt checkpoint
    gives one `error:` line naming its directory and exit code 2 (not a traceback).
    """
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=2", "--run_name=t", base_dir=base_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.copytree(os.path.join(base_dir, "base", "t"), os.path.join(base_dir, "base", "broken"))
    broken = os.path.join(base_dir, "base", "broken", "checkpoints", "step_000002")
    with open(os.path.join(broken, "model.pt"), "r+b") as f:
        f.truncate(100)
    with ThreadPoolExecutor(2) as pool:  # two single-threaded processes side by side
        fp32, bad = pool.map(lambda a: run_script("export.py", "--source=base", *a, base_dir=base_dir),
                             [["--run_name=t"], ["--run_name=broken"]])
    assert fp32.returncode == 0, fp32.stderr[-3000:]
    assert "verified: reloaded logits equal" in fp32.stdout
    path = os.path.join(base_dir, "base", "t", "export", "model.safetensors")
    from nanotrain.checkpoint import load_model
    from nanotrain.tokenizer import get_tokenizer
    model, _, ckpt_path, _ = load_model("base", "t")
    loaded, config = load_safetensors(path)
    idx = torch.arange(32).view(2, 16)
    with torch.no_grad():
        assert torch.equal(model(idx), loaded(idx))
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    assert meta["tokenizer_sha256"] == get_tokenizer().fingerprint()
    assert meta["source_checkpoint"] == ckpt_path and meta["step"] == "2"

    errors = [ln for ln in bad.stderr.splitlines() if not ln.startswith("Overriding: ")]
    assert bad.returncode == 2 and len(errors) == 1, bad.stderr[-3000:]
    assert errors[0].startswith("error: cannot read the checkpoint ") and broken in errors[0]
