"""
The hand-written autograd functions of the model, each equal in value to a plain PyTorch expression and cheaper in
memory than autograd's version of it:
- norm (_RMSNorm): F.rms_norm(x, (x.size(-1),)), keeping x in its own dtype for backward;
- relu_squared_proj (_ReluSquaredProj): F.relu(h).square() @ weight.T, keeping relu(h) but not its square;
- linear_cross_entropy (_LinearCrossEntropy): F.cross_entropy(softcap(hidden @ weight.T), targets), in chunks of
  tokens, never holding the (tokens, vocab) logits.

The chunked head: for each chunk of rows the logits are computed, soft-capped, reduced to the loss, and (when a
gradient is needed) turned at once into that chunk's share of the gradients of the hidden states and of the head
weight; the chunk's logits are then freed. With reduction "mean" or "sum" the gradient is finished in the forward
pass and backward only scales it by the incoming gradient, so the head costs the same three matmuls as the naive path
(no recomputation); with reduction "none" the per-token log-sum-exp is kept and backward recomputes each chunk's
logits. Pure PyTorch, the same code on every device, deterministic (a fixed loop, no atomics). The method of Liger
Kernel's FusedLinearCrossEntropy (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels for LLM Training") and of
Cut Cross-Entropy (Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language Models"), with the logit
soft-cap z = c * tanh(a / c) of Gemma 2 folded in: dz/da = 1 - (z / c)^2. torch.nn.functional.linear_cross_entropy
(torch 2.13) chunks the same way but has no soft-cap, and under torch.compile its chunked path falls back to eager;
so nanotrain has its own.
"""

import torch
import torch.nn.functional as F

IGNORE_INDEX = -1


def norm(x):
    """
    Parameter-free RMSNorm over the last dimension (any shape, dtype preserved), computed in fp32 as F.rms_norm
    does. For a bf16/fp16 x that needs a gradient, the backward keeps x itself and the fp32 1/rms (_RMSNorm), where
    F.rms_norm's backward keeps an fp32 copy of x (twice the bytes; on CUDA autocast upcasts its input likewise).
    """
    if x.dtype == torch.float32 or not (torch.is_grad_enabled() and x.requires_grad):
        return F.rms_norm(x, (x.size(-1),))
    return _RMSNorm.apply(x)


