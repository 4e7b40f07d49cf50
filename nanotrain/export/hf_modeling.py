"""
nanotrain's GPT for Hugging Face transformers: a PretrainedConfig and a PreTrainedModel + GenerationMixin, so that an
exported directory loads with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True).

This file imports only torch and transformers: nanotrain.export.hf copies it verbatim into the export directory as
modeling_nanotrain.py (config.json's auto_map names its two classes). It re-implements nanotrain.gpt.GPT's inference
forward (the same parameter names, so the state dict is the project's): rotary embeddings (Su et al. 2021) on the two
halves of the head dim, QK RMSNorm after rotary, attention logits scaled by qk_scale / sqrt(head_dim),
parameter-free RMSNorm (F.rms_norm) after the embedding and before every block half and the head, ReLU^2 MLP, GQA,
untied lm_head, logits soft-capped at 15 * tanh(z / 15) in fp32, value embeddings (ResFormer-style, a gate
2 sigmoid(W x[:12]) per kv head on alternating blocks, the last always), and sliding-window attention (GPTConfig's
window_pattern and short_window W: the query at position i of an S layer attends keys i-W..i), written in transformers'
own terms as its Qwen2 and Gemma do: config.layer_types ("sliding_attention" / "full_attention" per layer) and
config.sliding_window = W + 1 (transformers counts the keys, its mask is kv_idx > q_idx - sliding_window; its
flash-attention path passes window_size=(sliding_window - 1, ...) = (W, ...)); the sliding layers get
create_sliding_window_causal_mask's mask and sliding_window in the attention call, and DynamicCache(config=...) keeps
only their last W keys. GPT's options smear, backout and x0_lambdas are not implemented (NanotrainConfig refuses
them; nanotrain.export.hf refuses such a checkpoint).

Attention goes through transformers' attention interface, as its Llama does (transformers 5.24,
models/llama/modeling_llama.py): the mask comes from masking_utils.create_causal_mask, the cache is updated with
cache.update(k, v, layer_idx, kwargs), and the attention itself is ALL_ATTENTION_FUNCTIONS[config._attn_implementation]
(eager_attention_forward below for "eager"), with the forward's extra keyword arguments passed down to it. So
attn_implementation "eager", "sdpa" and "paged|eager" all run it, transformers'
continuous batching (generate_batch: packed rows, a paged cache, per-token position_ids) runs it, and a serving stack
that registers its own attention function (vLLM's transformers backend) can.

Padding (left or right, a 2D attention_mask with 0s): without position_ids each row's positions count its unmasked
tokens only, and keys at masked positions are never attended to; so a left-padded row gives the logits of the row
alone.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

SOFTCAP = 15.0
GATE_CHANNELS = 12
NOT_IMPLEMENTED = ("smear", "backout", "x0_lambdas")  # GPTConfig options this file does not implement


class NanotrainConfig(PretrainedConfig):
    """
    nanotrain.gpt.GPTConfig's fields under their own names (n_layer, n_head, n_kv_head, model_dim, max_seq_len,
    vocab_size, value_embeds, rotary_base, qk_scale, window_pattern, short_window), with the standard transformers
    names mapped onto them (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads); max_position_
    embeddings is 10 * max_seq_len, the length of GPT's rotary table; layer_types and sliding_window (short_window + 1,
    or None without a sliding layer) are derived from the window fields (given values are recomputed). Raises
    ValueError when smear, backout or x0_lambdas is true (options this modeling file does not implement; false values
    are accepted and dropped), or for a window_pattern other than a non-empty string of S and L.
    """

    model_type = "nanotrain"
    attribute_map = {"hidden_size": "model_dim", "num_hidden_layers": "n_layer",
                     "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head"}

    def __init__(self, max_seq_len=2048, vocab_size=32768, n_layer=12, n_head=6, n_kv_head=6, model_dim=768,
                 value_embeds=True, rotary_base=10000.0, qk_scale=1.0, window_pattern="L", short_window=None,
                 **kwargs):
        for name in NOT_IMPLEMENTED:
            if kwargs.pop(name, False):
                raise ValueError(f"NanotrainConfig: {name}=True is not implemented by this modeling file")
        if not isinstance(window_pattern, str) or not window_pattern or set(window_pattern) - {"S", "L"}:
            raise ValueError(f"NanotrainConfig: window_pattern={window_pattern!r}, expected a string of S and L")
        if short_window is None:  # nanotrain.gpt.default_short_window
            short_window = max(128, -(-(max_seq_len // 4) // 128) * 128)
        self.window_pattern, self.short_window = window_pattern, int(short_window)
        # the pattern tiled over the layers, the last one always full (nanotrain.gpt.attention_windows)
        self.layer_types = ["sliding_attention" if window_pattern[i % len(window_pattern)] == "S" and i < n_layer - 1
                            else "full_attention" for i in range(n_layer)]
        self.sliding_window = self.short_window + 1 if "sliding_attention" in self.layer_types else None
        self.max_seq_len, self.vocab_size, self.n_layer = max_seq_len, vocab_size, n_layer
        self.n_head, self.n_kv_head, self.model_dim = n_head, n_kv_head, model_dim
        self.value_embeds = value_embeds
        self.rotary_base, self.qk_scale = float(rotary_base), float(qk_scale)
        self.head_dim = model_dim // n_head
        self.max_position_embeddings = 10 * max_seq_len
        for derived in ("layer_types", "sliding_window", "max_position_embeddings", "head_dim"):  # recomputed above
            kwargs.pop(derived, None)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def has_value_embed(layer_idx, n_layer):
    """Whether block `layer_idx` of `n_layer` has a value embedding: every other block, the last one always."""
    return layer_idx % 2 == (n_layer - 1) % 2


def rms_norm(x):
    """Parameter-free RMSNorm over the last dim, computed as F.rms_norm does (eps: the dtype's machine epsilon)."""
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x, cos, sin):
    """x (B, H, T, D) rotated pairwise between its two halves (x[..., i], x[..., i + D/2]); cos, sin (B, 1, T, D/2)."""
    d = x.size(3) // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=3)


