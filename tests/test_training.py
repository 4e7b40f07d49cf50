"""Tests of nanotrain.training: gradient accumulation in base_train's step, the metrics log (the lr and momentum
schedules as literal tables: tests/test_schedule_oracles.py)."""

import json
from contextlib import nullcontext

import pytest
import torch
from helpers import grads, rel, tiny_model

from nanotrain.muon import Muon
from nanotrain.run import MetricsLog
from nanotrain.training import forward_backward, micro_batches, muon_momentum

pytestmark = pytest.mark.unit


def test_grad_accumulation_equals_full_batch():
    """
    forward_backward (base_train's step) over 8 rows in micro-batches of 8, 4 and 2 (accumulation 1, 2, 4) gives the
    same gradient within 1e-6 relative in fp32. The wrong variant, accumulating the per-micro-batch mean losses without
    dividing by the number of micro-batches, is exercised too and must be off by the accumulation factor.
    """
    torch.manual_seed(1)
    x = torch.randint(0, 64, (8, 16))
    y = torch.randint(0, 64, (8, 16))
    model = tiny_model()
    loss1 = forward_backward(model, micro_batches(x, y, 8), nullcontext())
    ref = grads(model)
    for micro in (4, 2):
        model.zero_grad(set_to_none=True)
        loss = forward_backward(model, micro_batches(x, y, micro), nullcontext())
        assert rel(grads(model), ref) < 1e-6
        assert abs(loss.item() - loss1.item()) < 1e-6
    # counter-example: no division by the number of micro-batches
    model.zero_grad(set_to_none=True)
    for i in range(4):
        model(x[2 * i:2 * i + 2], y[2 * i:2 * i + 2]).backward()
    assert rel(grads(model), ref) > 1.0


def test_forward_backward_rejects_ragged_split():
    model = tiny_model()
    with pytest.raises(ValueError):
        forward_backward(model, micro_batches(torch.zeros(6, 16, dtype=torch.long),
                                              torch.zeros(6, 16, dtype=torch.long), 4), nullcontext())


def test_muon_momentum_ramp():
    assert muon_momentum(0) == pytest.approx(0.85)
    assert muon_momentum(150) == pytest.approx(0.90)
    assert muon_momentum(300) == muon_momentum(10_000) == pytest.approx(0.95)


def test_metrics_log_resume_drops_later_rows(tmp_path):
    """A resumed run keeps the rows up to its step and drops the later ones (they are logged again)."""
    log = MetricsLog(str(tmp_path))
    for s in range(1, 6):
        log.log(step=s, loss=float(s), dt=0.1)
    log.close()
    log = MetricsLog(str(tmp_path), resume_step=3)
    log.log(step=4, loss=40.0, dt=0.1)
    log.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]
    MetricsLog(str(tmp_path)).close()  # a fresh run starts empty
    assert open(tmp_path / "metrics.jsonl").read() == ""


