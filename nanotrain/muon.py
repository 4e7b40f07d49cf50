"""
Muon: MomentUm Orthogonalized by Newton-Schulz, the optimizer nanochat uses for the 2-D matrices of the transformer
blocks. Source: Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (blog post, 2024,
https://kellerjordan.github.io/posts/muon/) and KellerJordan/modded-nanogpt; nanochat v0/v1 `nanochat/muon.py`.

Plain single-process optimizer: under DDP the gradients are already averaged when step() runs, so every rank
computes the same update. Under FSDP2 (nanotrain.fsdp) parameters, gradients and momentum buffers are DTensors
sharded on dim 0: Newton-Schulz needs the whole matrix, so each update is all-gathered, orthogonalised on every rank
(the same result everywhere) and only the local rows are applied; the momentum buffers stay sharded.
"""

import sys

import torch
from torch.utils._python_dispatch import _disable_current_modes

from nanotrain.common import all_reduce_scalar, measure_matmul_flops

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # quintic Newton-Schulz coefficients (Keller Jordan 2024, modded-nanogpt)


@torch.no_grad()
def zeropower_via_newtonschulz5(G, steps=5, dtype=None):
    """
    Approximate orthogonalisation of G (the polar factor U V^T of G = U S V^T) by `steps` iterations of the quintic
    Newton-Schulz map X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315), written as
    two addmm calls so the scalars ride in the matmuls (no separate elementwise passes).
    Source: Keller Jordan, "Muon" (2024) and modded-nanogpt.

    The coefficients trade exactness for speed: singular values are not driven to exactly 1 but into a band around
    it (about 0.68..1.2 once converged; the tiniest ones of a near-singular input may still be below it after 5
    steps), which is all Muon needs.

    G: (rows, cols) tensor of any float dtype; X is first divided by its Frobenius norm (+1e-7) so the spectral
    norm is <= 1, and the iteration runs on the wide orientation (transposed when rows > cols).
    dtype: compute dtype; default ns_dtype_for(G.device) (bf16 on CUDA; on CPU bf16 only where its matmuls are fast).
    Returns a tensor of G's shape in the compute dtype. Raises ValueError if G is not 2-D.
    """
    if G.ndim != 2:
        raise ValueError(f"zeropower_via_newtonschulz5 expects a matrix, got shape {tuple(G.shape)}")
    if dtype is None:
        dtype = ns_dtype_for(G.device)
    a, b, c = NS_COEFFS
    X = G.float()
    X = (X / (X.norm() + 1e-7)).to(dtype)
    transposed = G.size(-2) > G.size(-1)
    if transposed:
        X = X.mT
    for _ in range(steps):  # the scalar terms ride in the matmuls (beta, alpha): no separate elementwise passes
        A = X @ X.mT
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.mT if transposed else X


_NS_DTYPE = {}  # device type -> chosen Newton-Schulz dtype (measured once per process)
NS_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ns_dtype_for(device):
    """
    The Newton-Schulz compute dtype Muon uses on `device` when none is given: bf16 on CUDA (as modded-nanogpt and
    nanochat). On CPU it depends on the CPU: bf16 only if a (512, 512) bf16 matmul measures at least 2x the fp32
    throughput (CPUs with AVX512-BF16 or AMX), else fp32 (CPUs that emulate bf16 run it several times slower than
    fp32). The 2x bar keeps the choice stable under timing noise. Measured once per process
    and device type (~0.1 s), with any dispatch mode (FakeTensorMode, MemTracker) switched off. Under torch.distributed
    on CPU the ranks agree (one all-reduce MIN: fp32 unless every rank measured fast bf16), so DDP replicas run the
    same numerics; the first call is then collective, which is why GPT.setup_optimizers makes it on every rank before
    the first step. Returns a torch.dtype.
    """
    kind = torch.device(device).type
    if kind not in _NS_DTYPE:
        if kind == "cuda":
            _NS_DTYPE[kind] = torch.bfloat16
        elif kind == "cpu":
            with _disable_current_modes():  # real tensors even when first asked inside a fake-tensor memory probe
                fp32 = measure_matmul_flops(torch.float32, 512, 0.05)
                bf16 = measure_matmul_flops(torch.bfloat16, 512, 0.05)
                # replicas must run the same numerics: fp32 unless every rank measured fast bf16 (reduced inside the
                # guard: under a fake mode .item() of a real tensor is refused)
                fast = all_reduce_scalar(bf16 >= 2 * fp32, "min", "cpu") > 0
            _NS_DTYPE[kind] = torch.bfloat16 if fast else torch.float32
        else:
            _NS_DTYPE[kind] = torch.float32
    return _NS_DTYPE[kind]


