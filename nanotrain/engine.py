"""
Inference: generation with the KV cache for a batch of prompts (chat eval, the CLI), stopping at <|assistant_end|>
or <|bos|>, and loading a checkpoint of a training stage for inference. After nanochat's engine.py
(karpathy/nanochat), without its calculator tool.

Batching: prompts of the same length are prefilled and decoded together in one KV cache (nanotrain.gpt.KVCache keeps
one position for all rows, so rows of different lengths would need left-padding and masks; grouping avoids both).
"""

import os
import sys
from collections import defaultdict

import torch
import torch.nn.functional as F

from nanotrain.checkpoint import (
    INFERENCE_META_KEYS,
    CheckpointError,
    find_run_dir,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    skip_reason,
)
from nanotrain.common import UserError
from nanotrain.gpt import GPTConfig, KVCache, build_model
from nanotrain.tokenizer import get_tokenizer

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


def _what(exc, base):
    """What is wrong with a skipped checkpoint, its file named relative to `base` (nanotrain.checkpoint.skip_reason
    for an error other than a CheckpointError)."""
    return f"{os.path.relpath(exc.file, base)} {exc.problem}" if isinstance(exc, CheckpointError) else skip_reason(exc)


def load_model(stage, run_name="", step=-1, device="cpu"):
    """
    Loads a checkpoint of a training stage for inference, as scripts/sample.py does: the newest run of `stage`
    ("base", "mid" or "sft") if run_name is "", and its newest checkpoint if step < 0. Returns
    (model in eval mode (fp32 weights on `device`), tokenizer, checkpoint path, meta dict).

    A checkpoint that cannot be used (nanotrain.checkpoint.CheckpointError: a missing, truncated or garbage file, a
    pickle of arbitrary objects, a meta.json without "model_config", weights that do not fit it) is handled as
    training's resume handles it: without a step, the newest readable checkpoint is loaded and one line
    `warning: ...` on stderr names every newer one skipped, what is wrong with it, and the one loaded (stderr, like
    the scripts' `checkpoint: ...` line, because stdout of sample.py and chat_cli.py is the generated text); a
    checkpoint asked for by step that cannot be used is an error, never replaced by another.
    Raises UserError (one line) if there is no such run or checkpoint, no readable checkpoint (naming the newest
    one's bad file and what is wrong), an unreadable requested step, or no tokenizer or another one than the
    model's.
    """
    if stage not in ("base", "mid", "sft"):
        raise UserError(f"--source={stage!r}: expected 'base', 'mid' or 'sft'")
    run_dir = find_run_dir(stage, run_name)
    script = {"base": "base_train.py", "mid": "mid_train.py", "sft": "chat_sft.py"}[stage]
    paths = list_checkpoints(run_dir) if run_dir is not None else []
    if not paths:
        where = f" for --run_name={run_name}" if run_name else ""
        raise UserError(f"no {stage} checkpoint found{where}; train one first (python scripts/{script})")
    if step >= 0:  # that checkpoint or an error, never another one
        path = next((p for p in paths if p.endswith(f"step_{step:06d}")), None)
        if path is None:
            raise UserError(f"--step={step}: no such checkpoint in {run_dir}")
        try:
            ckpt = load_checkpoint(path, device, load_optimizer=False, meta_keys=INFERENCE_META_KEYS)
        except CheckpointError as e:
            raise UserError(f"cannot read the checkpoint {path}: {_what(e, path)}") from None
    else:  # the newest readable one, as a resume takes it
        skipped = []  # (path, exception) of the newer checkpoints that cannot be used, newest first
        ckpt = load_latest(run_dir, device, load_optimizer=False, meta_keys=INFERENCE_META_KEYS, skipped=skipped)
        if ckpt is None:
            path, e = skipped[0]
            n = len(skipped) - 1
            older = f" (and the {n} older checkpoint{'s' if n > 1 else ''} cannot be read either)" if n else ""
            raise UserError(f"cannot read the checkpoint {path}: {_what(e, path)}{older}")
        path = ckpt["path"]
        if skipped:
            why = "; ".join(_what(e, os.path.dirname(p)) for p, e in skipped)
            print(f"warning: loaded the older checkpoint {path}: the newer one{'s' if len(skipped) > 1 else ''} "
                  f"cannot be read: {why}", file=sys.stderr, flush=True)
    tokenizer = get_tokenizer()
    model = build_model(GPTConfig(**ckpt["meta"]["model_config"]), device, ckpt, tokenizer.get_vocab_size(),
                        tokenizer_sha256=tokenizer.fingerprint())
    model.eval()
    return model, tokenizer, path, ckpt["meta"]