@pytest.mark.unit
def test_metrics_log_resume_keeps_each_evaluation_once(tmp_path):
    """
    Resuming at step k keeps the rows before k and step k's training row, and drops step k's evaluation and every
    later row (the resumed run evaluates at k again), so each evaluation appears once whether the saving run
    evaluated at k (a regular save) or not (a stop request). A torn last line is skipped. Catches: keeping rows
    `<= k` (a duplicate val row after a resume at an eval step) or skipping the eval at k (a missing one).
    """
    rows = [{"step": 0, "val_bpb": 3.0}, {"step": 1, "loss": 5.0, "dt": 0.1}, {"step": 2, "loss": 4.0, "dt": 0.1},
            {"step": 2, "val_bpb": 2.5}, {"step": 3, "loss": 3.0, "dt": 0.1}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "lo')
    log = MetricsLog(str(tmp_path), resume_step=2)
    log.log(step=2, val_bpb=2.5)  # what the resumed run does first
    log.close()
    got = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert got == rows[:4]


def test_grad_accum_steps_and_the_batch_arithmetic_error():
    """
    grad_accum_steps_for: 4096 tokens of 8 rows x 256 tokens on 1 rank is 2 micro-batches; 4096 over 2 ranks of
    8 x 128 is 2. A total that does not divide is one UserError naming the nearest valid totals and nearby valid
    device batch sizes (worked by hand: 5000 / (3 * 256) -> 4608 or 5376; 4096 / 256 = 16 rows, divisors near 3 are
    2, 4, 1). Catches a division that floors silently (5000 // 768 = 6 steps of the wrong size), a check that forgets
    world_size, and a zero or negative size reaching the division.
    """
    from nanotrain.errors import UserError
    from nanotrain.training import grad_accum_steps_for
    assert grad_accum_steps_for(4096, 8, 256, 1) == 2
    assert grad_accum_steps_for(4096, 8, 128, 2) == 2
    with pytest.raises(UserError, match=r"= 8 \* 256 \* 4 = 8192; nearest valid: --total_batch_size=8192, or "):
        grad_accum_steps_for(4096, 8, 256, 4)  # the world size counts: 4 ranks need 8192 tokens per step
    with pytest.raises(UserError) as e:
        grad_accum_steps_for(5000, 3, 256, 1)
    assert "nearest valid: --total_batch_size=4608 or 5376" in str(e.value)
    with pytest.raises(UserError) as e:
        grad_accum_steps_for(4096, 3, 256, 1)
    assert "--device_batch_size in [1, 2, 4] (divisors of 4096 / (256 * 1) = 16)" in str(e.value)
    with pytest.raises(UserError, match="must be positive"):
        grad_accum_steps_for(4096, 0, 256, 1)


# ----------------------------------------------------------------------------- the loop's small pieces, by hand

def test_forward_backward_returns_the_mean_loss_of_all_rows():
    """
    The returned loss over 8 rows in 2 micro-batches equals the model's mean loss on all 8 rows at once (computed
    directly, no accumulation). Catches a running sum that subtracts, or a mean over the micro-batches' count
    missing; the ragged-split error names both numbers.
    """
    torch.manual_seed(2)
    x, y = torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16))
    model = tiny_model()
    with torch.no_grad():
        want = model(x, y).item()
    got = forward_backward(model, micro_batches(x, y, 4), nullcontext())
    assert got.shape == () and abs(got.item() - want) < 1e-6
    with pytest.raises(ValueError, match="6 rows do not split into micro-batches of 4"):
        forward_backward(model, micro_batches(x[:6], y[:6], 4), nullcontext())


def test_forward_backward_syncs_gradients_only_in_the_last_micro_step(one_rank_mesh, monkeypatch, capsys):
    """
    Under DDP (one gloo rank) require_backward_grad_sync is False for every micro-step but the last (seen by a
    forward hook: [False, False, True] for 3 micro-steps); under FSDP2 set_requires_gradient_sync gets the same
    sequence; optimizer_step returns FSDP2's gradient norm as a plain tensor, and the FSDP model's replica check is
    skipped with a note. Catches syncing every micro-step, none, or the wrong one (an off-by-one in "last"), and a
    DTensor norm handed back to the loop.
    """
    from nanotrain.fsdp import shard_model
    from nanotrain.run import check_replicas
    from nanotrain.training import optimizer_step

    x, y = torch.randint(0, 64, (6, 16)), torch.randint(0, 64, (6, 16))
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_model())
    seen = []
    ddp.module.register_forward_pre_hook(lambda m, a: seen.append(ddp.require_backward_grad_sync))
    forward_backward(ddp, micro_batches(x, y, 2), nullcontext())
    assert seen == [False, False, True]
    fsdp = shard_model(tiny_model(), torch.device("cpu"), torch.float32)
    calls, real = [], fsdp.set_requires_gradient_sync
    monkeypatch.setattr(fsdp, "set_requires_gradient_sync", lambda flag: (calls.append(flag), real(flag))[1])
    forward_backward(fsdp, micro_batches(x, y, 2), nullcontext())
    assert calls == [False, False, True]
    sgd = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    sgd.param_groups[0]["initial_lr"] = 0.1
    norm = optimizer_step(fsdp, [sgd], 1.0, 0.95, 1.0)  # FSDP2's norm is a DTensor: made plain
    assert type(norm) is torch.Tensor and torch.isfinite(norm) and norm > 0
    capsys.readouterr()
    assert check_replicas(fsdp) is None
    assert capsys.readouterr().out == "Replica check: skipped under FSDP (parameters are sharded across ranks, not " \
                                      "replicated)\n"


