"""
Orthogonal subspace fine-tuning (OSFT): full fine-tuning in which every chosen weight matrix keeps its top singular
directions, so what the earlier stages put there is not overwritten. Source: Nayak et al., "Sculpting Subspaces:
Constrained Full Fine-Tuning in LLMs for Continual Learning" (arXiv 2504.07097); HF PEFT's OSF tuner is a compact
version. No extra parameters: the model, its checkpoints' model.pt and its exports stay plain.

At the start of a stage each chosen matrix W (m x n) is decomposed, W = U S V^T, and its top k = floor(r * min(m, n))
left and right singular vectors U_h (m x k) and V_h (n x k) are frozen. Every update is projected,
    P(dW) = (I - U_h U_h^T) dW (I - V_h V_h^T),
so U_h^T W and W V_h, and with them the frozen component U_h^T W V_h, never change.

How the projection holds under both optimizers. We chose "project the gradient, then re-project the applied step"
over parametrising the free part (which would hand the optimizers new parameters and change the model's and the
checkpoint's format). Hooks on each optimizer's step (torch.optim.Optimizer.register_step_pre_hook / _post_hook):
  - before the step the gradient of each chosen matrix is projected, G -> P(G), and the matrix is copied. Muon's
    Newton-Schulz map keeps the row and column spaces of its input (it is G times a polynomial in G^T G: Jordan et
    al., Muon; Amsel et al., Polar Express), so Muon's step of a projected gradient lies in the free subspace up to
    what momentum, weight decay and roundoff add; AdamW's moments see only free gradients;
  - after the step the applied update is projected again: W <- W_old + P(W - W_old). This removes everything the
    optimizer put into the frozen directions anyway: decoupled and cautious weight decay (they shrink all of W; after
    the re-projection only the free part decays, the frozen part never), AdamW's elementwise scaling, NorMuon's
    per-row scaling, roundoff. The guarantee therefore rests on the re-projection alone and holds for any optimizer;
    the gradient projection only keeps the optimizers' state in the free subspace, so that little of a step is
    thrown away.
The global gradient norm (clipping, logging) is measured before the projection, on the whole gradient.

Distributed: the SVD is computed on rank 0 only and broadcast, so every rank holds bitwise the same bases (an SVD
computed on each rank need not agree to the bit across machines, libraries or thread counts). The gradients are
identical on every rank after DDP's all-reduce, so every rank applies bitwise the same projected update. Under FSDP2
(a parameter that is a DTensor sharded on dim 0) the full gradient and update are gathered, projected with the same
bases on every rank, and each rank keeps its own rows.

Cost, per chosen matrix: the bases k (m + n) fp32 numbers (the checkpoint's osft.pt), a copy of W during each step,
and 16 m n k FLOPs per step (two projections, each X - U_h (U_h^T X) then Y - (Y V_h) V_h^T).
"""

import re
import time

import torch
import torch.distributed as dist

from nanotrain.common import print0
from nanotrain.errors import UserError

# which matrices --osft_matrices names: the blocks' attention and MLP matrices, and the unembedding
MATRIX_PATTERNS = {
    "attn": r"blocks\.\d+\.attn\.c_(q|k|v|proj)\.weight",
    "mlp": r"blocks\.\d+\.mlp\.c_(fc|proj)\.weight",
    "lm_head": r"lm_head\.weight",
}
DEFAULT_MATRICES = "attn,mlp"


def parse_matrices(spec):
    """The names of MATRIX_PATTERNS in the comma-separated `spec` (e.g. "attn,mlp"), in order. Raises ValueError
    (naming --osft_matrices) for an unknown or empty one."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in MATRIX_PATTERNS]
    if not names or bad:
        raise UserError(f"--osft_matrices={spec!r}: expected a comma-separated list of {', '.join(MATRIX_PATTERNS)}")
    return names


def _full(t):
    """A plain tensor of the whole of `t` (a DTensor is gathered: collective)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _set_full(t, value):
    """Writes the whole `value` into `t`: a DTensor sharded on dim 0 keeps its own rows (torch.chunk's split)."""
    if hasattr(t, "to_local"):
        local = t.to_local()
        sizes = [len(c) for c in torch.arange(value.shape[0]).chunk(dist.get_world_size())]
        start = sum(sizes[:dist.get_rank()])
        local.copy_(value[start:start + local.shape[0]])
    else:
        t.copy_(value)


def project(x, u, v):
    """P(x) = (I - u u^T) x (I - v v^T) for x (m, n), u (m, k), v (n, k) with orthonormal columns; same shape and
    dtype as x (computed in fp32)."""
    x32 = x.float()
    y = x32 - u @ (u.T @ x32)
    y = y - (y @ v) @ v.T
    return y.to(x.dtype)


