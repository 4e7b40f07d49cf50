"""
Muon: MomentUm Orthogonalized by Newton-Schulz, the optimizer of the transformer blocks' 2-D matrices (nanochat's
choice). Sources: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (blog post, 2024,
https://kellerjordan.github.io/posts/muon/) and KellerJordan/modded-nanogpt; nanochat's `nanochat/optim.py`.

By shape: in each step the matrices of one param group with the same shape, dtype and device are stacked into one
(n, rows, cols) batch and updated together: momentum, one batched orthogonalisation (Polar Express / Newton-Schulz on
batched matmuls), NorMuon, cautious weight decay, update. The four functions of a stack (muon_momentum,
zeropower_via_newtonschulz5, variance_normalized, muon_update) are functions of tensors whose hyperparameters travel
in one small fp32 tensor, so nanotrain.optim.compile_optimizer_step compiles each once per shape and a schedule
moving the lr or the momentum every step does not recompile. The state stays per parameter ("momentum_buffer",
"second_moment"), as torch.optim.Optimizer saves it, so checkpoints do not depend on the stacking (and load as they
did before it). On CPU the eager step equals the one-matrix-at-a-time step bit for bit.

Shared across ranks (process_group, under DDP; always under FSDP2): the gradients are the same on every rank, so
every rank would compute the same orthogonalisation. Instead each stack is split into world_size chunks of
ceil(n / world_size) matrices (zero matrices past n), each rank orthogonalises and normalises (NorMuon) its chunk,
and the results are gathered, so each rank does 1/world_size of the matmuls; the momentum and the update are
elementwise and run on every rank's tensors, which keeps the optimizer state as a single process keeps it and the
checkpoints as it writes them. The idea is that of nanochat's DistMuon (its MuonAdamW: the stacked parameters of one
shape divided among the ranks, each computing the update of the ones it owns, then all-gathered) and of the
distributed Muon of Liu et al. 2025 ("Muon is Scalable for LLM Training", Moonlight, arXiv:2502.16982: the momentum
of ZeRO-sharded matrices gathered into whole matrices for Newton-Schulz, the update cut back to the local shard).
Under DDP: the chunks are all-gathered. Under FSDP2 (nanotrain.fsdp: DTensors sharded on dim 0) Newton-Schulz needs
whole matrices (the polar factor of a block of rows is not a block of the polar factor): the momentum is updated on
the local rows, one all-to-all brings each rank the rows of its chunk's matrices from every rank, and after the
orthogonalisation and NorMuon a second all-to-all sends every rank its rows back (and the small second moments are
all-gathered), so each rank receives about 1/world_size of the stack instead of all of it. Each stack's gather runs
while the next stack is orthogonalised.
"""

import torch
import torch.distributed as dist

from nanotrain.common import fast_bf16

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
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@torch.no_grad()
def zeropower_via_newtonschulz5(G, steps=5, dtype=None, polar_express=False):
    """
    Approximate orthogonalisation of G (the polar factor U V^T of G = U S V^T) by `steps` iterations of the quintic
    Newton-Schulz map X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315), written as
    two addmm (baddbmm for a stack) calls so the scalars ride in the matmuls (no separate elementwise passes).
    Source: Keller Jordan, "Muon" (2024) and modded-nanogpt.

    The coefficients trade exactness for speed: singular values are not driven to exactly 1 but into a band around
    it (about 0.68..1.2 once converged; the tiniest ones of a near-singular input may still be below it after 5
    steps), which is all Muon needs.

    polar_express=True uses POLAR_EXPRESS_COEFFS instead, step i with the i-th triple (at most 5 steps; Amsel et al.
    2025): in the same 5 steps the singular values land in a narrower band around 1 than the fixed quintic's.

    G: (rows, cols) or a stack (n, rows, cols) of any float dtype, each matrix on its own: X is first divided by its
    Frobenius norm (+1e-7; times 1.01 with polar_express) so the spectral norm is <= 1, and the iteration runs on the
    wide orientation (transposed when rows > cols). A zero matrix stays zero.
    dtype: compute dtype; default ns_dtype_for(G.device) (bf16 on CUDA; on CPU bf16 only where its matmuls are fast).
    Returns a tensor of G's shape in the compute dtype. Raises ValueError if G is not 2-D or 3-D.
    """
    if G.ndim not in (2, 3):
        raise ValueError(f"zeropower_via_newtonschulz5 expects a matrix or a stack of them, got shape {tuple(G.shape)}")
    if dtype is None:
        dtype = ns_dtype_for(G.device)
    if G.ndim == 3 and G.device.type == "cpu" and min(G.shape[-2:]) < 8:
        # ATen's CPU bmm computes products this small (< 400 multiply-adds per matrix) in its own loop, which rounds
        # differently from mm; so tiny matrices, which gain nothing from a batch, go one by one, as 2-D ones do
        return torch.stack([zeropower_via_newtonschulz5(g, steps, dtype, polar_express) for g in G])
    coeffs = POLAR_EXPRESS_COEFFS[:steps] if polar_express else [NS_COEFFS] * steps
    X = G.float()
    norm = X.norm() if X.ndim == 2 else X.norm(dim=(-2, -1), keepdim=True)
    X = (X / (norm * (1.01 if polar_express else 1.0) + 1e-7)).to(dtype)
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    mm = torch.addmm if X.ndim == 2 else torch.baddbmm
    for a, b, c in coeffs:  # the scalar terms ride in the matmuls (beta, alpha): no separate elementwise passes
        A = X @ X.mT
        B = mm(A, A, A, beta=b, alpha=c)
        X = mm(X, B, X, beta=a)
    return X.mT if transposed else X