def repeat_kv(x, n_rep):
    """(B, n_kv_head, S, D) -> (B, n_kv_head * n_rep, S, D), each kv head repeated for its n_rep query heads (GQA:
    query head h reads kv head h // n_rep)."""
    if n_rep == 1:
        return x
    B, H, S, D = x.shape
    return x[:, :, None].expand(B, H, n_rep, S, D).reshape(B, H * n_rep, S, D)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """
    Attention in plain torch ops, transformers' "eager" implementation (the same signature as every function of
    ALL_ATTENTION_FUNCTIONS): query (B, n_head, T, D), key and value (B, n_kv_head, S, D), attention_mask an additive
    float mask broadcastable to (B, n_head, T, S) or None. Returns (output (B, T, n_head, D), weights (B, n_head, T, S)).
    """
    key, value = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class CausalSelfAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.layer_idx, self.n_head, self.n_kv_head = layer_idx, config.n_head, config.n_kv_head
        self.head_dim = config.model_dim // config.n_head
        self.num_key_value_groups = config.n_head // config.n_kv_head  # the name transformers' attention reads
        self.scaling = config.qk_scale * self.head_dim ** -0.5
        self.is_causal = True
        # keys kept: sliding_window (q_idx - sliding_window < kv_idx <= q_idx); None: all
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        d = config.model_dim
        self.c_q = nn.Linear(d, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.ve_gate = (nn.Linear(min(GATE_CHANNELS, d), self.n_kv_head, bias=False)
                        if config.value_embeds and has_value_embed(layer_idx, config.n_layer) else None)

    def forward(self, x, cos_sin, attention_mask, cache, ve, **kwargs):
        B, T, _ = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # v + 2 sigmoid(gate) * ve, a gate in (0, 2) per kv head
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate.in_features]))
            v = v + gate.unsqueeze(-1).to(v.dtype) * ve.view(B, T, self.n_kv_head, self.head_dim).to(v.dtype)
        v = v.transpose(1, 2)
        q, k = rms_norm(apply_rotary(q, *cos_sin)), rms_norm(apply_rotary(k, *cos_sin))
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        y, _ = attention(self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
                         sliding_window=self.sliding_window, **kwargs)
        return self.c_proj(y.reshape(B, T, -1).contiguous())


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.model_dim, 4 * config.model_dim, bias=False)
        self.c_proj = nn.Linear(4 * config.model_dim, config.model_dim, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, cos_sin, attention_mask, cache, ve, **kwargs):
        x = x + self.attn(rms_norm(x), cos_sin, attention_mask, cache, ve, **kwargs)
        return x + self.mlp(rms_norm(x))


