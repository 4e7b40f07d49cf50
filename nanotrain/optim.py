"""
The optimizers of the GPT: setup_optimizers (Muon, nanotrain.muon, for the blocks' matrices; AdamW for the rest,
nanochat's groups) and the optimizer step compiled (compile_optimizer_step): torch.compile of Muon's stacked step
functions (momentum, Polar Express / Newton-Schulz, the update: nanotrain.muon) and of the AdamW update, each as one
function of tensors whose hyperparameters are tensors, so that a schedule changing the lr every step does not
recompile (torch's "Compiling the optimizer" recipe passes the lr as a tensor for the same reason; nanochat compiles
its AdamW and Muon steps this way). Where torch.compile cannot run (no inductor, Windows, no C++ compiler on CPU) or
fails to build a kernel, the same functions run eagerly. The state dicts are torch's, so a run may switch between
compiled and eager steps across a resume.

AdamW is a plain single-process optimizer: under DDP the gradients are already averaged when step() runs, so every
rank computes the same update; under FSDP2 (nanotrain.fsdp) it updates each rank's shards elementwise.
"""

import platform

import torch

from nanotrain.common import cxx_compiler, print0
from nanotrain.errors import UserError
from nanotrain.muon import NS_DTYPES, Muon, _local, ns_dtype_for


def adamw_lr_scale(model_dim):
    """The factor of the AdamW lrs (embedding, lm_head): (model_dim / 768) ** -0.5, as in nanochat."""
    return (model_dim / 768) ** -0.5


def adamw_update(p, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay, finite):
    """
    One AdamW update of p in place (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"), gated on the
    device by `finite`: t += 1; p *= 1 - lr * weight_decay; m = lerp(m, g, 1 - beta1); v = beta2 v + (1 - beta2) g^2;
    p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps). The operations and their order are those of
    torch.optim.AdamW's single-tensor path (the scalars in fp64, as its Python floats), so on CPU the result is bit
    for bit torch's. p, grad, exp_avg (m), exp_avg_sq (v): tensors of one shape and dtype (plain, not DTensors: a
    shard is updated like a whole tensor); step (t): 0-d fp32 tensor on p's device, incremented here; lr, beta1,
    beta2, eps, weight_decay: 0-d CPU tensors (fp64; fp32 for MPS), so that new values do not recompile the compiled
    version; finite: 0-d bool tensor on p's device. finite False leaves p, m, v and t bit for bit unchanged without a
    host read: the gradient is masked first, in place (0 * NaN is NaN), every other change is multiplied by 0.
    Returns None.
    """
    g = grad.masked_fill_(~finite, 0.0)  # in place (the caller drops the gradient after the step): no copy
    f = finite.to(lr.dtype)
    step.add_(finite.to(step.dtype))
    t = step.to(lr.dtype).clamp_min(1.0)  # a first step skipped: t stays 0, and 1 - beta^0 = 0 must not divide
    p.mul_(1 - lr * weight_decay * f)
    exp_avg.lerp_(g, ((1 - beta1) * f).to(exp_avg.dtype))
    exp_avg_sq.mul_(torch.where(finite, beta2, 1.0)).addcmul_((1 - beta2) * g, g)  # g = 0: v unchanged
    # a tensor exponent: pow(x, 0.5) as Python's x ** 0.5 (a scalar 0.5 would take sqrt, another rounding)
    denom = exp_avg_sq.sqrt().div_((1 - beta2 ** t).pow(torch.full_like(t, 0.5))).add_(eps)
    p.add_((exp_avg * (-(lr * f) / (1 - beta1 ** t))).div_(denom))  # two temporaries at most, as torch's step


