"""
The GPT model, following nanochat v0/v1 (karpathy/nanochat `nanochat/gpt.py`), itself after nanoGPT/modded-nanogpt:
- rotary position embeddings (Su et al. 2021, "RoFormer"), base 10000, no learned positions
- QK norm (applied after rotary, as nanochat does), parameter-free RMSNorm (F.rms_norm), norm after the embedding
- pre-norm blocks, no biases, ReLU^2 MLP with 4x width (So et al. 2021, "Primer"), untied wte / lm_head
- logit soft-cap 15 * tanh(logits / 15) in fp32 (Gemma 2 / modded-nanogpt), optional GQA (Ainslie et al. 2023)
- zero-initialised output projections; its optimizers (Muon, AdamW) are set up in nanotrain.optim
- options (GPTConfig; each default's evidence: dev/LOG.md, "The ablation table in one stack"): value embeddings on every
  other block (ResFormer-style, as in nanochat 2026 / modded-nanogpt; default on), smear, backout, x0 / resid lambdas.
- packed rows (forward(..., doc_ids=...)): several sequences in one row, each attending only to itself, rotary
  positions restarting at 0 (Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination").
- the head's loss in chunks of tokens (nanotrain.kernels); activation checkpointing per block (nanotrain.gpt).

Activation checkpointing of the GPT's blocks: what a block keeps for backward and what it recomputes, per block,
with torch's own checkpoint (torch.utils.checkpoint.checkpoint, non-reentrant, so it composes with torch.compile, DDP,
FSDP2 and FakeTensorMode). Policies, cheapest in compute first:
- "none": autograd keeps every activation it needs.
- "selective": the outputs of the matmuls and of attention (aten mm, addmm, bmm, baddbmm, the SDPA kernels,
  flash-attn, flex_attention) are kept, everything else of the block (RMSNorm, rotary, QK norm, gates, casts, ReLU^2,
  residual adds, the value-embedding lookup) is recomputed in backward: create_selective_checkpoint_contexts with a
  policy function, the "selective activation recomputation" of Korthikanti et al. 2022 ("Reducing Activation
  Recomputation in Large Transformer Models") and torchtitan's op-level SAC. Recomputes no matmul.
- "full": only the block's input is kept and the whole block is recomputed in backward (Chen et al. 2016, "Training
  Deep Nets with Sublinear Memory Cost"): ~one extra forward of the blocks per step.
Loss and gradients are the same under every policy (the model has no dropout, so no RNG state is replayed).
"""

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from nanotrain.attention import (
    apply_rotary_emb,
    attention,
    attention_windows,
    compute_dtype,
    flash_attn_varlen_func,
    resolve_short_window,
    segment_info,
)
from nanotrain.errors import UserError
from nanotrain.kernels import linear_cross_entropy, norm, relu_squared_proj

SOFTCAP = 15.0
GATE_CHANNELS = 12  # the value-embedding and smear gates read this many leading channels of their input


@dataclass
class GPTConfig:
    max_seq_len: int = 2048  # tokens of context in training
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6  # query heads
    n_kv_head: int = 6  # key/value heads (GQA when < n_head)
    model_dim: int = 768
    # architecture options; each default's evidence: dev/LOG.md, "The ablation table in one stack"
    value_embeds: bool = True  # token-indexed tables added to V through a per-head gate, on alternating layers
    smear: bool = False  # a gated share of the previous token's embedding added to each token's
    backout: bool = False  # subtract a learned share of the middle layer's output before the head
    x0_lambdas: bool = False  # before every block x <- resid_lambda * x + x0_lambda * x0 (x0: the embedding)
    rotary_base: float = 10000.0  # base of the rotary frequencies
    qk_scale: float = 1.0  # attention logits are qk_scale * q.k / sqrt(head_dim) (q, k RMS-normed)
    window_pattern: str = "L"  # sliding windows as nanochat's (nanotrain.attention.attention_windows); L: none
    short_window: int | None = None  # None: default_short_window(max_seq_len), stored resolved (checkpoints keep it)
    __post_init__ = resolve_short_window  # short_window None -> default_short_window(max_seq_len), kept resolved


def has_value_embed(layer_idx, n_layer):
    """Whether block `layer_idx` of `n_layer` gets a value embedding: every other block, the last one always."""
    return layer_idx % 2 == (n_layer - 1) % 2


