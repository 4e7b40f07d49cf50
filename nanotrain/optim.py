"""
The optimizers of the GPT: setup_optimizers (Muon for the blocks' matrices, AdamW for the rest, nanochat's groups)
and the optimizer step compiled (compile_optimizer_step): torch.compile of Muon's orthogonalisation (Polar Express /
Newton-Schulz, nanotrain.optim) and of the AdamW update, each as one function of tensors whose hyperparameters are 0-d
tensors, so that a schedule changing the lr every step does not recompile (torch's "Compiling the optimizer" recipe
passes the lr as a tensor for the same reason; nanochat compiles its AdamW and Muon steps this way). Where
torch.compile cannot run (no inductor, Windows, no C++ compiler on CPU) or fails to build a kernel, the same functions
run eagerly. The optimizers stay plain single-process ones (the gradients are synchronised before step()); their
state dicts are torch's, so a run may switch between compiled and eager steps across a resume.

Muon: MomentUm Orthogonalized by Newton-Schulz, the optimizer nanochat uses for the 2-D matrices of the transformer
blocks. Source: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (blog post, 2024,
https://kellerjordan.github.io/posts/muon/) and KellerJordan/modded-nanogpt; nanochat v0/v1 `nanochat/muon.py`.

Plain single-process optimizer: under DDP the gradients are already averaged when step() runs, so every rank
computes the same update. Under FSDP2 (nanotrain.fsdp) parameters, gradients and momentum buffers are DTensors
sharded on dim 0: Newton-Schulz needs the whole matrix, so each update is all-gathered, orthogonalised on every rank
(the same result everywhere) and only the local rows are applied; the momentum buffers stay sharded.
"""

import os
import platform
import shutil
import sys

import torch

from nanotrain.common import fast_bf16, print0
from nanotrain.errors import UserError


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


