"""
nanotrain.optim: the AdamW update written out (adamw_update) against torch.optim.AdamW, the optimizer step compiled
(compile_optimizer_step: Muon's stack functions and the AdamW update under torch.compile) against the eager step,
and the fallbacks where torch.compile cannot run or a kernel fails to build.
"""

import copy

import pytest
import torch

from nanotrain.gpt import GPT, GPTConfig
from nanotrain.optim import AdamW, CompiledOrEager, adamw_update, compile_optimizer_step, setup_optimizers
from nanotrain.training import optimizer_step

TINY = GPTConfig(max_seq_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, model_dim=32)


def tiny_model():
    torch.manual_seed(0)
    model = GPT(TINY)
    model.init_weights()
    return model


def grads(model, step):
    """Fixed random gradients for every parameter (the same for two copies of a model), as if from backward."""
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]


def run_steps(model, optimizers, steps=3):
    for step in range(steps):
        for p, g in zip(model.parameters(), grads(model, step)):
            p.grad = g.clone()
        optimizer_step(model, optimizers, 1.0 - 0.3 * step, 0.9, 0.0)  # the lr changes every step


def max_rel_diff(a, b):
    return max(((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a.parameters(), b.parameters()))


def coupled_l2_update(p, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, finite):
    """The wrong variant: Adam with L2 regularisation (weight decay added to the gradient, torch.optim.Adam's
    weight_decay) instead of AdamW's decoupled decay."""
    adamw_update(p, grad + weight_decay * p, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
                 torch.zeros((), dtype=lr.dtype), finite)


@pytest.mark.unit
def test_adamw_update_equals_torch_adamw():
    """
    AdamW.step through adamw_update (eager; what compile_optimizer_step compiles) gives torch.optim.AdamW's
    single-tensor results (foreach=False) bit for bit over 4 steps with lr, betas and weight decay as nanochat's
    groups set them and the lr changed every step (the same operations in the same order, the scalars in fp64: the
    CPU recipe's digits do not depend on which one runs). Catches a stale lr, a missing bias correction, and Adam's
    coupled L2 decay (the wrong variant, run too, which must differ by more than 1e-3).
    """
    torch.manual_seed(0)
    params = [torch.randn(8, 40), torch.randn(5)]  # 40 columns: the vectorised kernels (fused multiply-adds) too
    groups = lambda ps: [dict(params=[ps[0]], lr=0.05, betas=(0.8, 0.95), weight_decay=0.1),  # noqa: E731
                         dict(params=[ps[1]], lr=0.01, betas=(0.96, 0.95), weight_decay=0.0)]
    results = {}
    for name, update in (("torch", None), ("ours", adamw_update), ("wrong", coupled_l2_update)):
        ps = [p.clone() for p in params]
        opt = (torch.optim.AdamW(groups(ps), eps=1e-10, foreach=False) if update is None
               else AdamW(groups(ps), eps=1e-10))
        if update is not None:
            opt.update = update
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            for group in opt.param_groups:
                group["lr"] *= 0.7
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        results[name] = (ps, opt.state[ps[0]])
    rel = lambda a, b: max(((x - y).abs().max() / x.abs().max()).item() for x, y in zip(a, b))  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(results["torch"][0], results["ours"][0]))
    assert results["ours"][1]["step"].item() == 4.0 and results["ours"][1]["step"].dtype == torch.float32
    assert torch.equal(results["torch"][1]["exp_avg_sq"], results["ours"][1]["exp_avg_sq"])
    assert rel(results["torch"][0], results["wrong"][0]) > 1e-3


@pytest.mark.unit
def test_compiled_optimizer_step_equals_eager():
    """
    compile_optimizer_step on setup_optimizers' [AdamW, Muon] of a tiny GPT (backend aot_eager: dynamo and AOT
    autograd without the slow C++ codegen; fullgraph=True, so a graph break fails) gives the eager step's parameters
    after 3 steps with the same gradients and a new lr each step: max relative difference <= 1e-6 per parameter
    (measured 2.6e-7: AOT autograd decomposes lerp and addmm), Newton-Schulz in fp32. The compiled functions really
    ran (not the fallback). Catches a compiled step that bakes the first lr in, drops the weight decay, or
    orthogonalises another tensor than the eager step.
    """
    from torch._dynamo.utils import counters
    eager, compiled = tiny_model(), tiny_model()
    kwargs = dict(ns_dtype="float32", weight_decay=0.1, muon_weight_decay=0.2)
    opt_e, opt_c = setup_optimizers(eager, **kwargs), setup_optimizers(compiled, **kwargs)
    torch._dynamo.reset()
    counters.clear()
    try:
        assert compile_optimizer_step(opt_c, "cpu", backend="aot_eager", log=lambda *a: None)
        run_steps(eager, opt_e)
        run_steps(compiled, opt_c)
        assert opt_c[0].update.compiled and all(fn.compiled for fn in opt_c[1].fns.values())
        assert counters["stats"]["unique_graphs"] >= 4  # the AdamW update and Muon's three functions
    finally:
        torch._dynamo.reset()
    assert max_rel_diff(eager, compiled) <= 1e-6
    assert max_rel_diff(tiny_model(), eager) > 1e-3  # the steps did move the parameters