class OSFT:
    """
    The frozen bases of a model's chosen matrices and the hooks that keep every update out of them (module
    docstring). model: the unwrapped GPT; rank_ratio r in (0, 1): k = floor(r * min(m, n)) directions kept per
    matrix (a matrix where k is 0 is left free); matrices: names of MATRIX_PATTERNS. state: a state_dict() of an
    earlier run (resume): its bases are used instead of a new SVD. Collective under torch.distributed (the bases are
    broadcast from rank 0). allocate_only=True gives bases of the right shapes without an SVD (uninitialised; for
    the automatic batch size's memory probes, where only their bytes matter). Raises UserError for r outside
    (0, 1), an unknown matrix name, or a state made with other settings or for another model.
    """

    def __init__(self, model, rank_ratio, matrices=DEFAULT_MATRICES, state=None, allocate_only=False):
        if not 0 < rank_ratio < 1:
            raise UserError(f"--osft_rank_ratio={rank_ratio}: expected a number in (0, 1) (0 turns OSFT off)")
        self.rank_ratio, self.matrices = float(rank_ratio), parse_matrices(matrices)
        pattern = re.compile("|".join(f"(?:{MATRIX_PATTERNS[n]})" for n in self.matrices))
        self.params = {name: p for name, p in model.named_parameters() if pattern.fullmatch(name)}
        self.bases = {}  # name -> (U_h (m, k), V_h (n, k)), fp32 on the parameter's device
        if state is not None:
            self._load(state)
        else:
            self._decompose(allocate_only)
        self._names = {id(p): name for name, p in self.params.items() if name in self.bases}
        self._old = {}

    @torch.no_grad()
    def _decompose(self, allocate_only):
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        for name, p in self.params.items():
            m, n = p.shape
            k = int(self.rank_ratio * min(m, n))
            if k == 0:
                continue
            if allocate_only:
                self.bases[name] = (torch.empty(m, k, device=p.device), torch.empty(n, k, device=p.device))
                continue
            w = _full(p.detach()).float()
            if rank0:
                u, _, vh = torch.linalg.svd(w, full_matrices=False)
                u, v = u[:, :k].contiguous(), vh[:k].T.contiguous()
            else:
                u, v = w.new_empty(m, k), w.new_empty(n, k)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(u, 0)
                dist.broadcast(v, 0)
            self.bases[name] = (u, v)

    def _load(self, state):
        if state.get("rank_ratio") != self.rank_ratio or state.get("matrices") != self.matrices:
            raise UserError(f"the saved OSFT bases are for rank_ratio={state.get('rank_ratio')} and matrices="
                             f"{state.get('matrices')}, not {self.rank_ratio} and {self.matrices}")
        for name, (u, v) in state["bases"].items():
            p = self.params.get(name)
            if p is None or u.shape[0] != p.shape[0] or v.shape[0] != p.shape[1] or u.shape[1] != v.shape[1]:
                raise UserError(f"the saved OSFT bases of {name} do not fit the model")
            self.bases[name] = (u.float().to(p.device), v.float().to(p.device))

    def state_dict(self):
        """{"rank_ratio", "matrices", "bases": {name: (U_h, V_h)}}: what resume needs (plain values and tensors)."""
        return {"rank_ratio": self.rank_ratio, "matrices": list(self.matrices),
                "bases": {name: (u, v) for name, (u, v) in self.bases.items()}}

    def attach(self, optimizers):
        """Registers the projection hooks on every optimizer of `optimizers` (those holding none of the chosen
        matrices are left as they are). Returns the hook handles."""
        handles = []
        for opt in optimizers:
            if any(id(p) in self._names for g in opt.param_groups for p in g["params"]):
                handles += [opt.register_step_pre_hook(self._before_step),
                            opt.register_step_post_hook(self._after_step)]
        return handles

    def _chosen(self, opt):
        return [(self._names[id(p)], p) for g in opt.param_groups for p in g["params"] if id(p) in self._names]

    @torch.no_grad()
    def _before_step(self, opt, args, kwargs):
        for name, p in self._chosen(opt):
            self._old[name] = _full(p.detach()).float().clone()
            if p.grad is not None:
                u, v = self.bases[name]
                _set_full(p.grad, project(_full(p.grad), u, v))

    @torch.no_grad()
    def _after_step(self, opt, args, kwargs):
        for name, p in self._chosen(opt):
            old = self._old.pop(name)
            u, v = self.bases[name]
            _set_full(p.data, (old + project(_full(p.detach()).float() - old, u, v)).to(p.dtype))

    def nbytes(self):
        """Bytes the bases take (fp32), all matrices together."""
        return sum(u.numel() * 4 + v.numel() * 4 for u, v in self.bases.values())


def setup_osft(model, optimizers, rank_ratio, matrices, ckpt=None):
    """
    What mid_train and chat_sft do at the start of a stage: None when rank_ratio is 0 (OSFT off); else the OSFT of
    `model` (the unwrapped GPT) with its hooks attached to `optimizers`, its bases taken from the resumed checkpoint
    `ckpt` (load_checkpoint's dict; its "osft") or computed now, and one line on rank 0 (matrices, fraction frozen,
    bases' MiB, seconds). Collective under torch.distributed. Raises UserError when `ckpt` has no bases.
    """
    if rank_ratio <= 0:
        return None
    if ckpt is not None and ckpt["osft"] is None:
        raise UserError(f"--resume=True: the checkpoint {ckpt['path']} has no OSFT bases (osft.pt)")
    t0 = time.time()
    osft = OSFT(model, rank_ratio, matrices, state=ckpt["osft"] if ckpt is not None else None)
    osft.attach(optimizers)
    print0(f"OSFT: {len(osft.bases)} matrices ({matrices}), top {rank_ratio:.0%} of their singular directions "
           f"frozen, bases {osft.nbytes() / 2**20:.1f} MiB, {'loaded' if ckpt is not None else 'SVD'} in "
           f"{time.time() - t0:.2f} s")
    return osft