def test_optimizer_step_sets_lr_and_momentum_clips_and_drops_the_gradients():
    """
    Hand-worked: gradients [[3, 0], [0, 0]] (Muon) and [0, 4] (SGD, lr 0.1) have global norm 5. With lrm 0.5 and
    grad_clip 1 the SGD step is -0.05 * [0, 4] / 5 = [0, -0.04]; without clipping -0.05 * [0, 4] = [0, -0.2]. Each
    group's lr becomes initial_lr * lrm, Muon's momentum the given one (SGD's own momentum setting is left alone),
    the norm returned is the one before clipping, and the gradients are dropped (None). A non-finite norm changes
    no parameter and no state (decided on the device for Muon; torch's SGD steps after a host read) and drops the
    gradients. Catches clipping with the wrong norm or not at all, lr not rescaled from
    initial_lr, momentum written into every optimizer, the clipped norm returned, gradients kept for the next step.
    """
    from nanotrain.training import optimizer_step

    def setup():
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(2, 2))
        model.b = torch.nn.Parameter(torch.zeros(2))
        muon = Muon([model.w], lr=0.2, momentum=0.5, ns_dtype="float32")
        sgd = torch.optim.SGD([model.b], lr=0.1)
        for opt in (muon, sgd):
            for group in opt.param_groups:
                group["initial_lr"] = group["lr"]
        model.w.grad = torch.tensor([[3.0, 0.0], [0.0, 0.0]])
        model.b.grad = torch.tensor([0.0, 4.0])
        return model, muon, sgd

    for clip, moved in ((1.0, -0.04), (0.0, -0.2)):
        model, muon, sgd = setup()
        norm = optimizer_step(model, [muon, sgd], 0.5, 0.9, clip)
        assert norm.dtype == torch.float32 and abs(norm.item() - 5.0) < 1e-6
        torch.testing.assert_close(model.b.detach(), torch.tensor([0.0, moved]))
        assert muon.param_groups[0]["lr"] == pytest.approx(0.1) and sgd.param_groups[0]["lr"] == pytest.approx(0.05)
        assert muon.param_groups[0]["momentum"] == 0.9 and sgd.param_groups[0]["momentum"] == 0
        w = model.w.detach()
        assert w[0, 0] < 0 and torch.count_nonzero(w) == 1  # Muon moved only the entry with a gradient
        assert model.w.grad is None and model.b.grad is None
    model, muon, sgd = setup()
    model.b.grad[0] = float("nan")
    norm = optimizer_step(model, [muon, sgd], 0.5, 0.9, 1.0)
    assert not torch.isfinite(norm)
    assert torch.count_nonzero(model.w) == 0 and torch.count_nonzero(model.b) == 0
    assert all(torch.count_nonzero(t) == 0 for t in muon.state[model.w].values())  # no momentum taken either
    assert model.w.grad is None and model.b.grad is None


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_names_the_step_and_the_run(value):
    """A NaN or infinite loss/grad norm is one UserError naming what, the value, the step and the checkpoints' place;
    finite values (0, large) pass. Catches a check that lets -inf through or forgets the step."""
    from nanotrain.errors import UserError
    from nanotrain.training import check_finite

    check_finite(0.0, 3, "/runs/x")
    check_finite(1e30, 3, "/runs/x")
    with pytest.raises(UserError, match=rf"non-finite grad norm {value} at step 7; .* /runs/x/checkpoints is intact"):
        check_finite(value, 7, "/runs/x", what="grad norm")
    with pytest.raises(UserError, match="non-finite loss"):
        check_finite(value, 7, "/runs/x")


def test_step_log_line_by_hand():
    """
    Step 5 of 55, loss 2.5, grad norm 0.5, lrm 0.75, 12 s for 24,000 tokens on 5 devices of 1e10 FLOP/s at 5e6
    FLOPs/token: 2,000 tokens/s, MFU 5e6 * 2,000 / (5 * 1e10) = 20%, eta 50 steps * 12 s = 10.0 min. Without a grad
    norm the field is left out. Catches MFU not divided by the world size, tokens/s or eta from the wrong
    quantities, and wrong units (ms, %, minutes).
    """
    from nanotrain.run import step_log_line

    kw = dict(loss=2.5, lrm=0.75, dt=12.0, tokens=24_000, flops_per_token=5e6, peak_flops=1e10, world_size=5)
    line, row = step_log_line(5, 55, grad_norm=0.5, **kw)
    assert line == ("step 00005/00055 (9.1%) | loss 2.500000 | grad norm 0.500 | lrm 0.750 | dt 12000.0ms | "
                    "tok/s 2,000 | mfu 20.0% | eta 10.0m")
    assert row == dict(step=5, loss=2.5, lrm=0.75, dt=12.0, tok_per_sec=2000.0, mfu=pytest.approx(0.2))
    line, _ = step_log_line(9, 10, grad_norm=None, **kw)
    assert line.startswith("step 00009/00010 (90.0%) | loss 2.500000 | lrm 0.750 |") and line.endswith("eta 0.2m")


