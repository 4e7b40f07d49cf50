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

import os
import platform
import shutil

import torch

from nanotrain.common import print0
from nanotrain.errors import UserError
from nanotrain.muon import NS_DTYPES, Muon, ns_dtype_for


def adamw_lr_scale(model_dim):
    """The factor of the AdamW lrs (embedding, lm_head): (model_dim / 768) ** -0.5, as in nanochat."""
    return (model_dim / 768) ** -0.5


def adamw_update(p, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay):
    """
    One AdamW update of p in place (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization"; the formula of
    torch.optim.AdamW's single-tensor path): p *= 1 - lr * weight_decay; m = lerp(m, g, 1 - beta1);
    v = beta2 v + (1 - beta2) g^2; p -= lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps).
    p, grad, exp_avg (m), exp_avg_sq (v): tensors of one shape and dtype (plain, not DTensors: a shard is updated
    like a whole tensor); step (t, already incremented), lr, beta1, beta2, eps, weight_decay: 0-d fp32 tensors (any
    device), so that new values do not recompile the compiled version. Returns None.
    """
    p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).add_(grad * grad * (1 - beta2))
    denom = (exp_avg_sq.sqrt() / (1 - beta2 ** step).sqrt()).add_(eps)
    p.sub_(exp_avg / denom * (lr / (1 - beta1 ** step)))


def _local(t):
    """The local shard of a DTensor (FSDP2; the same storage, so in-place updates land in it), else t itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class AdamW(torch.optim.AdamW):
    """
    torch.optim.AdamW (same arguments, state dict and, while `update` is None, the same step), plus an optional
    per-parameter update function `update` (adamw_update or its compiled version, set by compile_optimizer_step) that
    step() then uses instead: the state is created as torch's non-fused AdamW creates it ("step" a 0-d fp32 CPU
    tensor, "exp_avg", "exp_avg_sq" like p) and updated in place. Only plain AdamW has a compiled step: amsgrad,
    maximize and capturable stay on torch's step (compile_optimizer_step leaves such an optimizer alone).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.update = None

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient. Returns closure() if given, else None."""
        if self.update is None:  # torch's step, without its hook wrapper: this class's own wrapper ran the hooks
            step = torch.optim.AdamW.step
            return (step.__wrapped__ if getattr(step, "hooked", False) else step)(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # 0-d tensors: a new lr (the schedule) is a new value, not a new constant to compile for
            lr, eps, wd = (torch.tensor(float(group[k])) for k in ("lr", "eps", "weight_decay"))
            beta1, beta2 = (torch.tensor(float(b)) for b in group["betas"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                self.update(_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                            state["step"], lr, beta1, beta2, eps, wd)
        return loss


def setup_optimizers(model, matrix_lr=0.02, embedding_lr=0.2, unembedding_lr=0.004, scalar_lr=0.5,
                     weight_decay=0.0, adam_betas=(0.8, 0.95), ns_dtype="", muon_weight_decay=0.0,
                     polar_express=True, muon_beta2=0.0, embedding_beta2=None, unembedding_beta2=None,
                     process_group=None):
    """
    Returns [adamw, muon]. Muon (lr matrix_lr, momentum 0.95, Newton-Schulz in ns_dtype: "" picks it per device,
    see nanotrain.muon.ns_dtype_for; polar_express, NorMuon's beta2 muon_beta2 (0: off), cautious weight decay
    muon_weight_decay) for the blocks' matrices (value-embedding gates included). torch AdamW
    (eps 1e-10; fused on CUDA, torch's default elsewhere) for the rest, in groups, with s = adamw_lr_scale:
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
    on_cuda = model.wte.weight.device.type == "cuda"
    adamw = AdamW([dict(params=ps, lr=lr, betas=betas, weight_decay=wd) for ps, lr, betas, wd in groups],
                              eps=1e-10, fused=True if on_cuda else None)
    muon = Muon(matrix_params, lr=matrix_lr, momentum=0.95, ns_dtype=ns_dtype, polar_express=polar_express,
                beta2=muon_beta2, weight_decay=muon_weight_decay, process_group=process_group)
    for opt in (adamw, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return [adamw, muon]


COMPILE_ERRORS = ("BackendCompilerFailed", "InductorError")  # torch._dynamo.exc's, torch._inductor.exc's (by name:
# those modules are slow imports, and InductorError is missing from older torch)


def _is_compile_error(exc):
    """True if exc (or a class it derives from) is one of COMPILE_ERRORS: a kernel that could not be built."""
    return any(cls.__name__ in COMPILE_ERRORS for cls in type(exc).__mro__)


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
    if not any(c and shutil.which(c) for c in (os.environ.get("CXX", ""), "g++", "c++", "clang++")):
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
                if not _is_compile_error(exc):
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
    kernel fails to build (CompiledOrEager). Optimizers of other types, and AdamW with amsgrad, maximize or
    capturable, are left as they are. Returns True if the step is compiled, else False.
    """
    reason = compile_unavailable(device, backend)
    if reason is not None:
        log(f"compile_optimizer_step: {reason}: the optimizer step runs eagerly")
        return False
    for opt in optimizers:
        plain = all(not g.get(k) for g in opt.param_groups for k in ("amsgrad", "maximize", "capturable"))
        if isinstance(opt, AdamW) and plain:
            opt.update = CompiledOrEager(adamw_update, backend)
        elif isinstance(opt, Muon):
            opt.fns = {name: CompiledOrEager(getattr(fn, "fn", fn), backend) for name, fn in opt.fns.items()}
    return True