def ns_dtype_for(device):
    """
    The Newton-Schulz compute dtype Muon uses on `device` when none is given: torch.bfloat16 where bf16 matmuls are
    fast (nanotrain.common.fast_bf16: CUDA, as modded-nanogpt and nanochat; on CPU only where they are native), else
    torch.float32 (CPUs that emulate bf16 run it several times slower than fp32). Settled once per process; on CPU
    under torch.distributed the first call is collective, which is why nanotrain.optim.setup_optimizers makes it on
    every rank before the first step. Returns a torch.dtype.
    """
    return torch.bfloat16 if fast_bf16(device) else torch.float32


def variance_normalized(update, second_moment, weight):
    """
    normalize_variance without a state dict, Muon's NorMuon step on a stack: update (..., rows, cols) of whole
    matrices, any float dtype; second_moment (..., rows, 1) or (..., 1, cols) fp32; weight: 1 - beta2, a float or a
    0-d tensor. Returns (the normalised update, like update; the new second moment), no in-place change.
    """
    dim = -1 if update.size(-2) >= update.size(-1) else -2
    u = update.float()
    second_moment = second_moment.lerp(u.square().mean(dim=dim, keepdim=True), weight)
    scaled = u * second_moment.clamp_min(1e-10).rsqrt()
    norm = (lambda t: t.norm()) if u.ndim == 2 else (lambda t: t.norm(dim=(-2, -1), keepdim=True))
    return scaled.mul_(norm(u) / norm(scaled).clamp_min(1e-10)).to(update.dtype), second_moment


def normalize_variance(update, state, beta2):
    """
    NorMuon's variance normalisation (Li et al. 2025, "NorMuon: Making Muon more efficient and scalable",
    arXiv:2510.05491), as nanochat applies it: keeps an EMA (factor beta2, from zero) of the mean square of the
    orthogonalised update along its longer side (one statistic per row of a tall or square matrix, per column of a wide
    one) in state["second_moment"] ((rows, 1) or (1, cols), fp32), divides the update by its square root and rescales
    the result to the update's own Frobenius norm: the update's size is unchanged, its rows (or columns) are evened
    out. update: (rows, cols) or a stack (n, rows, cols) (statistic (n, rows, 1) or (n, 1, cols), each matrix
    rescaled to its own norm), any float dtype, the whole matrix (under FSDP2 Muon applies it before cutting the rows
    back, so the statistic is a plain tensor, the same on every rank). Returns a tensor like update.
    """
    dim = -1 if update.size(-2) >= update.size(-1) else -2
    if "second_moment" not in state:
        state["second_moment"] = torch.zeros_like(update.float().mean(dim=dim, keepdim=True))
    out, state["second_moment"] = variance_normalized(update, state["second_moment"], 1 - beta2)
    return out