class NanotrainForCausalLM(PreTrainedModel, GenerationMixin):
    """
    nanotrain's GPT (see the module docstring) as a transformers causal LM. forward(input_ids (B, T) int64,
    attention_mask (B, past + T) of 1/0, a prepared 4D mask, or None, position_ids (B, T) or None, cache /
    past_key_values (a transformers Cache, continuous batching's paged cache included) or None, labels (B, T) or
    None (-100 ignored), use_cache, logits_to_keep (an int: the last n positions; a tensor: those indices), and any
    keyword arguments of the attention implementation) returns a CausalLMOutputWithPast with fp32 logits (B, T or the
    kept positions, vocab_size), soft-capped at +-15, the mean next-token cross-entropy when labels are given, and
    the cache. Raises ValueError for inputs_embeds (the value embeddings need token ids).
    """

    config_class = NanotrainConfig
    base_model_prefix = "nanotrain"
    _no_split_modules = ["Block"]
    _tied_weights_keys = []
    _supports_sdpa = True
    _supports_attention_backend = True

    def __init__(self, config):
        super().__init__(config)
        c = config
        self.wte = nn.Embedding(c.vocab_size, c.model_dim)
        self.blocks = nn.ModuleList([Block(c, i) for i in range(c.n_layer)])
        self.lm_head = nn.Linear(c.model_dim, c.vocab_size, bias=False)
        kv_dim = c.n_kv_head * (c.model_dim // c.n_head)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(c.vocab_size, kv_dim) for i in range(c.n_layer)
                                           if c.value_embeds and has_value_embed(i, c.n_layer)})
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def _rotary(self, positions):
        """cos, sin (B, 1, T, head_dim/2) fp32 of the int64 positions (B, T), as GPT's rotary table holds them."""
        head_dim = self.config.model_dim // self.config.n_head
        dev = positions.device
        inv_freq = 1.0 / self.config.rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=dev)
                                                     / head_dim)
        freqs = positions.to(torch.float32)[..., None] * inv_freq
        return freqs.cos()[:, None], freqs.sin()[:, None]

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("NanotrainForCausalLM needs input_ids (its value embeddings are indexed by token id); "
                             "inputs_embeds is not supported")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = DynamicCache(config=self.config)
        B, T = input_ids.shape
        if position_ids is None:
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:  # a row counts its tokens only
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                past = cache.get_seq_length() if cache is not None else 0
                position_ids = (past + torch.arange(T, device=input_ids.device)).expand(B, T)
        x = rms_norm(self.wte(input_ids))
        if isinstance(attention_mask, dict):  # prepared by generate (create_masks_for_generate), keyed by layer type
            masks = attention_mask
        else:
            args = dict(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                        position_ids=position_ids)
            masks = {"full_attention": create_causal_mask(**args)}
            if "sliding_attention" in self.config.layer_types:
                masks["sliding_attention"] = create_sliding_window_causal_mask(**args)
        cos_sin = self._rotary(position_ids)
        for i, block in enumerate(self.blocks):
            ve = self.value_embeds[str(i)](input_ids) if str(i) in self.value_embeds else None
            x = block(x, cos_sin, masks[self.config.layer_types[i]], cache, ve, **kwargs)
        x = rms_norm(x)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            x = x[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, torch.Tensor):
            x = x[:, logits_to_keep]
        logits = self.lm_head(x).float()
        logits = SOFTCAP * torch.tanh(logits / SOFTCAP)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        field = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{field: cache})
