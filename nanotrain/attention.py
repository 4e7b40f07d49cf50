"""
Attention and its parts for nanotrain.gpt: rotary embeddings (Su et al. 2021, "RoFormer"),
the layout of packed rows (segment_info), the KV cache used in generation, and attention() over the available
backends (flash-attn 2 when installed on CUDA, else PyTorch SDPA; sliding windows also through flex_attention).

Sliding windows (GPTConfig.window_pattern): a layer with window W lets the query at position i attend to the keys at
positions i-W..i (W+1 keys, itself included; the start clipped at 0); a layer without one (None) is full causal,
keys 0..i. This is FlashAttention's window_size=(W, 0) (flash-attn 2 and 3, as nanochat passes it), so W is the same
number here, in flash-attn, in the KV cache's masks, in the transformers export (whose sliding_window counts the keys:
W+1) and in GPT.estimate_flops. Backends of a windowed layer without a KV cache, when the window cuts (T > W+1):
- flash-attn 2 installed, CUDA, bf16/fp16: flash_attn_func / flash_attn_varlen_func with window_size=(W, 0);
- CUDA otherwise, plain rows, training (q needs grad) or inside torch.compile: flex_attention (torch >= 2.5, here
  2.11 and 2.13: flex_attention(q, k, v, block_mask=, enable_gqa=) and create_block_mask(mask_mod, B, H, Q_LEN,
  KV_LEN, device=)) with a block mask built once per (T, W, device) and cached; compiled with torch.compile (the
  model's own compile traces it, an uncompiled model calls a torch.compile'd flex_attention), as flex_attention is only
  fast compiled;
- else (the CPU, where torch 2.13's flex_attention has no backward and runs unfused without compile; packed rows
  without flash-attn; evaluation of an uncompiled model on CUDA, whose shapes vary): SDPA with an explicit boolean
  mask, cached per shape (on the CPU SDPA runs it on its flash kernel: output + logsumexp kept, like flex).
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from nanotrain.errors import UserError

try:  # optional: FlashAttention-2 (pip install flash-attn); SDPA is used whenever it is absent
    from flash_attn import flash_attn_func, flash_attn_varlen_func
except ImportError:
    flash_attn_func = flash_attn_varlen_func = None

def compute_dtype(x):
    """The dtype a matmul on x runs in: autocast's for x's device type when autocast is on there, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def apply_rotary_emb(x, cos, sin):
    """Rotates the two halves of the head dim. x: (B, T, H, D); cos, sin: (1 or B, T, 1, D/2). Same shape/dtype out."""
    d = x.size(3) // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=3)


class Segments(NamedTuple):
    """
    The layout of packed rows, from segment_info(), or of the rows of a per-row KVCache, from KVCache.segments().
    positions: int64 (B, T), each token's position inside its own segment (0 at a segment's first token). mask: bool
    (B, 1, T, Tk), True where query t may attend to key s, for SDPA (packed rows: Tk = T, same segment and s <= t; a
    per-row cache: Tk = the cache's keys, s <= the query's position); None on the flash-attn path. cu_seqlens: int32
    (num_segments + 1,), the start offsets of the segments in the flattened (B*T) tokens followed by B*T, for
    flash_attn_varlen_func; None on the SDPA path. max_seqlen: the longest segment in tokens (int; 0 on the SDPA path).
    """
    positions: torch.Tensor
    mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int


def segment_info(doc_ids, varlen=False):
    """
    Segments of packed rows. doc_ids: int (B, T), the sequence id of every token; a segment is a run of equal
    consecutive ids inside one row (so ids may repeat across rows, and only changes between neighbours matter).
    varlen=True builds cu_seqlens/max_seqlen (flash-attn's variable-length kernel), else the SDPA boolean mask.
    Returns Segments. E.g. one row with doc_ids [0, 0, 0, 1, 1] gives positions [0, 1, 2, 0, 1] and
    cu_seqlens [0, 3, 5].
    """
    B, T = doc_ids.shape
    device = doc_ids.device
    start = torch.ones(B, T, dtype=torch.bool, device=device)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    ar = torch.arange(T, device=device).expand(B, T)
    positions = ar - torch.where(start, ar, 0).cummax(dim=1).values
    if varlen:
        starts = start.flatten().nonzero().flatten()
        cu_seqlens = torch.cat([starts, torch.tensor([B * T], device=device)]).to(torch.int32)
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
        return Segments(positions, None, cu_seqlens, max_seqlen)
    seg = start.cumsum(dim=1)  # segment number inside the row
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    mask = (seg[:, :, None] == seg[:, None, :]) & causal
    return Segments(positions, mask[:, None], None, 0)