def muon_momentum(grads, bufs, hyper, finite=None, nesterov=True):
    """
    The momentum part of Muon's step on a stack, in place (the stacks are the step's own copies: no second copy of
    the stack is made): grads, bufs (n, rows, cols) of one dtype; hyper: fp32 tensor (momentum, 1 - momentum, ...) on
    their device (muon_hyperparameters); finite: None or a 0-d bool tensor, False meaning the gradients are not to be
    used (set to zero first, as 0 * NaN is NaN; with muon_hyperparameters' zero weights the buffers then stay as they
    were). bufs becomes lerp(bufs, grads, 1 - momentum); returns the update: with nesterov lerp(grads, new bufs,
    momentum), written into grads, else bufs itself.
    """
    if finite is not None:
        grads.masked_fill_(finite.logical_not(), 0.0)
    bufs.lerp_(grads, hyper[1])
    return grads.lerp_(bufs, hyper[0]) if nesterov else bufs


def muon_update(params, ortho, hyper):
    """
    The end of Muon's step on a stack, in place on params (n, rows, cols; the step's own copy): cautious weight decay
    and the update by ortho (the orthogonalised, NorMuon-normalised update of the same rows, any float dtype):
    p - s * wd * p * (u * p > 0) - s * u with s = lr * sqrt(max(1, rows / cols)) (hyper: fp32 tensor (momentum,
    1 - momentum, s, s * wd, 1 - beta2), muon_hyperparameters; all zero: params stay as they were). Returns None.
    """
    u = ortho.to(params.dtype)
    params.sub_((params * (u * params > 0)).mul_(hyper[3]))  # cautious: only where u moves p towards zero too
    params.addcmul_(u, -hyper[2])  # p + (-s) u: what p.add_(u, alpha=-s) computes


def muon_hyperparameters(group, shape, device, finite=None):
    """
    The hyperparameters of a stack of `shape` (rows, cols) in `group` as one fp32 tensor on `device`: (momentum,
    1 - momentum, s, s * weight_decay, 1 - beta2) with s = lr * sqrt(max(1, rows / cols)), computed in Python's double
    (one host-to-device copy, no read back). finite: None or a 0-d bool tensor on `device`; where False, all zeros:
    the step's weights are then 0, and with the gradients masked to zero (muon_momentum) every lerp, the decay and the
    update leave their tensor as it was (x + 0 * finite = x, up to the sign of an exact zero), decided on the device.
    """
    s = group["lr"] * max(1.0, shape[-2] / shape[-1]) ** 0.5
    m = group["momentum"]
    hyper = torch.tensor([m, 1 - m, s, s * group["weight_decay"], 1 - group["beta2"]], dtype=torch.float32,
                         device=device)
    return hyper if finite is None else torch.where(finite, hyper, torch.zeros_like(hyper))