def test_eta_is_steady_through_a_slow_step():
    """
    run.ETA on 100 steps: a 30 s first step (compilation), then 1 s steps, one of them (step 12) 25 s (a save). By
    hand: after step 3 the mean of steps 2-3 is 1 s, 97 s left; after step 12 the steps after the first 5 are six of
    1 s and one of 25 s, mean 31/7 s, so 88 * 31 / 7 = 389.71 s left (the last step alone would say 88 * 25 = 2,200 s);
    after step 50, 45 steps with one of 25 s: mean 69/45, 50 * 69 / 45 = 76.67 s. The log line prints it in minutes.
    Catches an ETA from the last step's time (the jump the CPU recipe printed) and one that counts the first step.
    """
    from nanotrain.run import ETA, step_log_line

    eta = ETA(100)
    left = {}
    for step in range(1, 51):
        dt = 30.0 if step == 1 else 25.0 if step == 12 else 1.0
        left[step] = eta.update(step, dt)
    assert left[3] == pytest.approx(97.0)
    assert left[12] == pytest.approx(88 * 31 / 7)
    assert left[50] == pytest.approx(50 * 69 / 45)
    kw = dict(loss=2.5, lrm=0.75, dt=25.0, tokens=24_000, flops_per_token=5e6, peak_flops=1e10, world_size=5)
    assert step_log_line(12, 100, grad_norm=None, eta_s=left[12], **kw)[0].endswith("eta 6.5m")


def test_precision_resolves_the_dtype_setting(monkeypatch):
    """
    --dtype="": bf16 autocast on CUDA and on a CPU whose bf16 matmuls are fast (as nanotrain.common.fast_bf16 finds), fp32 and
    no autocast on a slow-bf16 CPU and on other devices; an explicit dtype is used without measuring; anything else
    is a UserError naming --dtype. Catches a measurement made for an explicit dtype, autocast left on for fp32, and
    a CUDA default that depends on the CPU's measurement.
    """
    import warnings

    import nanotrain.training as training
    from nanotrain.errors import UserError

    for measured, want in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)):
        monkeypatch.setattr(training, "fast_bf16", lambda device, m=measured: m == torch.bfloat16 if device.type == "cpu"
                            else None)
        dtype, ctx = training.precision("", torch.device("cpu"))
        assert dtype == want
        if want == torch.bfloat16:
            assert isinstance(ctx, torch.autocast) and ctx.device == "cpu" and ctx.fast_dtype == torch.bfloat16
        else:
            assert isinstance(ctx, nullcontext)

    def refuse(device):
        raise AssertionError("measured")
    monkeypatch.setattr(training, "fast_bf16", refuse)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # autocast warns that CUDA is not available; only its settings are checked
        dtype, ctx = training.precision("", torch.device("cuda"))
    assert dtype == torch.bfloat16 and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
    assert training.precision("", torch.device("mps"))[0] == torch.float32
    assert training.precision("float32", torch.device("cpu"))[0] == torch.float32
    dtype, ctx = training.precision("bfloat16", torch.device("cpu"))
    assert dtype == torch.bfloat16 and ctx.fast_dtype == torch.bfloat16
    with pytest.raises(UserError, match="--dtype='float16'"):
        training.precision("float16", torch.device("cpu"))


def test_resolve_compile_defaults_per_device(monkeypatch):
    """--compile unset: on for CUDA, off elsewhere; set: as given; the C++ toolchain is checked exactly when compiling.
    Catches the CUDA default applied to CPU, a forced setting ignored, a toolchain check skipped or made when off."""
    import nanotrain.training as training

    checked = []
    monkeypatch.setattr(training, "check_compile_toolchain", lambda device: checked.append(device.type))
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [training.resolve_compile(None, cpu), training.resolve_compile(None, cuda),
            training.resolve_compile(True, cpu), training.resolve_compile(False, cuda),
            training.resolve_compile(0, cpu)] == [False, True, True, False, False]
    assert checked == ["cuda", "cpu"]