class KVCache:
    """
    Preallocated keys/values for generation. k_cache, v_cache: (n_layer, batch_size, n_kv_head, max_len, head_dim)
    of `dtype` on `device`; prev_embedding: the last token's normed embedding (B, 1, model_dim) of each row, or None;
    GPT.smear reads and sets it. Two modes:
    - uniform (lengths None, the default): every row holds `pos` tokens. A forward with the cache inserts its T new
      tokens at `pos` in every layer and `pos` advances by T after the last layer.
    - per row (after set_rows; mixed-length generation): lengths, int64 (B,) on `device`, is each row's own number of
      tokens and `pos` the largest of them (the key slots in use). A forward inserts row r's T new tokens at
      lengths[r].., each at rotary position lengths[r] + t, attending to its own slots 0..lengths[r] + t only
      (segments() gives those positions and masks); lengths and pos advance by T after the last layer. Slots past a
      row's length hold stale values, always masked out.
    A sliding-window layer's keys are kept here like any other's: attention() masks those outside its window.
    """

    def __init__(self, batch_size, n_kv_head, head_dim, n_layer, max_len, device, dtype):
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.v_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.n_layer, self.max_len, self.pos = n_layer, max_len, 0
        self.lengths = None
        self.prev_embedding = None

    def reset(self):
        """Forgets the stored tokens (the memory is reused) and goes back to the uniform mode."""
        self.pos = 0
        self.lengths = None
        self.prev_embedding = None

    def rows(self, lo, hi, pos=0):
        """
        A uniform KVCache over rows lo..hi-1 of this one, sharing its memory, holding `pos` tokens (0: empty; else
        those rows' first pos tokens, and their smear embeddings): a forward with it (e.g. the prefill of prompts of
        one length, or the next chunk of a long prompt) writes those rows here. Record what it holds with
        set_rows(lo, sub).
        """
        sub = KVCache.__new__(KVCache)
        sub.k_cache, sub.v_cache = self.k_cache[:, lo:hi], self.v_cache[:, lo:hi]
        sub.n_layer, sub.max_len, sub.pos, sub.lengths = self.n_layer, self.max_len, pos, None
        sub.prev_embedding = None if pos == 0 or self.prev_embedding is None else self.prev_embedding[lo:hi]
        return sub

    def set_rows(self, lo, sub, lengths=None):
        """
        Switches to the per-row mode (all rows at length 0 first) and records `sub` (a uniform cache from
        rows(lo, hi), filled): rows lo..hi-1 hold sub.pos tokens each, or lengths[i] tokens for row lo + i (a list:
        right-padded prompts, whose pad is past the row's length, masked out and later overwritten), and sub's
        prev_embedding.
        """
        B = self.k_cache.size(1)
        if self.lengths is None:
            self.lengths = torch.zeros(B, dtype=torch.long, device=self.k_cache.device)
        hi = lo + sub.k_cache.size(1)
        self.lengths[lo:hi] = sub.pos if lengths is None else torch.tensor(lengths, device=self.lengths.device)
        self.pos = max(self.pos, sub.pos)
        if sub.prev_embedding is not None:
            if self.prev_embedding is None:
                self.prev_embedding = sub.prev_embedding.new_zeros(B, *sub.prev_embedding.shape[1:])
            self.prev_embedding[lo:hi] = sub.prev_embedding

    def move_row(self, src, dst):
        """Per-row mode: row src's tokens (keys and values up to its length), length and smear embedding copied to
        row dst; row src is then free (length 0). Nothing to do for src == dst."""
        if src == dst:
            return
        n = int(self.lengths[src])
        self.k_cache[:, dst, :, :n] = self.k_cache[:, src, :, :n]
        self.v_cache[:, dst, :, :n] = self.v_cache[:, src, :, :n]
        self.lengths[dst], self.lengths[src] = n, 0
        if self.prev_embedding is not None:
            self.prev_embedding[dst] = self.prev_embedding[src]

    def free_row(self, r):
        """Forgets row r's tokens (per-row mode: length 0; uniform: nothing kept per row); its slots are reused by the
        next row put there."""
        if self.lengths is not None:
            self.lengths[r] = 0

    def head(self, n):
        """
        Per-row mode: a KVCache over rows 0..n-1 sharing keys and values, for one decode step of those rows: per-row
        too, sharing the lengths (a forward advances them here), its pos the longest of those rows; for n = 1, a
        uniform cache at row 0's length (no mask: Engine's one-prompt path). Call merge(view) after the forward.
        """
        view = KVCache.__new__(KVCache)
        view.k_cache, view.v_cache = self.k_cache[:, :n], self.v_cache[:, :n]
        view.n_layer, view.max_len = self.n_layer, self.max_len
        view.lengths = self.lengths[:n] if n > 1 else None
        view.pos = int(self.lengths[:n].max())
        view.prev_embedding = None if self.prev_embedding is None else self.prev_embedding[:n]
        return view

    def merge(self, view):
        """Records a head(n) view's forward here: row 0's length (n = 1), the rows' smear embeddings, pos."""
        n = view.k_cache.size(1)
        if view.lengths is None:
            self.lengths[0] = view.pos
        if view.prev_embedding is not None:
            if self.prev_embedding is None:
                self.prev_embedding = view.prev_embedding.new_zeros(self.k_cache.size(1),
                                                                    *view.prev_embedding.shape[1:])
            self.prev_embedding[:n] = view.prev_embedding
        self.pos = int(self.lengths.max())

    def segments(self, T):
        """
        Per-row mode: the Segments of a forward of T tokens per row. positions int64 (B, T): lengths[r] + t; mask
        bool (B, 1, T, pos + T): query t of row r sees the key slots s <= lengths[r] + t of its row.
        """
        positions = self.lengths[:, None] + torch.arange(T, device=self.lengths.device)
        keys = torch.arange(self.pos + T, device=self.lengths.device)
        return Segments(positions, (keys <= positions[:, :, None])[:, None], None, 0)

    def insert_kv(self, layer_idx, k, v):
        """
        Stores k, v (B, n_kv_head, T, head_dim) of layer `layer_idx` at slots pos..pos+T-1 (uniform mode), or row
        r's at lengths[r]..lengths[r]+T-1 (per-row mode), and returns that layer's keys and values for slots
        0..pos+T-1, each (B, n_kv_head, pos+T, head_dim) in the cache dtype (per-row mode: mask them with
        segments(T)). Raises ValueError when the cache would overflow max_len.
        """
        t0, t1 = self.pos, self.pos + k.size(2)
        if t1 > self.max_len:
            raise ValueError(f"KVCache overflow: {t1} tokens > max_len {self.max_len}")
        if self.lengths is None:
            self.k_cache[layer_idx, :, :, t0:t1] = k
            self.v_cache[layer_idx, :, :, t0:t1] = v
        else:  # row r's token t to slot lengths[r] + t: (B, T) indices, the head dim between them -> (B, T, H, D)
            slots = self.lengths[:, None] + torch.arange(k.size(2), device=k.device)
            rows = torch.arange(k.size(0), device=k.device)[:, None]
            self.k_cache[layer_idx][rows, :, slots] = k.transpose(1, 2).to(self.k_cache.dtype)
            self.v_cache[layer_idx][rows, :, slots] = v.transpose(1, 2).to(self.v_cache.dtype)
        if layer_idx == self.n_layer - 1:
            self.pos = t1
            if self.lengths is not None:
                self.lengths += k.size(2)
        return self.k_cache[layer_idx, :, :, :t1], self.v_cache[layer_idx, :, :, :t1]