@pytest.mark.slow  # the default run keeps test_compiled_optimizer_step_equals_eager (aot_eager) and the fallbacks
def test_inductor_optimizer_step_within_fp32_tolerance():
    """As test_compiled_optimizer_step_equals_eager with the default inductor backend (C++ code generation on CPU):
    fused kernels round differently, so the tolerance is 1e-5 relative per parameter after 3 steps."""
    eager, compiled = tiny_model(), tiny_model()
    kwargs = dict(ns_dtype="float32", weight_decay=0.1, muon_weight_decay=0.2)
    opt_e, opt_c = setup_optimizers(eager, **kwargs), setup_optimizers(compiled, **kwargs)
    torch._dynamo.reset()
    try:
        assert compile_optimizer_step(opt_c, "cpu", log=lambda *a: None)
        run_steps(eager, opt_e)
        run_steps(compiled, opt_c)
        assert opt_c[0].update.compiled and all(fn.compiled for fn in opt_c[1].fns.values())
    finally:
        torch._dynamo.reset()
    assert max_rel_diff(eager, compiled) <= 1e-5


@pytest.mark.unit
def test_falls_back_to_eager_without_a_compiler(monkeypatch, tmp_path):
    """Without a C++ compiler on the PATH (no $CXX) the CPU step is not compiled: compile_optimizer_step returns False,
    says why in one line, and leaves the eager functions in place (the step then equals an untouched optimizer's).
    Catches a compile that would fail at the first step with inductor's long traceback."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    model = tiny_model()
    optimizers = setup_optimizers(model, ns_dtype="float32")
    lines = []
    assert compile_optimizer_step(optimizers, "cpu", log=lines.append) is False
    assert lines == ["compile_optimizer_step: no C++ compiler (g++, c++, clang++ or $CXX) on the PATH: the optimizer "
                     "step runs eagerly"]
    assert optimizers[0].update is None and not any(isinstance(fn, CompiledOrEager) for fn in optimizers[1].fns.values())
    reference = copy.deepcopy(model)
    ref_opts = setup_optimizers(reference, ns_dtype="float32")
    run_steps(model, optimizers, 1)
    run_steps(reference, ref_opts, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


@pytest.mark.unit
def test_falls_back_when_a_kernel_fails_to_build(capsys):
    """A backend that cannot build the kernel (dynamo raises BackendCompilerFailed before anything runs): the call
    returns the eager result, says so once, and later calls run eagerly. An error of the function itself is not a
    build failure and propagates (the wrong variant, catching every exception, would hide real bugs)."""
    def failing_backend(gm, example_inputs):
        raise RuntimeError("no kernel today")

    def axpy(x, y):
        return 2 * x + y

    torch._dynamo.reset()
    try:
        fn = CompiledOrEager(axpy, backend=failing_backend)
        x, y = torch.ones(3), torch.arange(3.0)
        assert torch.equal(fn(x, y), 2 * x + y) and fn.compiled is False
        assert "axpy could not be compiled (BackendCompilerFailed" in capsys.readouterr().out
        assert torch.equal(fn(y, x), 2 * y + x)
        working = CompiledOrEager(axpy, backend="eager")
        with pytest.raises(RuntimeError, match="size"):  # shapes (3,) and (4,): the function's own error
            working(x, torch.ones(4))
        assert working.compiled and capsys.readouterr().out == ""
    finally:
        torch._dynamo.reset()


@pytest.mark.unit
@pytest.mark.parametrize("compiled", [False, True])
def test_step_hooks_run_once(compiled):
    """Optimizer step pre/post hooks (OSFT's projection uses them) run exactly once per AdamW step, eager and
    compiled, also when torch's own AdamW.step has been wrapped with hooks by another instance. Catches a subclass
    whose step calls the hooked parent step (every hook would run twice, and OSFT's post hook fails)."""
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # torch wraps AdamW.step with its hook caller
    p = torch.nn.Parameter(torch.ones(3))
    opt = AdamW([p], lr=0.1)
    if compiled:
        opt.update = adamw_update  # the step's other path; compiling it is test_compiled_optimizer_step_equals_eager's
    calls = []
    opt.register_step_pre_hook(lambda *a: calls.append("pre"))
    opt.register_step_post_hook(lambda *a: calls.append("post"))
    for _ in range(2):
        p.grad = torch.ones(3)
        opt.step()
    assert calls == ["pre", "post"] * 2 and p.detach().lt(1).all()
