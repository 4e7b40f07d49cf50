"""
nanotrain's GPT for Hugging Face transformers: a PretrainedConfig and a PreTrainedModel + GenerationMixin with a KV
cache, so that an exported directory loads with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True).

This file imports only torch and transformers: nanotrain.hf_export copies it verbatim into the export directory as
modeling_nanotrain.py (config.json's auto_map names its two classes). It re-implements nanotrain.gpt.GPT's inference
forward (the same parameter names, so the state dict is the project's): rotary embeddings (Su et al. 2021) on the two
halves of the head dim, QK RMSNorm after rotary times qk_scale, parameter-free RMSNorm (F.rms_norm) after the
embedding and before every block half and the head, ReLU^2 MLP, GQA, untied lm_head, logits soft-capped at
15 * tanh(z / 15) in fp32, and the options value_embeds (ResFormer-style, a gate 2 sigmoid(W x[:12]) per kv head on
alternating blocks, the last always), smear, backout (the middle block's output) and x0_lambdas.

Padding (left or right, attention_mask with 0s): each row's positions count its unmasked tokens only (rotary
positions and the smear's row start), and keys at masked positions are never attended to; so a left-padded row gives
the logits of the row alone. The smear's previous embedding is carried in the cache as one extra cache layer (index
n_layer) holding the normed embeddings, so beam search reorders and crops it with the keys and values.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

SOFTCAP = 15.0
GATE_CHANNELS = 12


class NanotrainConfig(PretrainedConfig):
    """
    nanotrain.gpt.GPTConfig's fields under their own names (n_layer, n_head, n_kv_head, model_dim, max_seq_len,
    vocab_size, value_embeds, smear, backout, x0_lambdas, rotary_base, qk_scale), with the standard transformers
    names mapped onto them (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads);
    max_position_embeddings is the rotary table's length, 10 * max_seq_len, as in GPT.
    """

    model_type = "nanotrain"
    attribute_map = {"hidden_size": "model_dim", "num_hidden_layers": "n_layer",
                     "num_attention_heads": "n_head", "num_key_value_heads": "n_kv_head"}

    def __init__(self, max_seq_len=2048, vocab_size=32768, n_layer=12, n_head=6, n_kv_head=6, model_dim=768,
                 value_embeds=True, smear=False, backout=False, x0_lambdas=False, rotary_base=10000.0,
                 qk_scale=1.0, **kwargs):
        self.max_seq_len, self.vocab_size, self.n_layer = max_seq_len, vocab_size, n_layer
        self.n_head, self.n_kv_head, self.model_dim = n_head, n_kv_head, model_dim
        self.value_embeds, self.smear, self.backout, self.x0_lambdas = value_embeds, smear, backout, x0_lambdas
        self.rotary_base, self.qk_scale = float(rotary_base), float(qk_scale)
        self.head_dim = model_dim // n_head
        kwargs.pop("max_position_embeddings", None)
        kwargs.pop("head_dim", None)
        self.max_position_embeddings = 10 * max_seq_len
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


def has_value_embed(layer_idx, n_layer):
    """Whether block `layer_idx` of `n_layer` has a value embedding: every other block, the last one always."""
    return layer_idx % 2 == (n_layer - 1) % 2


def rms_norm(x):
    """Parameter-free RMSNorm over the last dim, computed as F.rms_norm does (eps: the dtype's machine epsilon)."""
    return F.rms_norm(x, (x.size(-1),))


def apply_rotary(x, cos, sin):
    """x (B, T, H, D) rotated pairwise between its two halves (x[..., i], x[..., i + D/2]); cos, sin (B, T, 1, D/2)."""
    d = x.size(3) // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=3)


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
        self.qk_scale = config.qk_scale
        self.ve_gate = (nn.Linear(min(GATE_CHANNELS, d), self.n_kv_head, bias=False)
                        if config.value_embeds and has_value_embed(layer_idx, config.n_layer) else None)

    def forward(self, x, cos_sin, mask, cache, ve):
        B, T, _ = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        if ve is not None:  # v + 2 sigmoid(gate) * ve, a gate in (0, 2) per kv head
            gate = 2 * torch.sigmoid(self.ve_gate(x[..., :self.ve_gate.in_features]))
            v = v + gate.unsqueeze(-1).to(v.dtype) * ve.view(B, T, self.n_kv_head, self.head_dim).to(v.dtype)
        q, k = apply_rotary(q, *cos_sin), apply_rotary(k, *cos_sin)
        q, k = rms_norm(q), rms_norm(k)
        q = q * self.qk_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        gqa = self.n_kv_head != self.n_head
        if isinstance(mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        else:  # mask "causal" (the keys are exactly the queries) or None (every key is visible)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=mask == "causal", enable_gqa=gqa)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, -1))


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

    def forward(self, x, cos_sin, mask, cache, ve):
        x = x + self.attn(rms_norm(x), cos_sin, mask, cache, ve)
        return x + self.mlp(rms_norm(x))


class NanotrainForCausalLM(PreTrainedModel, GenerationMixin):
    """
    nanotrain's GPT (see the module docstring) as a transformers causal LM. forward(input_ids (B, T) int64,
    attention_mask (B, past + T) of 1/0 or None, position_ids (B, T) or None, cache / past_key_values (a
    transformers Cache) or None, labels (B, T) or None (-100 ignored), use_cache, logits_to_keep) returns a
    CausalLMOutputWithPast with fp32 logits (B, T or logits_to_keep, vocab_size), soft-capped at +-15, the mean
    next-token cross-entropy when labels are given, and the cache. Raises ValueError for inputs_embeds (the value
    embeddings need token ids) or a position past the rotary table (10 * max_seq_len).
    """

    config_class = NanotrainConfig
    base_model_prefix = "nanotrain"
    _no_split_modules = ["Block"]
    _tied_weights_keys = []

    def __init__(self, config):
        super().__init__(config)
        c = config
        self.wte = nn.Embedding(c.vocab_size, c.model_dim)
        self.blocks = nn.ModuleList([Block(c, i) for i in range(c.n_layer)])
        self.lm_head = nn.Linear(c.model_dim, c.vocab_size, bias=False)
        kv_dim = c.n_kv_head * (c.model_dim // c.n_head)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(c.vocab_size, kv_dim) for i in range(c.n_layer)
                                           if c.value_embeds and has_value_embed(i, c.n_layer)})
        self.resid_lambdas = nn.Parameter(torch.ones(c.n_layer)) if c.x0_lambdas else None
        self.x0_lambdas = nn.Parameter(torch.zeros(c.n_layer)) if c.x0_lambdas else None
        self.smear_gate = nn.Linear(min(GATE_CHANNELS, c.model_dim), 1, bias=False) if c.smear else None
        self.smear_lambda = nn.Parameter(torch.zeros(1)) if c.smear else None
        self.backout_lambda = nn.Parameter(torch.full((1,), 0.2)) if c.backout else None
        self.post_init()

    def get_input_embeddings(self):
        return self.wte

    def set_input_embeddings(self, value):
        self.wte = value

    def get_output_embeddings(self):
        return self.lm_head

    def _rotary(self, positions):
        """cos, sin (B, T, 1, head_dim/2) fp32 of the int64 positions (B, T), as GPT's rotary table holds them."""
        head_dim = self.config.model_dim // self.config.n_head
        dev = positions.device
        inv_freq = 1.0 / self.config.rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=dev)
                                                     / head_dim)
        freqs = positions.to(torch.float32)[..., None] * inv_freq
        return freqs.cos()[:, :, None, :], freqs.sin()[:, :, None, :]

    def _layout(self, input_ids, attention_mask, position_ids, past):
        """(positions (B, T) int64, mask) for T new tokens after `past` cached ones: mask "causal", None (all keys
        visible) or a bool (B, 1, T, past + T) tensor (padding, or a chunk after a prefix)."""
        B, T = input_ids.shape
        dev = input_ids.device
        padded = attention_mask is not None and not bool(attention_mask.all())
        if position_ids is None:
            if padded:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
            else:
                position_ids = (past + torch.arange(T, device=dev)).expand(B, T)
        if not padded:
            if past == 0:
                return position_ids, "causal"
            if T == 1:
                return position_ids, None
            keys = torch.arange(past + T, device=dev)
            return position_ids, (keys[None, :] <= (past + torch.arange(T, device=dev))[:, None])[None, None]
        keys = torch.arange(past + T, device=dev)
        query = past + torch.arange(T, device=dev)
        visible = attention_mask[:, None, None, :past + T].bool() & (keys <= query[:, None])[None, None]
        visible = visible | (keys == query[:, None])[None, None]  # a padded query sees itself (no empty row)
        return position_ids, visible

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        if input_ids is None or inputs_embeds is not None:
            raise ValueError("NanotrainForCausalLM needs input_ids (its value embeddings are indexed by token id); "
                             "inputs_embeds is not supported")
        cache = cache if cache is not None else past_key_values
        if cache is None and use_cache:
            cache = DynamicCache()
        c = self.config
        B, T = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        positions, mask = self._layout(input_ids, attention_mask, position_ids, past)
        if int(positions.max()) >= c.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} exceeds the rotary table length "
                             f"{c.max_position_embeddings} (10 * max_seq_len)")
        cos_sin = self._rotary(positions)
        x = rms_norm(self.wte(input_ids))
        if self.smear_gate is not None:
            x = self._smear(x, positions, cache)
        x0 = x
        backout_idx = c.n_layer // 2
        x_mid = None
        for i, block in enumerate(self.blocks):
            ve = self.value_embeds[str(i)](input_ids) if str(i) in self.value_embeds else None
            if self.x0_lambdas is not None:
                x = self.resid_lambdas[i].to(x.dtype) * x + self.x0_lambdas[i].to(x.dtype) * x0
            x = block(x, cos_sin, mask, cache, ve)
            if i == backout_idx:
                x_mid = x
        if self.backout_lambda is not None:
            x = x - self.backout_lambda.to(x.dtype) * x_mid
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

    def _smear(self, x, positions, cache):
        """x_t + smear_lambda * sigmoid(smear_gate(x_t[:12])) * x_{t-1}, nothing added at a row's position 0; with a
        cache, x_{t-1} of the first new token is the last normed embedding stored in its extra layer n_layer."""
        prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        if cache is not None:
            n = self.config.n_layer
            while len(cache.layers) <= n:  # the extra layer holding the embeddings (a cache built for n_layer)
                cache.layers.append(DynamicLayer())
            stored = x[:, None]  # (B, 1, T, model_dim), a one-head "layer" of keys and values
            if cache.layers[n].get_seq_length() > 0:
                prev[:, :1] = cache.layers[n].keys[:, 0, -1:].to(x.dtype)
            cache.layers[n].update(stored, stored)
        prev = prev * (positions != 0).unsqueeze(-1).to(prev.dtype)
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[..., :self.smear_gate.in_features]))
        return x + gate.to(x.dtype) * prev
