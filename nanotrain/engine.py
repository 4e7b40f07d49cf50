"""
Inference: generation with the KV cache for a batch of prompts (chat eval, the CLI, RL rollouts), stopping at
<|assistant_end|> or <|bos|>, optionally with the calculator tool. After nanochat's engine.py (karpathy/nanochat).
A model to generate with comes from nanotrain.checkpoint.load_model.

Batching: prompts of any lengths are decoded together, up to max_batch per KV cache (sorted by length, so that rows
of similar lengths share a cache). Prompts of one length are prefilled together into their rows of the cache; with
several lengths the cache then keeps one length per row (nanotrain.attention.KVCache's per-row mode): every decode step
feeds one token per row, which sits at its row's own position (rotary, smear), is written at its row's own slot and
attends to its row's own tokens only (a boolean mask; no padding). So with greedy decoding every row gets the tokens
it would get alone (up to floating-point reduction order: in fp32 the logits agree to ~1e-6 relative, as the
one-prompt cache agrees with the full forward, and only a near-tie argmax could flip). A cache whose prompts all have one length stays uniform (one position, no mask).

The tool (tool=True): each row is a small state machine. When the model closes a python block
(<|python_start|> expr <|python_end|>), nanotrain.calculator.calculate(expr) runs and, if it gives a result, the
row's next tokens are forced to <|output_start|> result <|output_end|> instead of sampled (they still go through the
model one at a time, filling the KV cache, and count towards max_tokens); then sampling resumes. Forced tokens carry
mask 0 (the tokenizer's training mask for tool output: never trained, never rewarded), sampled ones mask 1. An
expression the calculator refuses forces nothing: the model goes on by itself. With tool=False every token is
sampled, exactly as without a tool.
"""

from collections import deque

import torch
import torch.nn.functional as F

from nanotrain.attention import KVCache
from nanotrain.calculator import calculate
from nanotrain.errors import UserError

MAX_BATCH = 64  # at most this many prompts share one KV cache
MIN_TEMPERATURE = 1e-6  # a smaller temperature (0 included) is greedy: logits / 1e-300 overflow fp32 to inf and NaN


# how the tool's special tokens are shown to a person: <|python_start|>37 + 48<|python_end|><|output_start|>85
# <|output_end|> reads [calculator: 37 + 48 -> 85] (chat_cli, chat_serve)
SHOWN = {"<|python_start|>": "[calculator: ", "<|python_end|>": "", "<|output_start|>": " -> ",
         "<|output_end|>": "]"}


def readable(text):
    """A decoded reply (special tokens as their strings) with the calculator's tokens shown as SHOWN says."""
    for token, shown in SHOWN.items():
        text = text.replace(token, shown)
    return text


def sample_next(logits, temperature, top_k=None, rng=None):
    """
    The next token of each row of `logits` (..., vocab_size), float: int64 (..., 1). A temperature below
    MIN_TEMPERATURE (0 included) is greedy (argmax; rng unused), else a draw from softmax(logits / temperature)
    restricted to the top_k largest logits (top_k None or 0, or >= vocab_size: every token) with the torch.Generator
    `rng` (None: torch's global one). The one sampler of Engine, the server's batch engine and scripts/sample.py.
    """
    if temperature < MIN_TEMPERATURE:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(F.softmax(logits, dim=-1), 1, generator=rng)


class TextStream:
    """
    The text of a stream of token ids, piece by piece (chat_cli, sample.py, chat_serve): add(tokens) returns the
    text those tokens add, with show() applied (e.g. readable). A character whose UTF-8 bytes are split across
    tokens is held back until the token that completes it, so a piece never ends in half a character (U+FFFD) unless
    final=True says no more tokens come; only the tokens since the last complete character are decoded again, not
    the whole stream. The pieces joined equal show(tokenizer.decode(all tokens)) (special tokens decode whole).
    """

    def __init__(self, tokenizer, show=lambda text: text):
        self.tokenizer, self.show, self.pending = tokenizer, show, []

    def add(self, tokens, final=False):
        """The text of `tokens` (list[int]) and of those held back before them; "" while a character is open."""
        self.pending += tokens
        text = self.tokenizer.decode(self.pending)
        if text.endswith("\ufffd") and not final:
            return ""
        self.pending = []
        return self.show(text)