def config_from_depth(depth, vocab_size, max_seq_len, **options):
    """
    nanochat's depth -> size rule: model_dim = 64 * depth, head_dim 128 where possible (n_head = ceil(model_dim/128),
    reduced until it divides model_dim), n_kv_head = n_head. options: GPTConfig's fields after model_dim (value_embeds
    to short_window). Returns a GPTConfig. Raises UserError if depth < 1.
    """
    if depth < 1:
        raise UserError(f"--depth={depth}: expected an integer >= 1")
    model_dim = depth * 64
    n_head = max(1, math.ceil(model_dim / 128))
    while model_dim % n_head != 0:
        n_head -= 1
    return GPTConfig(max_seq_len=max_seq_len, vocab_size=vocab_size, n_layer=depth, n_head=n_head,
                     n_kv_head=n_head, model_dim=model_dim, **options)


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx, self.n_head, self.n_kv_head = layer_idx, config.n_head, config.n_kv_head
        self.head_dim = config.model_dim // config.n_head
        d = config.model_dim
        self.c_q = nn.Linear(d, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.qk_scale, self.window = config.qk_scale, attention_windows(config)[layer_idx]  # window None: full causal
        # value embedding gate: one per kv head, from the block input's first channels
        self.ve_gate = (nn.Linear(min(GATE_CHANNELS, d), self.n_kv_head, bias=False)
                        if config.value_embeds and has_value_embed(layer_idx, config.n_layer) else None)

    def forward(self, x, cos_sin, kv_cache=None, segments=None, ve=None):
        B, T, _ = x.size()
        x = x.to(compute_dtype(x))  # one copy for c_q, c_k and c_v to share (autocast would cast x for each)
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # value embedding (ResFormer): v + 2 sigmoid(gate) * ve, a gate in (0, 2) per kv head
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate.in_features]))  # (B, T, n_kv_head)
            v = v + gate.unsqueeze(-1).to(v.dtype) * ve.view(B, T, self.n_kv_head, self.head_dim).to(v.dtype)
        q, k = apply_rotary_emb(q, *cos_sin), apply_rotary_emb(k, *cos_sin)
        q, k = norm(q).to(v.dtype), norm(k).to(v.dtype)  # QK norm (autocast may have upcast the norm)
        q = q * self.qk_scale  # sharper attention: the logits' scale on top of 1/sqrt(head_dim)
        y = attention(q, k, v, self.layer_idx, kv_cache, segments, self.window)
        return self.c_proj(y.contiguous().view(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.model_dim, 4 * config.model_dim, bias=False)
        self.c_proj = nn.Linear(4 * config.model_dim, config.model_dim, bias=False)

    def forward(self, x):
        return relu_squared_proj(self.c_fc(x), self.c_proj)


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, cos_sin, kv_cache=None, segments=None, ve=None, x0_mix=None):
        """x: (B, T, model_dim); ve: the value embedding (B, T, kv_dim) or None; x0_mix: (resid_lambda, x0_lambda, x0)
        or None, mixed in first as resid_lambda * x + x0_lambda * x0 (inside: checkpointing keeps the unmixed x)."""
        if x0_mix is not None:
            resid_lambda, x0_lambda, x0 = x0_mix
            x = resid_lambda.to(x.dtype) * x + x0_lambda.to(x.dtype) * x0
        x = x + self.attn(norm(x), cos_sin, kv_cache, segments, ve)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    """
    Decoder-only transformer (see the module docstring). Build on any device, including `torch.device("meta")`
    followed by `model.to_empty(device=...)`; then call init_weights(). Raises UserError for an inconsistent config
    (model_dim % n_head, n_head % n_kv_head, odd head_dim). Modules: wte, blocks[i].attn.{c_q,c_k,c_v,c_proj},
    blocks[i].mlp.{c_fc,c_proj}, lm_head; with the options: value_embeds[str(i)] and blocks[i].attn.ve_gate (value
    embeddings), smear_gate and smear_lambda, backout_lambda, resid_lambdas and x0_lambdas ((n_layer,)); absent
    options are None. Non-persistent buffers cos, sin: (1, 10*max_seq_len, 1, head_dim/2) fp32.

    activation_checkpointing (attribute, set before DDP / torch.compile): "none" (default), "selective" or "full",
    for every block of a training forward with grad and no KV cache; same loss and gradients, less memory, more
    compute (not in estimate_flops). Not a config field.
    """

    def __init__(self, config):
        super().__init__()
        c = config
        if min(c.max_seq_len, c.vocab_size, c.n_layer, c.n_head, c.n_kv_head, c.model_dim) < 1:
            raise UserError(f"GPTConfig: all sizes must be >= 1, got {c}")
        if c.model_dim % c.n_head != 0 or c.n_head % c.n_kv_head != 0 or (c.model_dim // c.n_head) % 2 != 0:
            raise UserError(f"GPTConfig: need model_dim % n_head == 0, n_head % n_kv_head == 0 and an even head_dim "
                            f"(got model_dim={c.model_dim}, n_head={c.n_head}, n_kv_head={c.n_kv_head})")
        self.config = config
        self.activation_checkpointing = "none"
        self.loss_chunk_size = None  # tokens per chunk of the head's loss; None: kernels.chunk_size_for the shapes
        self.head_dim = c.model_dim // c.n_head
        # on the meta device nn.Embedding's own init would import torch._dynamo (a slow import) for nothing: an empty
        # weight there (init_weights sets every weight anyway); elsewhere it is unchanged
        w = torch.empty(c.vocab_size, c.model_dim)
        self.wte = nn.Embedding(c.vocab_size, c.model_dim, _weight=w if w.is_meta else None)
        self.blocks = nn.ModuleList([Block(c, i) for i in range(c.n_layer)])
        self.lm_head = nn.Linear(c.model_dim, c.vocab_size, bias=False)
        kv_dim = c.n_kv_head * self.head_dim
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(c.vocab_size, kv_dim, _weight=torch.empty(
            c.vocab_size, kv_dim)) for i in range(c.n_layer) if c.value_embeds and has_value_embed(i, c.n_layer)})
        # learned scalars (init_weights sets their values)
        self.resid_lambdas = nn.Parameter(torch.ones(c.n_layer)) if c.x0_lambdas else None
        self.x0_lambdas = nn.Parameter(torch.zeros(c.n_layer)) if c.x0_lambdas else None
        self.smear_gate = nn.Linear(min(GATE_CHANNELS, c.model_dim), 1, bias=False) if c.smear else None
        self.smear_lambda = nn.Parameter(torch.zeros(1)) if c.smear else None
        self.backout_lambda = nn.Parameter(torch.zeros(1)) if c.backout else None
        self.rotary_len = 10 * c.max_seq_len  # so generation can run past max_seq_len
        # computed on the CPU and moved: rotary maths on the meta device would also import torch._dynamo
        cos, sin = (t.to(self.wte.weight.device) for t in self._rotary(device=torch.device("cpu")))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _rotary(self, device):
        inv_freq = 1.0 / self.config.rotary_base ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
                                         / self.head_dim)
        freqs = torch.outer(torch.arange(self.rotary_len, dtype=torch.float32, device=device), inv_freq)
        return freqs.cos()[None, :, None, :], freqs.sin()[None, :, None, :]

    def to_empty(self, *, device, recurse=True):
        """nn.Module.to_empty, then recomputes the rotary buffers (to_empty leaves them uninitialised)."""
        super().to_empty(device=device, recurse=recurse)
        self.cos, self.sin = self._rotary(self.wte.weight.device)
        return self

    @torch.no_grad()
    def init_weights(self):
        """
        Deterministic given torch's RNG state (nanochat's init): wte ~ N(0, 1), lm_head ~ N(0, 0.001^2), c_q/c_k/c_v
        and the value embeddings ~ U(-b, b) with b = sqrt(3/model_dim), c_fc ~ U(-0.4 b, 0.4 b), both c_proj = 0; the
        gates 0 (value-embedding gates start at 1, the smear share at 0), backout_lambda 0.2, resid_lambdas from 1.15
        (first block) to 1.05 (last) and x0_lambdas from 0.20 to 0.05, linearly. Also recomputes the rotary buffers.
        """
        self.cos, self.sin = self._rotary(self.wte.weight.device)
        nn.init.normal_(self.wte.weight, mean=0.0, std=1.0)
        nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.001)
        bound = math.sqrt(3) / math.sqrt(self.config.model_dim)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v):
                nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.uniform_(block.mlp.c_fc.weight, -0.4 * bound, 0.4 * bound)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)
            if block.attn.ve_gate is not None:
                nn.init.zeros_(block.attn.ve_gate.weight)
        for table in self.value_embeds.values():
            nn.init.uniform_(table.weight, -bound, bound)
        n = self.config.n_layer
        if self.x0_lambdas is not None:
            depth_frac = torch.arange(n, dtype=torch.float32) / max(n - 1, 1)  # 0 at the first block, 1 at the last
            self.resid_lambdas.copy_(1.15 - 0.10 * depth_frac)
            self.x0_lambdas.copy_(0.20 - 0.15 * depth_frac)
        if self.smear_gate is not None:
            nn.init.zeros_(self.smear_gate.weight)
            nn.init.zeros_(self.smear_lambda)
        if self.backout_lambda is not None:
            nn.init.constant_(self.backout_lambda, 0.2)

    def num_params(self):
        """Total number of parameters (int), embeddings and lm_head included; works on the meta device."""
        return sum(p.numel() for p in self.parameters())

    def num_scaling_params(self):
        """
        Parameters (int) that size the training horizon (the data:param ratio) and the automatic total batch: the
        transformer blocks' and the lm_head's, as nanochat counts them (`get_scaling_params` in its
        scripts/base_train.py: "transformer matrices + lm_head gives cleanest scaling laws"); the token embedding, the
        value-embedding tables and the model-level scalars are not counted.
        """
        return sum(p.numel() for p in self.blocks.parameters()) + self.lm_head.weight.numel()

    def estimate_flops(self):
        """
        Training FLOPs per token (float), PaLM appendix B (Chowdhery et al. 2022) as in nanochat:
        6 * (weights of every nn.Linear: the matmuls; embeddings are lookups and the lambdas elementwise)
        + 12 * n_head * head_dim * (sum over the layers of min(window, max_seq_len), max_seq_len for a full layer).
        """
        c = self.config
        matmul_params = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        keys = sum(c.max_seq_len if w is None else min(w, c.max_seq_len) for w in attention_windows(c))
        return float(6 * matmul_params + 12 * c.n_head * self.head_dim * keys)

    def smear(self, x, kv_cache=None, segments=None):
        """
        x_t + smear_lambda * sigmoid(smear_gate(x_t[:12])) * x_{t-1} for every token t of x (B, T, model_dim), the
        normed embeddings: a cheap bigram-like feature (modded-nanogpt's and nanochat's "smear"). Nothing is added at
        a row's first token, at the first token of a packed segment (segments), or at position 0 of a KV cache (of a
        row of a per-row cache: segments.positions 0); a call at position > 0 reads x_{t-1} of its first token from
        kv_cache.prev_embedding (per row), and every call with a cache stores its last token's x there, so cached
        generation equals the full forward. Returns a tensor like x.
        """
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)  # x_{t-1}; zero before the first token
        if kv_cache is not None:
            if kv_cache.pos > 0:
                prev[:, :1] = kv_cache.prev_embedding
            kv_cache.prev_embedding = x[:, -1:]
        if segments is not None:  # no information crosses a packed segment's boundary
            prev = prev * (segments.positions != 0).unsqueeze(-1).to(prev.dtype)
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., :self.smear_gate.in_features]))  # (B, T, 1)
        return x + gate.to(x.dtype) * prev

    def forward(self, idx, targets=None, kv_cache=None, loss_reduction="mean", doc_ids=None, last_only=False,
                logits_from=None, logits_at=None):
        """
        idx: int64 (B, T) token ids. Without targets returns fp32 logits (B, T, vocab_size) (soft-capped at +-15), or
        (B, 1, vocab_size) for the last position only with last_only=True (generation), or for position logits_at[b]
        of each row b (logits_at int64 (B,); right-padded prompts' last tokens), or (B, T - logits_from, vocab_size)
        for the positions from logits_from on (an int; scoring a continuation).
        With targets (int64 (B, T), -1 = ignored) returns the fp32 cross-entropy: a scalar for loss_reduction "mean"
        or "sum", (B*T,) for "none" (0 at ignored positions). "sum" over no counted target is 0 (not NaN); "mean"
        over none is NaN. The loss never materialises the logits: nanotrain.kernels.linear_cross_entropy computes
        head and loss loss_chunk_size tokens at a time (the attribute; None: chosen from the shapes). With kv_cache,
        the T tokens sit at positions kv_cache.pos.. and attend to the cached prefix; with a per-row cache
        (kv_cache.lengths set, see KVCache), row r's tokens sit at positions kv_cache.lengths[r].. and attend to row
        r's own prefix only (SDPA with a boolean mask), so rows of different lengths decode together.
        doc_ids: optional int (B, T) sequence id per token for packed rows (see segment_info): every run of equal
        consecutive ids is an independent sequence with positions from 0 that attends only to itself; the caller
        masks targets that would cross a boundary. Runs on flash-attn's varlen kernel on CUDA in bf16/fp16 when
        flash-attn is installed, else SDPA with an explicit boolean mask. Without doc_ids nothing changes.
        Raises ValueError past the rotary table (10 * max_seq_len; with doc_ids: a segment longer than it, the row may
        be longer; a per-row cache: its longest row), or for doc_ids with a kv_cache or of another shape.
        """
        B, T = idx.size()
        t0 = 0 if kv_cache is None else kv_cache.pos
        segments = None
        if doc_ids is None:
            if t0 + T > self.rotary_len:
                raise ValueError(f"sequence end {t0 + T} exceeds the rotary table length {self.rotary_len}")
            if kv_cache is not None and kv_cache.lengths is not None:  # per-row cache: each row at its own position
                segments = kv_cache.segments(T)
                cos_sin = self.cos[0, segments.positions], self.sin[0, segments.positions]  # (B, T, 1, D/2)
            else:
                cos_sin = self.cos[:, t0:t0 + T], self.sin[:, t0:t0 + T]
        else:
            if kv_cache is not None or doc_ids.shape != idx.shape:
                raise ValueError(f"doc_ids must have idx's shape {tuple(idx.shape)} and no kv_cache, got "
                                 f"{tuple(doc_ids.shape)}{' with a kv_cache' if kv_cache is not None else ''}")
            dev = idx.device.type
            dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.wte.weight.dtype
            varlen = flash_attn_varlen_func is not None and idx.is_cuda and dtype in (torch.bfloat16, torch.float16)
            segments = segment_info(doc_ids, varlen)
            # rows may be longer than the table, segments not (the check reads data: skipped for fake tensors, which
            # have none)
            if T > self.rotary_len and not is_fake(idx) and segments.positions.max().item() >= self.rotary_len:
                raise ValueError(f"a packed sequence exceeds the rotary table length {self.rotary_len}")
            cos_sin = self.cos[0, segments.positions], self.sin[0, segments.positions]  # (B, T, 1, D/2)
        x = norm(self.wte(idx))
        if self.smear_gate is not None:
            x = self.smear(x, kv_cache, segments)
        x0 = x  # the embedding, mixed back in before every block (x0_lambdas)
        training = self.training and torch.is_grad_enabled() and kv_cache is None
        policy = policy_name(self.activation_checkpointing) if training else "none"
        backout_idx = self.config.n_layer // 2  # the middle block (the second of two middles)
        for i, block in enumerate(self.blocks):
            def block_fn(x, i=i, block=block):  # the value-embedding lookup inside: recomputed, not kept, under AC
                ve = self.value_embeds[str(i)](idx) if str(i) in self.value_embeds else None
                mix = (self.resid_lambdas[i], self.x0_lambdas[i], x0) if self.x0_lambdas is not None else None
                return block(x, cos_sin, kv_cache, segments, ve, mix)
            x = run_block(block_fn, x, policy)
            if i == backout_idx:
                x_mid = x
        if self.backout_lambda is not None:  # backout: take a learned share of the middle layer's output away
            x = x - self.backout_lambda.to(x.dtype) * x_mid
        x = norm(x)
        if targets is not None:  # the head and its loss in chunks of tokens: no (B, T, vocab) logits are kept
            return linear_cross_entropy(x.view(B * T, -1), self.lm_head.weight, targets.view(B * T), SOFTCAP,
                                        loss_reduction, self.loss_chunk_size)
        if last_only:
            x = x[:, -1:]
        elif logits_at is not None:
            x = x[torch.arange(B, device=x.device), logits_at][:, None]
        elif logits_from is not None:
            x = x[:, logits_from:]
        logits = self.lm_head(x).float()
        return SOFTCAP * torch.tanh(logits / SOFTCAP)