def test_open_and_finish_a_run_write_config_metrics_and_report(one_rank_mesh, tmp_path, monkeypatch, capsys):
    """
    open_run_log prints the run directory and the sorted settings, writes config.json and returns the metrics log;
    finish_run prints the summary and the outputs and closes the log, after the replica check (under a process group
    of one rank); the report section the scripts write next has the wall time since t_start. A non-master rank writes
    no config.json and logs nothing. A refused metrics.jsonl (a bad row) stops open_run_log before config.json
    changes. Catches config written by every rank, written before the metrics check, the wall time measured from the
    wrong start, the log left open.
    """
    import time

    from nanotrain.errors import UserError
    from nanotrain.report.card import write_section_or_warn
    from nanotrain.run import finish_run, open_run_log

    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    run_dir = tmp_path / "base" / "r1"
    run_dir.mkdir(parents=True)
    metrics = open_run_log(str(run_dir), {"b": 2, "a": 1}, None, True)
    out = capsys.readouterr().out
    assert f"Run directory: {run_dir}\n" in out and 'Config: {"a": 1, "b": 2}\n' in out
    assert json.loads((run_dir / "config.json").read_text()) == {"a": 1, "b": 2}
    metrics.log(step=1, loss=3.0, dt=0.5, tok_per_sec=10.0, mfu=0.1)
    t_start = time.time() - 100
    finish_run(torch.nn.Linear(2, 2), str(run_dir), metrics, "Done: 1 step")
    # then, as every training script does, the stage's report section with the wall time since t_start (100 s ago)
    write_section_or_warn("r1", "base", str(run_dir), {"wall_time_s": time.time() - t_start})
    out = capsys.readouterr().out
    assert "Done: 1 step\n" in out and f"Outputs: {run_dir} (base dir {tmp_path})" in out and "Report card: " in out
    assert "Replica check: parameters identical on all 1 ranks" in out  # (one gloo rank: the check runs)
    assert metrics.file.closed
    section = json.loads((tmp_path / "report" / "r1" / "base.json").read_text())
    assert 100 <= section["extra"]["wall_time_s"] < 130
    other = tmp_path / "base" / "r2"
    other.mkdir()
    log = open_run_log(str(other), {"a": 1}, None, False)
    log.log(step=1, loss=1.0)
    log.close()
    assert sorted(p.name for p in other.iterdir()) == []
    (run_dir / "metrics.jsonl").write_text('[1, 2]\n{"step": 1, "dt": 0.1}\n')
    before = (run_dir / "config.json").read_text()
    with pytest.raises(UserError, match=r"metrics.jsonl:1: expected a JSON object"):
        open_run_log(str(run_dir), {"a": 3}, 1, True)
    assert (run_dir / "config.json").read_text() == before


def test_check_replicas_checksum_by_hand(one_rank_mesh, monkeypatch, capsys):
    """
    Without torch.distributed: None. With a process group (one rank): the checksum of parameters [1, 2, 3] and
    [[4]] weighted by linspace(1, 2, n) per parameter is 1 + 2 * 1.5 + 3 * 2 + 4 * 1 = 14, printed as identical on
    all ranks; ranks reporting different sums raise RuntimeError with the sums. Catches an unweighted sum (10: two
    swapped entries would pass), weights over the concatenation instead of per parameter, a check that never raises.
    """
    import torch.distributed as dist

    from nanotrain.run import check_replicas

    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    model.b = torch.nn.Parameter(torch.tensor([[4.0]]))
    assert check_replicas(model) == 14.0
    assert "parameters identical on all 1 ranks (checksum 1.4000000000e+01)" in capsys.readouterr().out
    model.a = torch.nn.Parameter(torch.tensor([0.0, 3.0, 0.0, 0.0]))  # weight 4/3: 3 * 4/3 + 4 = 8 in float64
    assert check_replicas(model) == 8.0  # fp32 weights (1.3333334) would give 8.0000001...

    def two_ranks_differ(out, value):
        out[0].copy_(value)
        out[1].copy_(value + 1)
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(dist, "all_gather", two_ranks_differ)
    with pytest.raises(RuntimeError, match=r"parameters differ across ranks: checksums \[8.0, 9.0\]"):
        check_replicas(model)


def test_check_replicas_without_a_process_group_is_a_no_op():
    from nanotrain.run import check_replicas
    assert check_replicas(torch.nn.Linear(2, 2)) is None