class ToolState:
    """
    One row's tool state machine (see the module docstring): feed it every token of the row in order; forced()
    says whether the row's next token is forced and pops it.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.python_start, self.python_end, self.output_start, self.output_end = (
            tokenizer.encode_special(n) for n in ("<|python_start|>", "<|python_end|>", "<|output_start|>",
                                                  "<|output_end|>"))
        self.expr = None  # the tokens of an open python block, else None
        self.queue = deque()  # forced tokens still to come

    def next_forced(self):
        """The next forced token id (removed from the queue), or None when the next token is the model's."""
        return self.queue.popleft() if self.queue else None

    def feed(self, token):
        """Advance with the row's token (sampled or forced); a closed python block queues the calculator's output."""
        if token == self.python_start:
            self.expr = []
        elif token == self.python_end and self.expr is not None:
            result = calculate(self.tokenizer.decode(self.expr))
            self.expr = None
            if result is not None:
                self.queue.extend([self.output_start] + self.tokenizer.encode(result) + [self.output_end])
        elif self.expr is not None:
            self.expr.append(token)


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
    def _columns(self, prompts, max_tokens, temperature, top_k, rng, choose=None):
        """
        Yields the next token of every row (a list of B ints) for up to max_tokens steps. `prompts`: B lists of token
        ids, of any lengths, one row each of one KVCache. Each run of consecutive prompts of one length is prefilled
        together into its rows (the same computation as those prompts alone); when the lengths differ the cache is
        per-row (KVCache.set_rows) and every row decodes at its own position. Then one forward of B tokens per step.
        choose(column), if given, returns the tokens actually taken (the tool's forced ones in place of sampled ones):
        those are yielded and fed.
        """
        model = self.model
        device = model.wte.weight.device
        autocast = torch.is_autocast_enabled(device.type)
        dtype = torch.get_autocast_dtype(device.type) if autocast else model.wte.weight.dtype
        c = model.config
        cache = KVCache(len(prompts), c.n_kv_head, model.head_dim, c.n_layer, max(map(len, prompts)) + max_tokens,
                        device, dtype)
        ids = None  # the tokens fed next, (B, 1) int64; None before the prefill
        for _ in range(max_tokens):
            if ids is None:
                logits = self._prefill(prompts, cache)
            else:
                logits = model(ids, kv_cache=cache, last_only=True)[:, -1, :]  # (B, vocab_size) fp32
            ids = sample_next(logits, temperature, top_k, rng)  # (B, 1) int64
            column = ids[:, 0].tolist()
            if choose is not None:
                column = choose(column)
                ids = torch.tensor(column, dtype=torch.long, device=device).view(-1, 1)
            yield column

    def _prefill(self, prompts, cache):
        """
        Prefills the B `prompts` (lists of token ids) into the empty KVCache `cache` (batch size B), row r prompt r,
        and returns the logits of every prompt's last token, fp32 (B, vocab_size). One length: one forward, the cache
        stays uniform. Several: each run of consecutive prompts of one length is one forward into its rows
        (KVCache.rows: the same computation as those prompts alone), and the cache becomes per-row (set_rows).
        """
        device = self.model.wte.weight.device
        runs = [0] + [r for r in range(1, len(prompts)) if len(prompts[r]) != len(prompts[r - 1])] + [len(prompts)]
        if len(runs) == 2:
            ids = torch.tensor(prompts, dtype=torch.long, device=device)  # (B, T) int64
            return self.model(ids, kv_cache=cache, last_only=True)[:, -1, :]
        logits = []
        for lo, hi in zip(runs[:-1], runs[1:]):
            sub = cache.rows(lo, hi)
            ids = torch.tensor(prompts[lo:hi], dtype=torch.long, device=device)
            logits.append(self.model(ids, kv_cache=sub, last_only=True)[:, -1, :])
            cache.set_rows(lo, sub)
        return torch.cat(logits)

    def _rng(self, temperature, seed):
        device = self.model.wte.weight.device
        return torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None

    def _chooser(self, n_rows, tool, masks):
        """The choose() of _columns for n_rows rows: None without the tool; with it, forced tokens replace sampled
        ones per ToolState, and each row's mask list (masks[r]) grows by 0 for a forced token, 1 for a sampled one."""
        if not tool:
            return None
        states = [ToolState(self.tokenizer) for _ in range(n_rows)]

        def choose(column):
            out = []
            for r, tok in enumerate(column):
                forced = states[r].next_forced()
                tok = tok if forced is None else forced
                masks[r].append(0 if forced is not None else 1)
                states[r].feed(tok)
                out.append(tok)
            return out
        return choose

    def sample(self, prompts, max_tokens, temperature=0.0, top_k=None, seed=42, max_batch=MAX_BATCH, tool=False,
               ignore_eos=False):
        """
        Completes each prompt (list[int] token ids; a batch list[list[int]]) with up to max_tokens new tokens, the
        calculator tool on or off (see the module docstring). Returns a list, in prompt order, of (ids, mask): ids
        list[int] the new tokens, ending with the stop token (<|assistant_end|> or <|bos|>) if the row stopped within
        max_tokens; mask list[int] of the same length, 1 for a token the model sampled (the stop token included), 0
        for one the tool forced. With ignore_eos a row does not stop at those tokens: max_tokens tokens each.
        Sampling: sample_next (temperature 0 greedy, else softmax(logits / temperature) restricted to the top_k
        logits, top_k None or 0: all), with one torch.Generator seeded with `seed` for the call. Prompts of any lengths run together, up to max_batch per KV cache (see the module docstring): with
        greedy decoding each row's tokens are those of the prompt alone; with sampling, a row's tokens depend on the
        other prompts of the call (they share the generator; give each its own call for independent samples).
        Raises UserError for an empty prompt, a negative temperature or max_tokens, or a prompt + max_tokens beyond
        the model's rotary table (10 * max_seq_len).
        """
        self._check(prompts, max_tokens, temperature)
        rng = self._rng(temperature, seed)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # stable: equal lengths keep their order
        out = [None] * len(prompts)
        for lo in range(0, len(order), max_batch):
            rows = order[lo:lo + max_batch]
            done = [False] * len(rows)
            results = [[] for _ in rows]
            masks = [[] for _ in rows]  # every token's mask, also after a row is done (cut below)
            choose = self._chooser(len(rows), tool, masks)
            for column in self._columns([prompts[i] for i in rows], max_tokens, temperature, top_k, rng, choose):
                for r, tok in enumerate(column):
                    if not done[r]:
                        results[r].append(tok)
                        done[r] = tok in self.stop_ids and not ignore_eos
                if all(done):
                    break
            for r, i in enumerate(rows):
                out[i] = (results[r], masks[r][:len(results[r])] if tool else [1] * len(results[r]))
        return out

    def generate(self, prompts, max_tokens, temperature=0.0, top_k=None, seed=42, max_batch=MAX_BATCH, tool=False,
                 ignore_eos=False):
        """
        Completes each prompt like sample() and returns list[list[int]]: the generated ids per prompt, in prompt
        order, without the prompt and without the stop token (<|assistant_end|> or <|bos|>) that ended the row
        (with ignore_eos: every row's max_tokens tokens, stop tokens included). Same sampling, batching, tool and
        errors as sample().
        """
        out = []
        for ids, _ in self.sample(prompts, max_tokens, temperature, top_k, seed, max_batch, tool, ignore_eos):
            out.append(ids[:-1] if ids and ids[-1] in self.stop_ids and not ignore_eos else ids)
        return out

    def generate_stream(self, prompt, max_tokens, temperature=0.0, top_k=None, seed=42, tool=False,
                        ignore_eos=False):
        """
        Yields the new token ids (int) of one prompt (list[int]) as they are generated (the tool's forced tokens
        included), up to max_tokens, stopping before <|assistant_end|> or <|bos|> (not yielded; with ignore_eos they
        are yielded and it goes on: max_tokens tokens). Same sampling, tool and errors as generate(); for the same
        arguments it yields exactly generate([prompt], ...)[0]. Leaves the model's train/eval mode alone.
        """
        self._check([prompt], max_tokens, temperature)
        choose = self._chooser(1, tool, [[]])
        rng = self._rng(temperature, seed)
        for column in self._columns([prompt], max_tokens, temperature, top_k, rng, choose):
            if column[0] in self.stop_ids and not ignore_eos:
                return
            yield column[0]
