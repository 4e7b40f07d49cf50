"""
The training step compiled as base_train compiles it: the model's forward and backward in one graph each
(fullgraph=True) with every model option base_train can turn on, and no recompilation while the schedule moves.
"""

from contextlib import nullcontext

import pytest
import torch

from nanotrain.gpt import GPT, config_from_depth
from nanotrain.optim import compile_optimizer_step, setup_optimizers
from nanotrain.training import forward_backward, lr_multiplier, micro_batches, muon_momentum, optimizer_step


@pytest.mark.unit
def test_model_traces_fullgraph_with_every_option():
    """
    The model of base_train with every option on (value embeddings, smear, backout, x0 lambdas) traced by dynamo
    with fullgraph=True (backend "eager": the tracing alone, seconds) in training mode, forward and backward twice:
    no graph break (it would raise), one graph, and the logits of the uncompiled model. The default tier's share of
    test_step_compiles_fullgraph_and_never_recompiles (slow). Catches a data-dependent branch or a .item() in the
    forward of any option.
    """
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = GPT(config_from_depth(2, 64, 32, value_embeds=True, smear=True, backout=True, x0_lambdas=True))
    model.init_weights()
    x = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(model, dynamic=False, fullgraph=True, backend="eager")
        for _ in range(2):
            logits = compiled(x)
            logits.float().square().mean().backward()
        assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"], dict(counters["stats"])
        assert torch.allclose(logits, model(x), atol=1e-5)
    finally:
        torch._dynamo.reset()


@pytest.mark.slow  # ~1-6 min (every AdamW shape and Muon shape compiled); test_model_traces_fullgraph_with_every_option
def test_step_compiles_fullgraph_and_never_recompiles(monkeypatch):  # keeps the tracing in the default tier
    """
    A depth-2 GPT with value embeddings, smear, backout and x0 lambdas on (all of base_train's model options),
    compiled as base_train does (torch.compile(model, dynamic=False), here with fullgraph=True, so a graph break
    raises) with the optimizer step compiled too (compile_optimizer_step), both on backend aot_eager (dynamo and AOT
    autograd trace forward and backward; no C++ code generation), then 20 steps of 2 micro-batches with the lr
    multiplier and Muon's momentum changing every step and clipping on: after the first step dynamo compiles nothing
    more (torch._dynamo.config.error_on_recompile raises on a recompile; the graph count stays), and nothing broke
    a graph. Catches a data-dependent branch or a .item() in the forward (a graph break), a Python-float lr or
    momentum reaching a compiled function (one recompile per new value), and a guard on state that changes from step
    to step.
    """
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    config = config_from_depth(2, 64, 32, value_embeds=True, smear=True, backout=True, x0_lambdas=True)
    model = GPT(config)
    model.init_weights()
    optimizers = setup_optimizers(model, ns_dtype="float32", weight_decay=0.01, muon_weight_decay=0.2)
    torch._dynamo.reset()
    counters.clear()
    try:
        assert compile_optimizer_step(optimizers, "cpu", backend="aot_eager", log=lambda *a: None)
        compiled = torch.compile(model, dynamic=False, fullgraph=True, backend="aot_eager")
        data = torch.Generator().manual_seed(1)
        lrms = set()
        for step in range(20):
            x, y = (torch.randint(0, 64, (4, 32), generator=data) for _ in range(2))
            forward_backward(compiled, micro_batches(x, y, 2), nullcontext())
            lrm = lr_multiplier(step, 20, warmup_ratio=1.0)  # a new lr every step
            lrms.add(lrm)
            optimizer_step(model, optimizers, lrm, muon_momentum(step, warmup_steps=20), 1.0)
            if step == 0:
                graphs = counters["stats"]["unique_graphs"]
                monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
        assert len(lrms) == 20 and optimizers[0].update.compiled and all(fn.compiled for fn in optimizers[1].fns.values())
        assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