def _local(t):
    """The local shard of a DTensor (FSDP2; the same storage, so in-place updates land in it), else t itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def _all_gather(out, chunk, group, async_op=True):
    """all_gather of `chunk` into `out` (world_size chunks along dim 0) over `group` (gloo has no
    all_gather_into_tensor: a list of out's views there). Returns the Work to wait() for (async_op), else None."""
    if dist.get_backend(group) == "gloo":
        return dist.all_gather(list(out.chunk(dist.get_world_size(group))), chunk.contiguous(), group=group,
                               async_op=async_op)
    return dist.all_gather_into_tensor(out, chunk.contiguous(), group=group, async_op=async_op)


def _rows_to_matrices(local, rows, group):
    """
    FSDP2's layout to whole matrices: local (n, local rows, cols) is this rank's rows of a stack of n matrices of
    `rows` rows, cut as fully_shard cuts dim 0 (torch.chunk: ceil(rows / world) rows per rank, the last ranks fewer or
    none). One all-to-all over `group`: rank r receives every rank's rows of matrices r * per .. (r + 1) * per - 1,
    per = ceil(n / world) (zero matrices past n). Returns those whole matrices (per, rows, cols). Collective.
    """
    world, (n, have, cols) = dist.get_world_size(group), local.shape
    per, chunk = -(-n // world), -(-rows // world)
    send = local.new_zeros(per * world, chunk, cols)
    send[:n, :have] = local
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # piece q of recv: rank q's rows of this rank's matrices
    return recv.view(world, per, chunk, cols).transpose(0, 1).reshape(per, world * chunk, cols)[:, :rows]


def _matrices_to_rows(whole, n, have, group):
    """
    The way back of _rows_to_matrices: whole (per, rows, cols), this rank's matrices; one all-to-all (launched,
    not waited for) sends each rank its rows of them. Returns (work, a function of no arguments giving this rank's
    rows (n, have, cols) of all n matrices once work.wait() returned).
    """
    world, (per, rows, cols) = dist.get_world_size(group), whole.shape
    chunk = -(-rows // world)
    send = whole.new_zeros(per, world * chunk, cols)
    send[:, :rows] = whole
    send = send.view(per, world, chunk, cols).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)  # piece q: this rank's rows of rank q's matrices
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    return work, (lambda: recv.view(world * per, chunk, cols)[:n, :have])


class Muon(torch.optim.Optimizer):
    """
    Muon optimizer for 2-D parameters (Keller Jordan 2024; modded-nanogpt; nanochat), by shape (this module's
    docstring).

    Per parameter p (rows, cols) with gradient g, each step:
        buf = lerp(buf, g, 1 - momentum)                       # EMA momentum buffer, starts at zero
        u = lerp(g, buf, momentum) if nesterov else buf        # Nesterov-style look-ahead
        u = zeropower_via_newtonschulz5(u, ns_steps)           # orthogonalise (the whole matrix)
        u = normalize_variance(u) if beta2 > 0                 # NorMuon (Li et al. 2025)
        s = lr * sqrt(max(1, rows / cols))
        p -= s * weight_decay * p * (u * p > 0)                # cautious weight decay (Chen et al. 2025)
        p -= s * u
    computed for all the parameters of one shape (and dtype, device) in a group at once, as a stack.
    polar_express: orthogonalise with the Polar Express coefficients (Amsel et al. 2025) instead of the fixed quintic.
    Cautious weight decay ("Cautious Weight Decay", Chen et al. 2025, arXiv:2510.12402) decays only the entries whose
    update already moves them towards zero; it scales with the scheduled lr, so it decays with it.
    ns_dtype: the Newton-Schulz compute dtype, "float32" or "bfloat16" ("" or None: ns_dtype_for the parameter's
    device: nanotrain.common.fast_bf16); a string so the optimizer state stays loadable with
    torch.load(weights_only=True). lr, momentum and weight_decay are read from the param group at every step
    (schedules may change them, e.g. the momentum warm-up 0.85 -> 0.95). Parameters whose grad is None are skipped.
    process_group: None (every rank orthogonalises everything: one process, or steps the ranks do not take in
    lockstep, such as a memory probe) or a torch.distributed process group whose ranks all hold the same parameters
    and gradients (DDP after its all-reduce) and all call step() together: each then orthogonalises 1/world_size of
    every stack and the results are all-gathered. DTensor parameters (FSDP2) always share the work over their mesh.
    fns (attribute): {"momentum": muon_momentum, "zeropower": zeropower_via_newtonschulz5, "normalize":
    variance_normalized, "update": muon_update}, which nanotrain.optim.compile_optimizer_step replaces by their
    compiled versions. state_dict/load_state_dict are the
    standard torch.optim.Optimizer ones (state per parameter: "momentum_buffer", same shape/dtype as p, and with
    beta2 > 0 "second_moment" (rows, 1) or (1, cols) fp32; the buffers are DTensors sharded like p under FSDP2, the
    second moments plain). The defaults are plain Muon; nanotrain.optim.setup_optimizers turns the rest on.
    Raises ValueError for a parameter that is not 2-D, a negative lr/momentum/weight_decay, beta2 outside [0, 1) or an
    unknown ns_dtype.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype="", polar_express=False,
                 beta2=0.0, weight_decay=0.0, process_group=None):
        if lr < 0 or not 0 <= momentum < 1 or weight_decay < 0 or not 0 <= beta2 < 1:
            raise ValueError(f"Muon: expected lr >= 0, 0 <= momentum < 1, weight_decay >= 0 and 0 <= beta2 < 1, got "
                             f"lr={lr}, momentum={momentum}, weight_decay={weight_decay}, beta2={beta2}")
        if ns_dtype and ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon: ns_dtype={ns_dtype!r}: expected '', 'float32' or 'bfloat16'")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      ns_dtype=ns_dtype or "", polar_express=polar_express, beta2=beta2,
                                      weight_decay=weight_decay))
        self.process_group = process_group
        self.fns = {"momentum": muon_momentum, "zeropower": zeropower_via_newtonschulz5,
                    "normalize": variance_normalized, "update": muon_update}
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
        One Muon update of every parameter that has a gradient, stack by stack. finite: None (the gradients are
        used) or a 0-d bool tensor on the parameters' device: where it is False every parameter and state tensor is
        left as it was, bit for bit up to the sign of an exact zero, decided on the device (no host read; the
        gradients are masked, the step's weights zeroed: muon_hyperparameters). Collective when process_group is set or
        the parameters are DTensors. Returns closure() if given, else None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        finish = None  # the previous stack's end: its gather runs while this stack is orthogonalised
        for group in self.param_groups:
            stacks = {}
            for p in group["params"]:
                if p.grad is not None:
                    stacks.setdefault((tuple(p.shape), p.dtype, p.device), []).append(p)
            for params in stacks.values():
                started = self._start_stack(group, params, finite)
                if finish is not None:
                    finish()
                finish = started if started.waits else started()  # nothing to overlap: ended now (returns None)
        if finish is not None:
            finish()
        return loss

    def _start_stack(self, group, params, finite):
        """The first half of the step of `params`, all of one shape, dtype and device (Muon.step): the momentum,
        this rank's share of the orthogonalisation and NorMuon, the gather of the results launched. Returns the
        second half, a function of no arguments (attribute `waits`: whether it waits for a collective) that writes
        the parameters and the rest of the state, and returns None."""
        fns, shape, n = self.fns, tuple(params[0].shape), len(params)
        normuon = group["beta2"] > 0
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad)
            if normuon and "second_moment" not in state:
                side = (shape[0], 1) if shape[0] >= shape[1] else (1, shape[1])
                state["second_moment"] = torch.zeros(side, dtype=torch.float32, device=_local(p).device)
        bufs = [_local(self.state[p]["momentum_buffer"]) for p in params]
        hyper = muon_hyperparameters(group, shape, bufs[0].device, finite)  # finite False: all zero
        new_bufs = torch.stack(bufs)
        u = fns["momentum"](torch.stack([_local(p.grad) for p in params]), new_bufs, hyper, finite, group["nesterov"])
        torch._foreach_copy_(bufs, list(new_bufs.unbind(0)))
        have = u.size(1)  # this rank's rows (all of them unless sharded)
        del new_bufs, bufs

        mesh = getattr(params[0], "device_mesh", None)
        pg = mesh.get_group() if mesh is not None else self.process_group
        world = dist.get_world_size(pg) if pg is not None else 1
        per = -(-n // world)  # matrices per rank
        first = min(dist.get_rank(pg) * per, n) if world > 1 else 0  # this rank's first matrix
        if mesh is not None and world > 1:  # FSDP2: the rows of this rank's matrices from every rank
            u = _rows_to_matrices(u, shape[0], pg)
        elif world > 1:  # DDP: every rank holds every matrix, each takes its chunk (zero-padded to `per`)
            u = u[first:first + per]
            if u.size(0) < per:
                u = torch.cat([u, u.new_zeros(per - u.size(0), *u.shape[1:])])
        ns_dtype = NS_DTYPES.get(group["ns_dtype"]) or ns_dtype_for(u.device)  # eagerly: it may measure the CPU
        ortho = fns["zeropower"](u, group["ns_steps"], ns_dtype, group["polar_express"])
        del u
        moments, works = None, []
        if normuon:  # on whole matrices: this rank's (zero-padded past n, like the update) or all of them
            moments = [self.state[p]["second_moment"] for p in params]
            mine = moments[first:first + per] if world > 1 else moments
            mine = torch.stack(mine + [torch.zeros_like(moments[0])] * (ortho.size(0) - len(mine)))
            ortho, new_moments = fns["normalize"](ortho, mine, hyper[4])
            if world > 1:  # every rank's second moments (small)
                gathered = new_moments.new_empty(per * world, *new_moments.shape[1:])
                works.append(_all_gather(gathered, new_moments, pg))
                new_moments = gathered
        if world > 1:  # the updates of every rank's matrices
            if mesh is not None:  # FSDP2: back to this rank's rows of every matrix
                work, local_rows = _matrices_to_rows(ortho, n, have, pg)
                works.append(work)
            else:
                gathered_ortho = ortho.new_empty(per * world, *ortho.shape[1:])
                works.append(_all_gather(gathered_ortho, ortho, pg))
                local_rows = (lambda: gathered_ortho[:n])
            del ortho
        else:
            local_rows = (lambda: ortho)

        def finish():
            for work in works:
                work.wait()
            if moments is not None:
                torch._foreach_copy_(moments, list(new_moments[:n].unbind(0)))
            locals_ = [_local(p) for p in params]
            new_params = torch.stack(locals_)
            fns["update"](new_params, local_rows(), hyper)
            torch._foreach_copy_(locals_, list(new_params.unbind(0)))
        finish.waits = bool(works)
        return finish