class AdamW(torch.optim.AdamW):
    """
    torch.optim.AdamW's arguments and state dict, with its own step: adamw_update (or its compiled version, `update`,
    set by compile_optimizer_step) per parameter, gated on the device by step(finite=...). The state is torch's
    ("step" a 0-d fp32 tensor, here on the parameter's device; "exp_avg", "exp_avg_sq" like p), so checkpoints of
    torch's AdamW load (a CPU "step" moves to the device at the first step). Only plain AdamW: amsgrad, maximize and
    capturable raise ValueError.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if any(g.get(k) for g in self.param_groups for k in ("amsgrad", "maximize", "capturable")):
            raise ValueError("nanotrain.optim.AdamW: amsgrad, maximize and capturable are not supported")
        self.update = None  # adamw_update; compile_optimizer_step compiles it

    @torch.no_grad()
    def step(self, closure=None, finite=None):
        """
        One update of every parameter that has a gradient. finite: None (True) or a 0-d bool tensor on the
        parameters' device; False leaves every parameter and state tensor (the step count too) bit for bit unchanged,
        decided on the device (no host read). Returns closure() if given, else None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        update = self.update or adamw_update
        for group in self.param_groups:
            # 0-d CPU tensors: a new lr (the schedule) is a new value, not a new constant to compile for, and no
            # host-to-device copy (a CPU scalar rides into a device kernel as an argument)
            dtype = torch.float32 if group["params"][0].device.type == "mps" else torch.float64  # MPS: no fp64
            lr, eps, wd = (torch.tensor(float(group[k]), dtype=dtype) for k in ("lr", "eps", "weight_decay"))
            beta1, beta2 = (torch.tensor(float(b), dtype=dtype) for b in group["betas"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if state["step"].device != p.device:  # torch's AdamW keeps it on the CPU: moved once
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
                ok = finite if finite is not None else torch.ones((), dtype=torch.bool, device=p.device)
                update(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                       state["step"], lr, beta1, beta2, eps, wd, ok)
        return loss


def setup_optimizers(model, matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004, scalar_lr=0.5,
                     weight_decay=0.0, adam_betas=(0.8, 0.95), ns_dtype="", muon_weight_decay=0.0,
                     polar_express=True, muon_beta2=0.0, embedding_beta2=None, unembedding_beta2=None,
                     process_group=None):
    """
    Returns [adamw, muon]. Muon (lr matrix_lr, momentum 0.95, Newton-Schulz in ns_dtype: "" picks it per device,
    see nanotrain.muon.ns_dtype_for; polar_express, NorMuon's beta2 muon_beta2 (0: off), cautious weight decay
    muon_weight_decay) for the blocks' matrices (value-embedding gates included). torch AdamW
    (nanotrain.optim.AdamW, eps 1e-10) for the rest, in groups, with s = adamw_lr_scale:
    lm_head unembedding_lr * s; wte embedding_lr * s; value embeddings embedding_lr * s / 2 (these three with
    betas adam_betas, the second one replaced by unembedding_beta2 for lm_head and embedding_beta2 for the two
    embeddings where given, and weight_decay); resid_lambdas scalar_lr / 100; x0_lambdas scalar_lr with beta1 0.96;
    the smear gate, smear_lambda and backout_lambda 0.4 * scalar_lr (the lambdas without weight decay). The group
    structure follows nanochat (2026). Every param group gets "initial_lr" = its lr.
    process_group: Muon's (nanotrain.muon.Muon): None, or under DDP the group of the ranks (they then share the
    orthogonalisation; every rank must call step() together, so never for a memory probe). AdamW is a plain
    single-process optimizer: under DDP the gradients are averaged before step(). With ns_dtype "" the
    per-device choice is settled here, which on CPU under torch.distributed is a collective: every rank must call
    this (the scripts and the auto batch size probes all do). Raises UserError for an unknown ns_dtype.
    """
    if ns_dtype and ns_dtype not in NS_DTYPES:
        raise UserError(f"--ns_dtype={ns_dtype!r}: expected 'float32', 'bfloat16' or '' (chosen per device)")
    matrix_params = list(model.blocks.parameters())
    s = adamw_lr_scale(model.config.model_dim)
    b1, b2 = adam_betas
    smear_backout = [p for p in (model.smear_gate and model.smear_gate.weight, model.smear_lambda,
                                 model.backout_lambda) if p is not None]
    head_betas = (b1, b2 if unembedding_beta2 is None else unembedding_beta2)
    embed_betas = (b1, b2 if embedding_beta2 is None else embedding_beta2)
    groups = [  # (params, lr, betas, weight decay)
        ([model.lm_head.weight], unembedding_lr * s, head_betas, weight_decay),
        ([model.wte.weight], embedding_lr * s, embed_betas, weight_decay),
        (list(model.value_embeds.parameters()), embedding_lr * s / 2, embed_betas, weight_decay),
        ([model.resid_lambdas] if model.resid_lambdas is not None else [], scalar_lr / 100, adam_betas, 0.0),
        ([model.x0_lambdas] if model.x0_lambdas is not None else [], scalar_lr, (0.96, b2), 0.0),
        (smear_backout, 0.4 * scalar_lr, adam_betas, 0.0),
    ]
    groups = [g for g in groups if g[0]]
    all_ids = [id(p) for p in matrix_params] + [id(p) for g in groups for p in g[0]]
    assert len(all_ids) == len(set(all_ids)) and set(all_ids) == {id(p) for p in model.parameters()}
    if not ns_dtype:  # settle the per-device choice now: on CPU under torch.distributed it is one collective
        ns_dtype_for(model.wte.weight.device)  # (every rank sets up its optimizers; none may decide mid-step)
    adamw = AdamW([dict(params=ps, lr=lr, betas=betas, weight_decay=wd) for ps, lr, betas, wd in groups], eps=1e-10)
    muon = Muon(matrix_params, lr=matrix_lr, momentum=0.95, ns_dtype=ns_dtype, polar_express=polar_express,
                beta2=muon_beta2, weight_decay=muon_weight_decay, process_group=process_group)
    for opt in (adamw, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return [adamw, muon]


COMPILE_ERRORS = ("BackendCompilerFailed", "InductorError")  # torch._dynamo.exc's, torch._inductor.exc's (by name:
# those modules are slow imports, and InductorError is missing from older torch)


def compile_unavailable(device, backend="inductor"):
    """
    Why torch.compile cannot build the optimizer step on `device` here, as one line, or None when it can: dynamo
    unsupported by this Python/torch (torch._dynamo.is_dynamo_supported), Windows on CPU, or (inductor on CPU) no C++
    compiler ($CXX, g++, c++ or clang++) on the PATH. Other backends (e.g. "aot_eager") need no compiler.
    """
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported by this Python/torch build"
    if backend != "inductor" or torch.device(device).type != "cpu":
        return None
    if platform.system() == "Windows":
        return "torch.compile's CPU code generation is not set up on Windows here"
    if cxx_compiler() is None:
        return "no C++ compiler (g++, c++, clang++ or $CXX) on the PATH"
    return None


class CompiledOrEager:
    """
    fn compiled with torch.compile(fn, dynamic=False, fullgraph=True, backend=backend), called like fn. If building a
    kernel fails (torch._dynamo's BackendCompilerFailed, torch._inductor's InductorError: raised before the compiled
    code runs, so nothing was updated), it prints one line and runs fn eagerly from then on. `compiled` (attribute):
    whether calls still go through torch.compile.
    """

    def __init__(self, fn, backend="inductor", name=None):
        self.fn, self.name = fn, name or fn.__name__
        self.impl = torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)
        self.compiled = True

    def __call__(self, *args, **kwargs):
        if self.compiled:
            try:
                return self.impl(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised unless a kernel failed to build
                if not any(cls.__name__ in COMPILE_ERRORS for cls in type(exc).__mro__):  # nor a class it derives from
                    raise
                print0(f"compile_optimizer_step: {self.name} could not be compiled ({type(exc).__name__}: "
                       f"{str(exc).splitlines()[0][:200] if str(exc) else ''}); running it eagerly")
                self.compiled = False
        return self.fn(*args, **kwargs)


def compile_optimizer_step(optimizers, device, backend="inductor", log=print0):
    """
    Compiles the optimizer step of setup_optimizers' [AdamW, Muon] in place: AdamW.update = adamw_update compiled,
    Muon.fns = its four stack functions (nanotrain.muon: muon_momentum, zeropower_via_newtonschulz5,
    variance_normalized, muon_update) compiled, each once per stack shape (dynamic=False). Call it after setup_optimizers and before the first step,
    whatever wraps the model (DDP, FSDP2: the optimizers see plain tensors or the local shards; Muon's
    orthogonalisation runs on whole matrices, its collectives outside the compiled functions). Numerics: the same
    formulas, fused by the compiler, equal to the eager step within fp32 roundoff (tests/test_muon.py states the
    tolerance). Falls back to the eager functions with one log line when compile_unavailable says why, or when a
    kernel fails to build (CompiledOrEager). Optimizers of other types are left as they are. Returns True if the step is compiled, else False.
    """
    reason = compile_unavailable(device, backend)
    if reason is not None:
        log(f"compile_optimizer_step: {reason}: the optimizer step runs eagerly")
        return False
    for opt in optimizers:
        if isinstance(opt, AdamW):
            opt.update = CompiledOrEager(adamw_update, backend)
        elif isinstance(opt, Muon):
            opt.fns = {name: CompiledOrEager(getattr(fn, "fn", fn), backend) for name, fn in opt.fns.items()}
    return True