def build_model(model_config, device, checkpoint=None, vocab_size=None, init_device=None, tokenizer_sha256=None):
    """
    The GPT every script trains or samples: built on the meta device (no memory), materialised on `init_device`
    (default `device`; FSDP passes the CPU and shards afterwards), initialised with init_weights() from torch's RNG
    (seed first for a reproducible init), then loaded from checkpoint["model"] when a checkpoint (a dict of
    nanotrain.checkpoint_format.load_checkpoint: "model", "meta", "path") is given. model_config: a GPTConfig (for a
    checkpoint, normally GPTConfig(**checkpoint["meta"]["model_config"]), max_seq_len may differ: it only sizes the
    rotary table). vocab_size: the tokenizer's, checked against the checkpoint's vocab_size (or, without one,
    model_config's). tokenizer_sha256: the tokenizer's fingerprint (Tokenizer.fingerprint), checked against the
    checkpoint's meta["tokenizer_sha256"] when both are there (checkpoints written before it was recorded have none).
    Returns the GPT in training mode with fp32 weights. Raises UserError on a vocab or tokenizer mismatch.
    """
    if vocab_size is not None:
        have = checkpoint["meta"]["model_config"]["vocab_size"] if checkpoint is not None else model_config.vocab_size
        if have != vocab_size:
            where = f"the checkpoint {checkpoint['path']}" if checkpoint is not None else "the model config"
            raise UserError(f"{where} has vocab_size {have} but the tokenizer has {vocab_size}; was the tokenizer "
                            f"retrained?")
    trained_with = checkpoint["meta"].get("tokenizer_sha256") if checkpoint is not None and "meta" in checkpoint else None
    if tokenizer_sha256 is not None and trained_with is not None and trained_with != tokenizer_sha256:
        raise UserError(f"the checkpoint {checkpoint['path']} was trained with another tokenizer (sha256 "
                        f"{trained_with[:12]}..., this one is {tokenizer_sha256[:12]}...); the tokenizer was retrained "
                        f"since: use the one the model was trained with")
    with torch.device("meta"):
        model = GPT(model_config)
    model.to_empty(device=init_device or device)
    model.init_weights()
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    return model