def orthogonalize(update, steps=5, dtype=None):
    """
    zeropower_via_newtonschulz5 of a momentum update (rows, cols). A plain tensor is orthogonalised as it is. A DTensor
    (FSDP2: sharded on dim 0 over the ranks) is all-gathered with full_tensor(), orthogonalised whole on every rank,
    and cut back to this rank's rows (distribute_tensor with src_data_rank=None slices locally, no communication),
    so the result equals the unsharded update's rows; orthogonalising the local rows alone would not (the polar
    factor of a block of rows is not a block of the polar factor). Collective for a DTensor: all ranks must call it.
    dtype: the Newton-Schulz compute dtype (None: ns_dtype_for the update's device).
    Returns a tensor (or DTensor with update's placements) of update's shape in the Newton-Schulz compute dtype.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")  # only loaded (a second to import) when DTensors exist
    if dtensor is None or not isinstance(update, dtensor.DTensor):
        return zeropower_via_newtonschulz5(update, steps=steps, dtype=dtype)
    full = zeropower_via_newtonschulz5(update.full_tensor(), steps=steps, dtype=dtype)
    return dtensor.distribute_tensor(full, update.device_mesh, update.placements, src_data_rank=None)


class Muon(torch.optim.Optimizer):
    """
    Muon optimizer for 2-D parameters (Keller Jordan 2024; modded-nanogpt; nanochat v0/v1).

    Per parameter p (rows, cols) with gradient g, each step:
        buf = lerp(buf, g, 1 - momentum)                       # EMA momentum buffer, starts at zero
        u = lerp(g, buf, momentum) if nesterov else buf        # Nesterov-style look-ahead
        u = zeropower_via_newtonschulz5(u, ns_steps)           # orthogonalise (the whole matrix: orthogonalize())
        p -= lr * sqrt(max(1, rows / cols)) * u
    ns_dtype: the Newton-Schulz compute dtype, "float32" or "bfloat16" ("" or None: ns_dtype_for the parameter's
    device, measured on CPU); a string so the optimizer state stays loadable with torch.load(weights_only=True).
    lr and momentum are read from the param group at every step (schedules may change them, e.g. the momentum
    warm-up 0.85 -> 0.95). Parameters whose grad is None are skipped. state_dict/load_state_dict are the standard
    torch.optim.Optimizer ones (state: "momentum_buffer", same shape/dtype as p; a DTensor sharded like p under FSDP2).
    Raises ValueError for a parameter that is not 2-D, a negative lr/momentum or an unknown ns_dtype.
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, ns_steps=5, ns_dtype=""):
        if lr < 0 or not 0 <= momentum < 1:
            raise ValueError(f"Muon: expected lr >= 0 and 0 <= momentum < 1, got lr={lr}, momentum={momentum}")
        if ns_dtype and ns_dtype not in NS_DTYPES:
            raise ValueError(f"Muon: ns_dtype={ns_dtype!r}: expected '', 'float32' or 'bfloat16'")
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      ns_dtype=ns_dtype or ""))
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
    def step(self, closure=None):
        """One Muon update of every parameter that has a gradient. Returns closure() if given, else None."""
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
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(g)
                buf = state["momentum_buffer"]
                buf.lerp_(g, 1 - momentum)
                update = g.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_steps"], ns_dtype)
                scale = max(1.0, p.size(-2) / p.size(-1)) ** 0.5  # a DTensor's size is the full matrix's
                p.add_(update.to(p.dtype), alpha=-lr * scale)
        return loss