def test_metrics_log_keeps_bytes_names_lines_and_rejects_rows(tmp_path):
    """
    On resume: a row with bytes that are not UTF-8 survives byte for byte (surrogateescape both ways); a kept last
    row without its newline gets one, so the next row starts a line; a row whose "step" is not an int, or a JSON
    value that is not an object, is refused naming file:line (1-based) and changing nothing; a non-master log
    writes nothing. Catches strict decoding or encoding, rows glued on one line, line numbers from 0 or 2, a check
    that accepts any dict, and a non-master log that tries to write.
    """
    from nanotrain.errors import UserError

    path = tmp_path / "metrics.jsonl"
    raw = b'{"step": 1, "note": "\xff\xfe"}\n{"step": 2, "loss": 1.0, "dt": 0.1}'
    path.write_bytes(raw)
    log = MetricsLog(str(tmp_path), resume_step=3)
    log.log(step=3, loss=0.5)
    log.close()
    data = path.read_bytes()
    assert data.startswith(raw + b"\n")
    assert [json.loads(ln)["step"] for ln in data.decode("utf-8", "surrogateescape").splitlines()] == [1, 2, 3]
    for bad in ('{"step": "2"}', '[2]'):
        path.write_text('{"step": 1}\n' + bad + '\n{"step": 3}\n')
        with pytest.raises(UserError, match=r"metrics.jsonl:2: expected a JSON object with an int \"step\", got "):
            MetricsLog(str(tmp_path), resume_step=1)
        assert path.read_text() == '{"step": 1}\n' + bad + '\n{"step": 3}\n'
    long_row = '{"not_step": "' + "x" * 80 + '"}'
    path.write_text(long_row + "\n")
    with pytest.raises(UserError) as e:
        MetricsLog(str(tmp_path), resume_step=1)
    assert f"got {long_row[:60]!r}; nothing was changed" in str(e.value)  # the row's first 60 characters
    quiet = MetricsLog(str(tmp_path / "rank1"), master=False)
    quiet.log(step=1)
    quiet.close()
    assert not (tmp_path / "rank1").exists()


def test_grad_accum_steps_bounds_and_suggestions():
    """
    Each size below 1 alone is refused; the result is an int; 384 tokens over 2 ranks of 256-token rows suggests
    totals only (384 / (256 * 2) is not a whole number of rows, so no device batch size helps); 4096 tokens of
    256-token rows with device_batch_size 20: 16 rows per step, the divisors nearest 20 are 16, 8, 4. Catches a
    bound that skips one of the sizes, true division (2.0), `/` for `*` in the rows check, a divisor range that
    misses n itself, and suggestions not ordered by distance.
    """
    from nanotrain.errors import UserError
    from nanotrain.training import grad_accum_steps_for

    for args in ((0, 8, 256, 1), (4096, 8, 0, 1), (4096, 8, 256, 0), (-4096, 8, 256, 1)):
        with pytest.raises(UserError, match="must be positive"):
            grad_accum_steps_for(*args)
    steps = grad_accum_steps_for(4096, 8, 256, 1)
    assert steps == 2 and type(steps) is int
    with pytest.raises(UserError) as e:
        grad_accum_steps_for(384, 1, 256, 2)
    assert str(e.value).endswith("nearest valid: --total_batch_size=512") and "--device_batch_size in" not in str(e.value)
    with pytest.raises(UserError) as e:
        grad_accum_steps_for(4096, 20, 256, 1)
    assert str(e.value).endswith("--device_batch_size in [4, 8, 16] (divisors of 4096 / (256 * 1) = 16)")


def test_evaluate_bpb_says_its_eta_once_without_changing_the_result():
    """
    evaluate_bpb(log_eta=print) calls it exactly once, after the second of 5 batches ("3 of 5 batches left"), and
    returns the same bpb as without it; with 2 batches it says nothing (no second batch to time after the first).
    Catches an ETA printed per batch, timed from the first batch (which may compile), or one that changes the sums.
    """
    from nanotrain.loss_eval import evaluate_bpb

    model = tiny_model()
    gen = torch.Generator().manual_seed(0)
    rows = [(torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen))
            for _ in range(5)]
    token_bytes = torch.ones(64, dtype=torch.int64)
    said = []
    with_eta = evaluate_bpb(model, iter(rows), 5, token_bytes, log_eta=said.append)
    assert len(said) == 1 and said[0].startswith("val: 3 of 5 batches left, ETA ") and said[0].endswith(" s")
    assert with_eta == evaluate_bpb(model, iter(rows), 5, token_bytes)
    evaluate_bpb(model, iter(rows), 2, token_bytes, log_eta=said.append)
    assert len(said) == 1