def _local(t):
    """The local shard of a DTensor (FSDP2; the same storage, so in-place updates land in it), else t itself."""
    return t.to_local() if hasattr(t, "to_local") else t


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
                     polar_express=True, muon_beta2=0.0, embedding_beta2=None, unembedding_beta2=None):
    """
    Returns [adamw, muon]. Muon (lr matrix_lr, momentum 0.95, Newton-Schulz in ns_dtype: "" picks it per device,
    see nanotrain.optim.ns_dtype_for; polar_express, NorMuon's beta2 muon_beta2 (0: off), cautious weight decay
    muon_weight_decay) for the blocks' matrices (value-embedding gates included). torch AdamW
    (nanotrain.optim.AdamW, eps 1e-10) for the rest, in groups, with s = adamw_lr_scale:
    lm_head unembedding_lr * s; wte embedding_lr * s; value embeddings embedding_lr * s / 2 (these three with
    betas adam_betas, the second one replaced by unembedding_beta2 for lm_head and embedding_beta2 for the two
    embeddings where given, and weight_decay); resid_lambdas scalar_lr / 100; x0_lambdas scalar_lr with beta1 0.96;
    the smear gate, smear_lambda and backout_lambda 0.4 * scalar_lr (the lambdas without weight decay). The group
    structure follows nanochat (2026). Every param group gets "initial_lr" = its lr.
    Plain single-process optimizers: under DDP the gradients are averaged before step(). With ns_dtype "" the
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
                beta2=muon_beta2, weight_decay=muon_weight_decay)
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
    Muon.zeropower = zeropower_via_newtonschulz5 compiled (one graph per matrix shape, dynamic=False). Call it after
    setup_optimizers and before the first step, whatever wraps the model (DDP, FSDP2: the optimizers see plain
    tensors or the local shards; Muon's orthogonalisation runs on the whole gathered matrix). Numerics: the same
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
            opt.zeropower = CompiledOrEager(zeropower_via_newtonschulz5, backend)
    return True


# ----------------------------------------------------------------------------- Muon

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz coefficients (Keller Jordan 2024, modded-nanogpt)
# Polar Express (Amsel, Persson, Musco, Gower 2025, "The Polar Express: Optimal Matrix Sign Methods and Their
# Application to the Muon Algorithm", arXiv:2505.16932): one quintic per iteration, optimal for 5 iterations, computed
# there with safety factor 2e-2 and cushion 2; the input is scaled by 1/(1.01 ||X||_F) first.
POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)


@torch.no_grad()
def zeropower_via_newtonschulz5(G, steps=5, dtype=None, polar_express=False):
    """
    Approximate orthogonalisation of G (the polar factor U V^T of G = U S V^T) by `steps` iterations of the quintic
    Newton-Schulz map X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315), written as
    two addmm calls so the scalars ride in the matmuls (no separate elementwise passes).
    Source: Keller Jordan, "Muon" (2024) and modded-nanogpt.

    The coefficients trade exactness for speed: singular values are not driven to exactly 1 but into a band around
    it (about 0.68..1.2 once converged; the tiniest ones of a near-singular input may still be below it after 5
    steps), which is all Muon needs.

    polar_express=True uses POLAR_EXPRESS_COEFFS instead, step i with the i-th triple (at most 5 steps; Amsel et al.
    2025): in the same 5 steps the singular values land in a narrower band around 1 than the fixed quintic's.

    G: (rows, cols) tensor of any float dtype; X is first divided by its Frobenius norm (+1e-7; times 1.01 with
    polar_express) so the spectral norm is <= 1, and the iteration runs on the wide orientation (transposed when
    rows > cols).
    dtype: compute dtype; default ns_dtype_for(G.device) (bf16 on CUDA; on CPU bf16 only where its matmuls are fast).
    Returns a tensor of G's shape in the compute dtype. Raises ValueError if G is not 2-D.
    """
    if G.ndim != 2:
        raise ValueError(f"zeropower_via_newtonschulz5 expects a matrix, got shape {tuple(G.shape)}")
    if dtype is None:
        dtype = ns_dtype_for(G.device)
    coeffs = POLAR_EXPRESS_COEFFS[:steps] if polar_express else [NS_COEFFS] * steps
    X = G.float()
    X = (X / (X.norm() * (1.01 if polar_express else 1.0) + 1e-7)).to(dtype)
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    for a, b, c in coeffs:  # the scalar terms ride in the matmuls (beta, alpha): no separate elementwise passes
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.mT if transposed else X


NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ns_dtype_for(device):
    """
    The Newton-Schulz compute dtype Muon uses on `device` when none is given: torch.bfloat16 where bf16 matmuls are
    fast (nanotrain.common.fast_bf16: CUDA, as modded-nanogpt and nanochat; on CPU only where they are native), else
    torch.float32 (CPUs that emulate bf16 run it several times slower than fp32). Settled once per process; on CPU
    under torch.distributed the first call is collective, which is why nanotrain.optim.setup_optimizers makes it on
    every rank before the first step. Returns a torch.dtype.
    """
    return torch.bfloat16 if fast_bf16(device) else torch.float32


def orthogonalize(update, steps=5, dtype=None, polar_express=False, then=None, zeropower=None):
    """
    zeropower_via_newtonschulz5 of a momentum update (rows, cols). A plain tensor is orthogonalised as it is. A DTensor
    (FSDP2: sharded on dim 0 over the ranks) is all-gathered with full_tensor(), orthogonalised whole on every rank,
    and cut back to this rank's rows (distribute_tensor with src_data_rank=None slices locally, no communication),
    so the result equals the unsharded update's rows; orthogonalising the local rows alone would not (the polar
    factor of a block of rows is not a block of the polar factor). Collective for a DTensor: all ranks must call it.
    dtype: the Newton-Schulz compute dtype (None: ns_dtype_for the update's device). then: an optional function
    applied to the whole orthogonalised matrix before it is cut back to this rank's rows (normalize_variance: its
    statistics need whole rows and columns). zeropower: the orthogonalisation (None: zeropower_via_newtonschulz5),
    e.g. its compiled version (nanotrain.optim.compile_optimizer_step), called with a plain tensor and a torch.dtype.
    Returns a tensor (or DTensor with update's placements) of update's shape in the Newton-Schulz compute dtype.
    """
    if dtype is None:  # decided here, eagerly: the choice may measure the CPU, which a compiled function cannot
        dtype = ns_dtype_for(update.device)
    zeropower = zeropower or zeropower_via_newtonschulz5
    dtensor = sys.modules.get("torch.distributed.tensor")  # only loaded (a slow import) when DTensors exist
    if dtensor is None or not isinstance(update, dtensor.DTensor):
        out = zeropower(update, steps, dtype, polar_express)
        return then(out) if then is not None else out
    full = zeropower(update.full_tensor(), steps, dtype, polar_express)
    if then is not None:
        full = then(full)
    return dtensor.distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


def normalize_variance(update, state, beta2, finite=None):
    """
    NorMuon's variance normalisation (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable",
    arXiv:2510.05491), as nanochat applies it: keeps an EMA (factor beta2, from zero) of the mean square of the
    orthogonalised update along its longer side (one statistic per row of a tall or square matrix, per column of a wide
    one) in state["second_moment"] ((rows, 1) or (1, cols), fp32), divides the update by its square root and rescales
    the result to the update's own Frobenius norm: the update's size is unchanged, its rows (or columns) are evened
    out. update: (rows, cols), any float dtype, the whole matrix (under FSDP2 orthogonalize applies this before it
    cuts the rows back, so the statistic is a plain tensor, the same on every rank). finite: None, or a 0-d bool
    tensor: False leaves the statistic unchanged (Muon.step's gate). Returns a tensor like update.
    """
    dim = -1 if update.size(-2) >= update.size(-1) else -2
    u = update.float()
    mean_square = u.square().mean(dim=dim, keepdim=True)
    if "second_moment" not in state:
        state["second_moment"] = torch.zeros_like(mean_square)
    second_moment = state["second_moment"]
    second_moment.lerp_(mean_square, 1 - beta2 if finite is None else torch.where(finite, 1 - beta2, 0.0))
    scaled = u * second_moment.clamp_min(1e-10).rsqrt()
    return (scaled * (u.norm() / scaled.norm().clamp_min(1e-10))).to(update.dtype)


class Muon(torch.optim.Optimizer):
    """
    Muon optimizer for 2-D parameters (Keller Jordan 2024; modded-nanogpt; nanochat).

    Per parameter p (rows, cols) with gradient g, each step:
        buf = lerp(buf, g, 1 - momentum)                       # EMA momentum buffer, starts at zero
        u = lerp(g, buf, momentum) if nesterov else buf        # Nesterov-style look-ahead
        u = zeropower_via_newtonschulz5(u, ns_steps)           # orthogonalise (the whole matrix: orthogonalize())
        u = normalize_variance(u) if beta2 > 0                 # NorMuon (Li et al. 2025)
        s = lr * sqrt(max(1, rows / cols))
        p -= s * weight_decay * p * (u * p > 0)                # cautious weight decay (Chen et al. 2025)
        p -= s * u
    polar_express: orthogonalise with the Polar Express coefficients (Amsel et al. 2025) instead of the fixed quintic.
    Cautious weight decay ("Cautious Weight Decay", Chen et al. 2025, arXiv:2510.12402) decays only the entries whose
    update already moves them towards zero; it scales with the scheduled lr, so it decays with it.
    ns_dtype: the Newton-Schulz compute dtype, "float32" or "bfloat16" ("" or None: ns_dtype_for the parameter's
    device: nanotrain.common.fast_bf16); a string so the optimizer state stays loadable with
    torch.load(weights_only=True). lr, momentum and weight_decay are read from the param group at every step
    (schedules may change them, e.g. the momentum warm-up 0.85 -> 0.95). Parameters whose grad is None are skipped.
    zeropower (attribute): the orthogonalisation, None (zeropower_via_newtonschulz5) unless
    nanotrain.optim.compile_optimizer_step compiled it. state_dict/load_state_dict are the standard
    torch.optim.Optimizer ones (state: "momentum_buffer", same shape/dtype as p, and with beta2 > 0 "second_moment";
    DTensors sharded like p under FSDP2). The defaults are plain Muon; nanotrain.optim.setup_optimizers turns the rest
    on. Raises ValueError for a parameter that is not 2-D, a negative lr/momentum/weight_decay, beta2 outside [0, 1)
    or an unknown ns_dtype.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="", polar_express=False,
                 beta2=0.0, weight_decay=0.0):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or not 0 <= beta2 < 1:
            raise ValueError(f"Muon: expected lr >= 0, 0 <= momentum < 1, weight_decay >= 0 and 0 <= beta2 < 1, got "
                             f"lr={lr}, momentum={momentum}, weight_decay={weight_decay}, beta2={beta2}")
        if ns_dtype and ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon: ns_dtype={ns_dtype!r}: expected '', 'float32' or 'bfloat16'")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      ns_dtype=ns_dtype or "", polar_express=polar_express, beta2=beta2,
                                      weight_decay=weight_decay))
        self.zeropower = None  # zeropower_via_newtonschulz5; nanotrain.optim.compile_optimizer_step compiles it
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(f"Muon only handles 2-D parameters, got shape {tuple(p.shape)}")

    def load_state_dict(self, state_dict):
        """The standard load, except that each group keeps this run's ns_dtype (a setting, not state: a resumed run
        uses the dtype it was started with now, and states saved before the setting existed load too)."""
        ns = [group["ns_dtype"] for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, value in zip(self.param_groups, ns):
            group["ns_dtype"] = value

    @torch.no_grad()
    def step(self, closure=None, finite=None):
        """
        One Muon update of every parameter that has a gradient. finite: None (True) or a 0-d bool tensor on the
        parameters' device; False leaves every parameter and state tensor bit for bit unchanged, decided on the
        device (no host read): the gradient is masked to 0 first (0 * NaN is NaN), the momentum's and NorMuon's EMA
        weights are 0 and so is the update (p - lr * 0 = p, no decay). Returns closure() if given, else None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            ns_dtype = NS_DTYPES.get(group["ns_dtype"])  # None ("" setting): chosen per device
            for p in group["params"]:
                if p.grad is None:
                    continue
                ok = finite if finite is not None else torch.ones((), dtype=torch.bool, device=p.device)
                g = p.grad  # the gate works on the local tensors (FSDP2: a DTensor's shard), in place
                _local(g).masked_fill_(~ok, 0.0)  # before any use: 0 * NaN is NaN
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                _local(buf).lerp_(_local(g), torch.where(ok, 1 - momentum, 0.0))
                update = g.lerp(buf, momentum) if group["nesterov"] else buf
                beta2 = group["beta2"]
                then = ((lambda u, state=state, ok=ok, beta2=beta2: normalize_variance(u, state, beta2, ok))
                        if beta2 > 0 else None)
                compiled = {} if self.zeropower is None else {"zeropower": self.zeropower}
                update = orthogonalize(update, group["ns_steps"], ns_dtype, group["polar_express"], then,
                                       **compiled).to(p.dtype)
                _local(update).masked_fill_(~ok, 0.0)  # p - s * 0 = p, and no decay below
                step_size = lr * max(1.0, p.size(-2) / p.size(-1)) ** 0.5  # a DTensor's size is the full matrix's
                if group["weight_decay"] > 0:  # cautious: only where the update moves p towards zero as well
                    p.sub_(p * (update * p > 0) * (step_size * group["weight_decay"]))
                p.add_(update, alpha=-step_size)
        return loss