def default_short_window(max_seq_len):
    """The S layers' default window: a quarter of max_seq_len rounded up to a multiple of 128 (the kernels' tile),
    at least 128, as nanochat: 512 at max_seq_len 2048, 128 at 256. Returns an int."""
    return max(128, -(-(max_seq_len // 4) // 128) * 128)


def resolve_short_window(config):
    """GPTConfig.__post_init__: a short_window of None becomes default_short_window(config.max_seq_len), so that the
    config (and a checkpoint's copy of it) keeps the window whatever max_seq_len it is later rebuilt with."""
    if config.short_window is None:
        config.short_window = default_short_window(config.max_seq_len)


def attention_windows(config):
    """
    The attention window of every layer of `config` (a GPTConfig): a list of n_layer entries, None for a full causal
    layer ("L") and config.short_window for a sliding-window one ("S": the query at position i attends keys
    i-short_window..i); window_pattern is tiled over the layers (SSSL at depth 6: S S S L S L) and the last layer is
    always full, as in nanochat (karpathy/nanochat gpt.py, window_pattern). Raises UserError for a pattern that is
    empty or has other letters than S and L, or a short_window < 1.
    """
    pattern = config.window_pattern
    if not isinstance(pattern, str) or not pattern or set(pattern) - {"S", "L"}:
        raise UserError(f"window_pattern={pattern!r}: expected a non-empty string of S (short window) and L (full), "
                        f"e.g. SSSL")
    if not isinstance(config.short_window, int) or config.short_window < 1:
        raise UserError(f"short_window={config.short_window!r}: expected an int >= 1 (tokens before the query)")
    windows = [config.short_window if pattern[i % len(pattern)] == "S" else None for i in range(config.n_layer)]
    windows[-1] = None
    return windows


def window_mask(q_pos, Tk, window=None):
    """
    The boolean attention mask of queries at key positions q_pos (int64, any shape (..., Tq)) over keys 0..Tk-1:
    True where key s may be attended, s <= q_pos and, with a window W (int), q_pos - W <= s (see the module
    docstring). Returns bool (..., Tq, Tk) on q_pos's device.
    """
    dist = q_pos[..., None] - torch.arange(Tk, device=q_pos.device)
    return (dist >= 0) if window is None else (dist >= 0) & (dist <= window)


_CACHE = {}  # (kind, T, window, device) -> a window mask: the last few shapes, built outside compile and fake tensors
_CACHE_SIZE = 8
_compiled_flex = None  # torch.compile(flex_attention), made on first use (importing torch._dynamo is slow)


def _cached(key, build, x):
    """build() memoised under `key`, except while torch.compile traces (the graph builds it; a cached object there
    would be a guarded global, retraced once it appears) and for fake or meta x (never kept for real tensors)."""
    if torch.compiler.is_compiling() or is_fake(x) or x.device.type == "meta":
        return build()
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = build()
    return _CACHE[key]


def _window_mod(window):
    """flex_attention's mask_mod of a window W: key kv_idx visible to query q_idx iff q_idx - W <= kv_idx <= q_idx."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= window)
    return mask_mod


def use_flex(q):
    """Whether windowed_attention's automatic choice is flex_attention for q (B, H, T, D): on CUDA, for training (q
    needs grad) or inside torch.compile, with a power-of-two head_dim >= 16 (what its kernels take)."""
    D = q.size(-1)
    return (q.is_cuda and (q.requires_grad or torch.compiler.is_compiling()) and D >= 16 and D & (D - 1) == 0)


def windowed_attention(q, k, v, window, backend=None):
    """
    Sliding-window causal attention without a KV cache: q (B, n_head, T, D), k, v (B, n_kv_head, T, D) (SDPA's
    layout; GQA when n_kv_head < n_head); the query at position i attends keys i-window..i. backend: "flex"
    (flex_attention with the cached block mask; on the CPU forward only, unfused: torch has no CPU backward for it),
    "sdpa" (SDPA with the cached explicit mask), or None: flex where use_flex(q), else sdpa. Under FakeTensorMode
    (plan mode, the batch-size probes) flex runs its fake kernel, whose saved tensors are the fused kernel's (q, k,
    v, out, logsumexp); the sdpa path also keeps SDPA's additive copy of the mask per call (T x T). Returns y
    (B, n_head, T, D) in q's dtype. Raises ValueError for another backend.
    """
    T, gqa = q.size(2), k.size(1) != q.size(1)
    backend = backend or ("flex" if use_flex(q) else "sdpa")
    if backend == "flex":
        block_mask = _cached(("flex", T, window, q.device), lambda: create_block_mask(
            _window_mod(window), None, None, T, T, device=q.device), q)
        flex = flex_attention  # inside torch.compile (traced into the model's graph), on the CPU, or fake tensors
        if q.is_cuda and not torch.compiler.is_compiling() and not is_fake(q):  # uncompiled: flex compiled alone
            global _compiled_flex
            if _compiled_flex is None:
                _compiled_flex = torch.compile(flex_attention, dynamic=False)
            flex = _compiled_flex
        return flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    if backend != "sdpa":
        raise ValueError(f"windowed_attention: backend must be 'flex', 'sdpa' or None, got {backend!r}")
    mask = _cached(("sdpa", T, window, q.device), lambda: window_mask(torch.arange(T, device=q.device), T, window), q)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def attention(q, k, v, layer_idx, kv_cache=None, segments=None, window=None):
    """
    Causal attention of q (B, T, n_head, head_dim) over k, v (B, T, n_kv_head, head_dim) (GQA when n_kv_head <
    n_head), full (window None) or in a sliding window: the query at position i sees keys i-window..i (the module
    docstring), on the first backend that fits:
    - packed rows (segments with cu_seqlens): flash-attn's variable-length kernel over the B*T flattened tokens;
    - plain causal rows on CUDA in bf16/fp16 with flash-attn installed: flash_attn_func (window_size=(window, 0));
    - packed rows otherwise: SDPA with the block-diagonal causal boolean mask of `segments` (and the window's);
    - plain rows otherwise: SDPA is_causal, or for a window that cuts (T > window + 1) windowed_attention (flex on
      CUDA, an explicit mask elsewhere);
    - with a KVCache: k, v are stored at the cache position of layer `layer_idx`, then SDPA over the whole prefix
      (prefill from position 0: causal; one decode token: no mask, or the last window + 1 keys; a chunk at pos > 0:
      causal within the chunk; a per-row cache, segments from kv_cache.segments(): its boolean mask) with the window's
      mask on top where it cuts. The cache keeps every token; the window only masks.
    Returns y (B, T, n_head, head_dim) in q's dtype.
    """
    B, T, n_head, head_dim = q.shape
    window_size = (-1, -1) if window is None else (window, 0)  # flash-attn's (left, right); -1: unbounded
    if segments is not None and segments.cu_seqlens is not None:
        cu, n = segments.cu_seqlens, segments.max_seqlen
        y = flash_attn_varlen_func(q.reshape(B * T, n_head, head_dim), k.reshape(B * T, -1, head_dim),
                                   v.reshape(B * T, -1, head_dim), cu, cu, n, n, causal=True, window_size=window_size)
        return y.view(B, T, n_head, head_dim)
    if (kv_cache is None and segments is None and flash_attn_func is not None and q.is_cuda
            and q.dtype in (torch.bfloat16, torch.float16)):
        return flash_attn_func(q, k, v, causal=True, window_size=window_size)  # (B, T, H, D), GQA handled natively
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # SDPA's (B, H, T, D) layout
    gqa = k.size(1) != n_head
    if kv_cache is not None:
        k, v = kv_cache.insert_kv(layer_idx, k, v)
        k, v = k.to(q.dtype), v.to(q.dtype)
        Tq, Tk = q.size(2), k.size(2)
        cuts = window is not None and Tk > window + 1  # some query here has a key outside its window
        if segments is not None:  # a per-row cache: each row sees its own slots up to its query's position
            mask = window_mask(segments.positions[:, None], Tk, window) if cuts else segments.mask
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        elif Tq == 1:  # one decode token sees the whole prefix, or its window's last window + 1 keys
            if cuts:
                k, v = k[:, :, Tk - window - 1:], v[:, :, Tk - window - 1:]
            y = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
        elif Tq == Tk and not cuts:  # prefill from position 0: plain causal
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:  # a chunk at pos > 0 (the prefix visible, causal within the chunk), or a window that cuts
            mask = window_mask(torch.arange(Tk - Tq, Tk, device=q.device), Tk, window)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    elif segments is not None:
        mask = segments.mask
        if window is not None and T > window + 1:
            mask = mask & window_mask(torch.arange(T, device=q.device), T, window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    elif window is not None and T > window + 1:
        y = windowed_attention(q, k, v, window)
    else:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return y.transpose(1, 2)