# ----------------------------------------------------------------------------- activation checkpointing

POLICIES = ("none", "selective", "full")  # cheapest in compute first
# aten ops whose outputs "selective" keeps: the matmuls and the attention kernels (CPU, CUDA flash / efficient /
# cuDNN, and the ops those call)
SAVED_ATEN_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward", "_efficient_attention_forward",
})


def policy_name(value, name="activation_checkpointing", allow_auto=False):
    """
    The policy (one of POLICIES, or "auto" with allow_auto) of a setting's value, a policy name. Raises UserError
    naming --<name> for anything else.
    """
    if value in POLICIES or (allow_auto and value == "auto"):
        return value
    allowed = "|".join(POLICIES + (("auto",) if allow_auto else ()))
    raise UserError(f"--{name}={value!r}: expected {allowed}")


def _keep_matmul_outputs(ctx, op, *args, **kwargs):
    """The "selective" policy function (torch.utils.checkpoint's policy_fn signature): keep the outputs of
    SAVED_ATEN_OPS, flash-attn's ops and higher-order ops (a block's only one: flex_attention), recompute the rest."""
    keep = op.namespace in ("flash_attn", "higher_order") or (
        op.namespace == "aten" and op.overloadpacket.__name__ in SAVED_ATEN_OPS)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def run_block(fn, x, policy):
    """
    fn(x) under `policy` (one of POLICIES): "none" calls it; "full" and "selective" run it under
    torch.utils.checkpoint.checkpoint (use_reentrant=False, no RNG replay), "selective" with
    create_selective_checkpoint_contexts(_keep_matmul_outputs). fn may read other tensors from its closure (they are
    kept by whoever owns them). Returns fn(x).
    """
    if policy == "none":
        return fn(x)
    if policy == "full":
        return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False)
    return checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False,
                      context_fn=partial(create_selective_checkpoint_contexts, _keep_matmul_outputs))


def recompute_flops(model, batch_size, seq_len, device="cpu"):
    """
    The FLOPs a training step recomputes under model.activation_checkpointing: torch.utils.flop_counter's count
    (matmuls and attention kernels; elementwise ops count 0) of one forward + backward of `batch_size` rows of
    `seq_len` random tokens, minus the same count with "none", divided by the latter. Runs on fake tensors (no
    memory, no compute): `model` must have been built under the caller's torch._subclasses.FakeTensorMode on
    `device`, or be a real model (then it computes). Returns (extra_fraction (float), flops_without (int)).
    """
    from torch.utils.flop_counter import FlopCounterMode
    saved = model.activation_checkpointing
    counts = {}
    try:
        for key, value in (("with", saved), ("without", "none")):
            model.activation_checkpointing = value
            idx = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
            counter = FlopCounterMode(display=False)
            with counter:
                model(idx, idx).backward()
            counts[key] = counter.get_total_flops()
            model.zero_grad(set_to_none=True)
    finally:
        model.activation_checkpointing = saved
    return (counts["with"] - counts["without"]) / counts["without"], counts["without"]
