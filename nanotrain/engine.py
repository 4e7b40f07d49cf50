"""
Inference: generation with the KV cache for a batch of prompts (chat eval, the CLI), stopping at <|assistant_end|>
or <|bos|>. After nanochat's engine.py (karpathy/nanochat), without its calculator tool. A model to generate with
comes from nanotrain.checkpoint.load_model.

Batching: prompts of the same length are prefilled and decoded together in one KV cache (nanotrain.gpt.KVCache keeps
one position for all rows, so rows of different lengths would need left-padding and masks; grouping avoids both).
"""

from collections import defaultdict

import torch
import torch.nn.functional as F

from nanotrain.common import UserError
from nanotrain.gpt import KVCache

MAX_BATCH = 64  # at most this many prompts share one KV cache


class Engine:
    """Generates with `model` (a nanotrain.gpt.GPT) and its `tokenizer` (a nanotrain.tokenizer.Tokenizer)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.stop_ids = {tokenizer.encode_special("<|assistant_end|>"), tokenizer.get_bos_token_id()}

    def _check(self, prompts, max_tokens, temperature):
        if temperature < 0:
            raise UserError(f"temperature must be >= 0, got {temperature}")
        if max_tokens < 0:
            raise UserError(f"max_tokens must be >= 0, got {max_tokens}")
        for p in prompts:
            if len(p) == 0:
                raise UserError("generate: a prompt is empty (expected at least one token, e.g. <|bos|>)")
            if len(p) + max_tokens > self.model.rotary_len:
                raise UserError(f"generate: prompt ({len(p)} tokens) + max_tokens ({max_tokens}) exceeds the "
                                f"model's {self.model.rotary_len} positions (10 * max_seq_len); shorten the prompt")

    @torch.inference_mode()
    def _columns(self, prompts, max_tokens, temperature, top_k, rng):
        """
        Yields the next token of every row (a list of B ints) for up to max_tokens steps. `prompts`: B lists of the same
        length, prefilled together into one KVCache; then one forward of B tokens per step.
        """
        model = self.model
        device = model.wte.weight.device
        autocast = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else model.wte.weight.dtype
        c = model.config
        cache = KVCache(len(prompts), c.n_kv_head, model.head_dim, c.n_layer, len(prompts[0]) + max_tokens, device,
                        dtype)
        ids = torch.tensor(prompts, dtype=torch.long, device=device)  # (B, T) int64
        for _ in range(max_tokens):
            logits = model(ids, kv_cache=cache, last_only=True)[:, -1, :]  # (B, vocab_size) fp32
            if temperature == 0:
                ids = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k and top_k < logits.size(-1):  # None or 0: all tokens
                    kth = torch.topk(logits, top_k).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                ids = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=rng)
            yield ids[:, 0].tolist()

    def _rng(self, temperature, seed):
        device = self.model.wte.weight.device
        return torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None

    def generate(self, prompts, max_tokens, temperature=0.0, top_k=None, seed=42, max_batch=MAX_BATCH):
        """
        Completes each prompt (list[int] token ids; a batch list[list[int]]) with up to max_tokens new tokens.
        Returns list[list[int]]: the generated ids per prompt, in prompt order, without the prompt and without the stop
        token (<|assistant_end|> or <|bos|>) that ended the row. temperature 0 is greedy (argmax), else sampling
        from softmax(logits / temperature) restricted to the top_k logits (top_k None or 0: all), with one
        torch.Generator seeded with `seed` for the call. Prompts of equal length run together (up to max_batch per KV cache); with
        sampling, a row's tokens therefore depend on the other prompts of the call.
        Raises UserError for an empty prompt, a negative temperature or max_tokens, or a prompt + max_tokens beyond
        the model's rotary table (10 * max_seq_len).
        """
        self._check(prompts, max_tokens, temperature)
        rng = self._rng(temperature, seed)
        groups = defaultdict(list)
        for i, p in enumerate(prompts):
            groups[len(p)].append(i)
        out = [None] * len(prompts)
        for length in sorted(groups):
            idx = groups[length]
            for lo in range(0, len(idx), max_batch):
                rows = idx[lo:lo + max_batch]
                done = [False] * len(rows)
                results = [[] for _ in rows]
                for column in self._columns([prompts[i] for i in rows], max_tokens, temperature, top_k, rng):
                    for r, tok in enumerate(column):
                        if not done[r]:
                            if tok in self.stop_ids:
                                done[r] = True
                            else:
                                results[r].append(tok)
                    if all(done):
                        break
                for r, i in enumerate(rows):
                    out[i] = results[r]
        return out

    def generate_stream(self, prompt, max_tokens, temperature=0.0, top_k=None, seed=42):
        """
        Yields the new token ids (int) of one prompt (list[int]) as they are generated, up to max_tokens, stopping
        before <|assistant_end|> or <|bos|> (not yielded). Same sampling and errors as generate(); for the same
        arguments it yields exactly generate([prompt], ...)[0].
        """
        self._check([prompt], max_tokens, temperature)
        for column in self._columns([prompt], max_tokens, temperature, top_k, self._rng(temperature, seed)):
            if column[0] in self.stop_ids:
                return
            yield column[0]