class _RMSNorm(torch.autograd.Function):
    """
    y = x / sqrt(mean(x^2) + eps) in fp32, returned in x's dtype, eps = fp32 machine epsilon (F.rms_norm's default
    for a bf16/fp16 input, computed in fp32): the same values as F.rms_norm. Saves x (its own dtype) and 1/rms
    (fp32, one per row), the memory-efficient layout of Apex's FusedRMSNorm and Liger's RMSNorm; backward:
    dx = r * (g - y * mean(g * y)) with r = 1/rms, y = x * r, all in fp32.
    """

    @staticmethod
    def forward(ctx, x):
        xf = x.float()
        r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + torch.finfo(torch.float32).eps)
        ctx.save_for_backward(x, r)
        return (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, r = ctx.saved_tensors
        y, g = x.float() * r, grad.float()
        return (r * (g - y * (g * y).mean(-1, keepdim=True))).to(x.dtype)


class _ReluSquaredProj(torch.autograd.Function):
    """
    c_proj(relu(h)^2), i.e. relu(h).square() @ weight.T with weight (model_dim, 4 * model_dim) cast to h's dtype (the
    autocast dtype when autocast is on: h is c_fc's output), same values as the two ops in eager. Backward keeps only
    relu(h) and recomputes its square for the weight's gradient, where eager autograd keeps both (the "selective
    activation recomputation" of Korthikanti et al. 2022, applied to the activation function): 8 bytes per token per
    model_dim less under bf16. dL/dh = 2 relu(h) * (g @ weight); dL/dweight = g.T @ relu(h)^2.
    """

    @staticmethod
    def forward(ctx, h, weight):
        r = F.relu(h)
        w = weight.to(h.dtype)
        ctx.save_for_backward(r, w)
        ctx.weight_dtype = weight.dtype
        return r.square() @ w.t()

    @staticmethod
    def backward(ctx, grad):
        r, w = ctx.saved_tensors
        g = grad.to(r.dtype)
        grad_weight = (g.flatten(0, -2).t() @ r.square().flatten(0, -2)).to(ctx.weight_dtype)
        return (g @ w).mul_(r).mul_(2), grad_weight


def relu_squared_proj(h, proj):
    """
    F.relu(h).square() @ weight.T for h (..., 4 * model_dim) and weight (model_dim, 4 * model_dim) cast to h's dtype:
    the MLP's second half (c_proj of relu(h)^2). Same values as the two ops in eager; see _ReluSquaredProj for memory.
    proj: the weight, or the nn.Linear holding it; a Linear with its own matmul (nanotrain.fp8's float8 Linear, told
    by its forward) is called on relu(h)^2 instead, so that its matmul runs (autograd then keeps the square).
    """
    if isinstance(proj, torch.nn.Module):
        if type(proj).forward is not torch.nn.Linear.forward:
            return proj(F.relu(h).square())
        proj = proj.weight
    return _ReluSquaredProj.apply(h, proj)


def chunk_size_for(num_tokens, model_dim, vocab_size):
    """
    Tokens per chunk (int) for `num_tokens` hidden states of width `model_dim` and a vocabulary of `vocab_size`: the
    smallest power of two at least num_tokens * model_dim / vocab_size and at least 256 (so a chunk's logits hold
    about as many numbers as all the hidden states, and a chunk's matmul stays large enough to run at full speed),
    at most num_tokens. A function of the shapes only, so every step of a run, and torch.compile, sees the same
    chunks.
    """
    want = max(256, -(-num_tokens * model_dim // vocab_size))
    return max(1, min(num_tokens, 1 << (want - 1).bit_length()))


def _chunk_logits(hidden, weight, softcap):
    """
    fp32 logits (rows, vocab) of hidden (rows, d) @ weight (vocab, d).T (one compute dtype), soft-capped. On CPU the
    cap c * tanh(a / c) is computed as c - 2c / (exp(2a / c) + 1), the same function (equal to fp32 roundoff; exp
    overflowing to inf gives c), because torch's CPU tanh is slower than those five in-place passes (dev/LOG.md,
    "Where a step's time goes"); on GPUs, where each pass costs memory traffic, tanh it is.
    """
    z = (hidden @ weight.t()).float()
    if softcap and z.device.type == "cpu":
        z = z.mul_(2.0 / softcap).exp_().add_(1.0).reciprocal_().mul_(-2.0 * softcap).add_(softcap)
    elif softcap:
        z = torch.tanh(z.div_(softcap)).mul_(softcap)
    return z


def _chunk_grads(z, lse, targets, scale, hidden, weight, softcap, grad_weight):
    """
    From one chunk's soft-capped fp32 logits z (rows, vocab) (overwritten), their log-sum-exp (rows,), targets
    (rows,) and per-row weights `scale` (rows,) fp32 (0 for ignored targets), with hidden (rows, d) and weight
    (vocab, d) in the compute dtype: adds the chunk's share of d loss / d weight to grad_weight (vocab, d) fp32 in
    place and returns d loss / d hidden (rows, d) in the compute dtype.
    d loss_i / d z_i = softmax(z_i) - onehot(target_i); through the soft-cap, d z / d a = 1 - (z / c)^2.
    """
    cap_grad = 1.0 - (z / softcap).square_() if softcap else None
    g = z.sub_(lse[:, None]).exp_()  # softmax
    g.scatter_add_(1, targets.clamp(min=0)[:, None], torch.full_like(lse, -1.0)[:, None])
    g.mul_(scale[:, None])
    if cap_grad is not None:
        g.mul_(cap_grad)
    g = g.to(hidden.dtype)
    grad_weight.add_(g.t() @ hidden)
    return g @ weight


class _LinearCrossEntropy(torch.autograd.Function):
    """See linear_cross_entropy. The matmuls run in `dtype`; the gradients are given in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, hidden_in, weight_in, targets, softcap, chunk_size, reduction, dtype, need_grad):
        hidden, weight = hidden_in.to(dtype), weight_in.to(dtype)
        n = hidden.size(0)
        valid = targets != IGNORE_INDEX
        losses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lses = torch.empty(n, dtype=torch.float32, device=hidden.device)
        precompute = need_grad and reduction != "none"
        if precompute:  # the gradient of loss "sum" per token is 1, of "mean" 1/count (0 if nothing counts)
            count = valid.sum()
            weight_per_token = 1.0 / count.clamp(min=1) if reduction == "mean" else torch.ones((), device=hidden.device)
            grad_hidden = torch.empty_like(hidden_in)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for i in range(0, n, chunk_size):
            h, t, v = hidden[i:i + chunk_size], targets[i:i + chunk_size], valid[i:i + chunk_size]
            z = _chunk_logits(h, weight, softcap)
            lse = torch.logsumexp(z, dim=-1)
            target_logit = z.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
            losses[i:i + chunk_size] = torch.where(v, lse - target_logit, 0.0)
            lses[i:i + chunk_size] = lse
            if precompute:
                grad_hidden[i:i + chunk_size] = _chunk_grads(z, lse, t, v * weight_per_token, h, weight, softcap,
                                                             grad_weight)
        if precompute:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight_in.dtype))
        elif need_grad:
            ctx.save_for_backward(hidden_in, weight_in, targets, lses)
        ctx.softcap, ctx.chunk_size, ctx.dtype, ctx.precompute = softcap, chunk_size, dtype, precompute
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / valid.sum() if reduction == "mean" else total

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.precompute:  # grad_loss is a scalar
            grad_hidden, grad_weight = ctx.saved_tensors
            return (grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype),
                    None, None, None, None, None, None)
        hidden_in, weight_in, targets, lses = ctx.saved_tensors  # reduction "none": grad_loss is (n,)
        hidden, weight = hidden_in.to(ctx.dtype), weight_in.to(ctx.dtype)
        scale = torch.where(targets != IGNORE_INDEX, grad_loss.float(), 0.0)
        grad_hidden = torch.empty_like(hidden_in)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        c = ctx.chunk_size
        for i in range(0, hidden.size(0), c):
            h = hidden[i:i + c]
            z = _chunk_logits(h, weight, ctx.softcap)
            grad_hidden[i:i + c] = _chunk_grads(z, lses[i:i + c], targets[i:i + c], scale[i:i + c], h, weight,
                                                ctx.softcap, grad_weight)
        return grad_hidden, grad_weight.to(weight_in.dtype), None, None, None, None, None, None


def linear_cross_entropy(hidden, weight, targets, softcap=None, reduction="mean", chunk_size=None):
    """
    Cross-entropy of the logits softcap * tanh((hidden @ weight.T) / softcap) (no cap when softcap is None or 0)
    against `targets`, equal to F.cross_entropy(logits.float(), targets, ignore_index=-1, reduction=reduction) but
    computed chunk_size tokens at a time (see the module docstring), never holding the full logits.

    hidden: (N, d) float, the normed final hidden states; weight: (vocab, d) float, the head's weight; targets:
    int64 (N,), IGNORE_INDEX (-1) = not counted. The matmuls run in the autocast dtype when autocast is on for
    hidden's device (as nn.Linear would), else in weight's dtype; logits, log-sum-exp and the loss are fp32.
    Returns fp32: a scalar for "mean" (NaN when no target counts) and "sum" (0 then), (N,) for "none" (0 at ignored
    targets). Gradients flow to hidden and weight in their own dtypes (weight's is summed over the chunks in fp32).
    chunk_size: tokens per chunk, default chunk_size_for(N, d, vocab).
    Raises ValueError for an unknown reduction, mismatched shapes or chunk_size < 1.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1) or targets.shape != hidden.shape[:1]:
        raise ValueError(f"linear_cross_entropy: expected hidden (N, d), weight (vocab, d), targets (N,), got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    if chunk_size is None:
        chunk_size = chunk_size_for(hidden.size(0), hidden.size(1), weight.size(0))
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy: chunk_size must be >= 1, got {chunk_size}")
    dev = hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else weight.dtype
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(dev, enabled=False):
        return _LinearCrossEntropy.apply(hidden, weight, targets, softcap or 0.0, chunk_size, reduction, dtype,
                                         need_grad)
