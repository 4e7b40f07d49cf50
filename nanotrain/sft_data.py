"""
Chat data for mid-training and SFT, from rendered conversations (token ids + mask, nanotrain.tokenizer's
render_conversation) to the tensors a training step runs on:

- conversation_xy / pack_conversations / pad_conversations: inputs and targets of one micro-batch, either packed
  (padding-free: several conversations in one row, doc_ids for GPT.forward so attention stays inside each
  conversation and positions restart) or padded (one row per conversation).
- lpt_pack: assigns the conversations of an optimizer step to ranks and micro-batches under a token budget,
  longest first, with the same number of micro-batches on every rank.
- ConversationSampler: the order of the conversations, epoch by epoch, with (epoch, offset) as resumable state.
- token_loss_scale / global_target_count / evaluate_loss: the loss of a step as a global token mean, whatever the
  split into micro-batches and ranks (the scale is nanotrain.training.forward_backward's loss_scale; a mean per
  micro-batch would weight the tokens of short micro-batches more: the gradient-accumulation bug that Hugging Face
  transformers fixed in 2024).
- ConversationTokenStream: mid-training's rows, conversations concatenated and cut as pretraining cuts documents.

Targets use IGNORE_INDEX = -1 (GPT.forward's ignore index) for every position that is not trained.
"""

from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from nanotrain.common import all_reduce_scalar, eval_mode, is_distributed

IGNORE_INDEX = -1
LONG_POLICIES = ("truncate", "drop")


# ----------------------------------------------------------------------------- one conversation
def fit_conversation(ids, mask, max_len, policy="truncate"):
    """
    Applies the long-conversation policy to one rendered conversation (ids, mask: equal-length lists of int).
    Returns (ids, mask, status): status "ok" (unchanged, len <= max_len), "truncated" (cut to the first max_len
    tokens), "dropped" (too long under "drop") or "no_target" (no target token left, count_targets 0: a row whose
    long prompt the truncation cut before any reply; its loss would be 0 / 0); ids and mask are None for the last two.
    Raises ValueError for an unknown policy or max_len < 2.
    """
    if policy not in LONG_POLICIES:
        raise ValueError(f"long_conversations={policy!r}: expected one of {LONG_POLICIES}")
    if max_len < 2:
        raise ValueError(f"max_len={max_len}: a conversation needs at least 2 tokens to have a target")
    status = "ok"
    if len(ids) > max_len:
        if policy == "drop":
            return None, None, "dropped"
        ids, mask, status = ids[:max_len], mask[:max_len], "truncated"
    if count_targets(mask) == 0:
        return None, None, "no_target"
    return ids, mask, status


def conversation_xy(ids, mask):
    """
    Inputs and targets of one conversation of L tokens: x = ids (L,), y[t] = ids[t+1] where mask[t+1] is 1, else
    IGNORE_INDEX, and y[L-1] = IGNORE_INDEX (nothing after the last token). Returns two np.int64 arrays (L,).
    Packed rows concatenate these, so no target ever points into the next conversation (the label of each packed
    conversation's first token is masked).
    """
    ids = np.asarray(ids, dtype=np.int64)
    m = np.asarray(mask, dtype=bool)
    y = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    y[:-1] = np.where(m[1:], ids[1:], IGNORE_INDEX)
    return ids, y


def count_targets(mask):
    """Number of trained targets of a conversation (int): mask[1:].sum(), as conversation_xy counts them."""
    return int(np.asarray(mask[1:], dtype=np.int64).sum())


# ----------------------------------------------------------------------------- micro-batch tensors
def pack_conversations(convs, device="cpu"):
    """
    Padding-free packing: concatenates the conversations [(ids, mask), ...] into one row of N = sum of lengths.
    Returns (x, y, doc_ids), each int64 (1, N) on `device`: y from conversation_xy per conversation, doc_ids[t] =
    index of t's conversation (for GPT.forward(doc_ids=...): block-diagonal causal attention, positions from 0).
    Source: padding-free collation as in mini_trainer and HF DataCollatorWithFlattening, with the boundary label
    masked (which mini_trainer misses). Raises ValueError for an empty list.
    """
    if not convs:
        raise ValueError("pack_conversations: no conversation")
    xy = [conversation_xy(ids, mask) for ids, mask in convs]
    as_row = lambda parts: torch.from_numpy(np.concatenate(parts))[None].to(device)
    return (as_row([x for x, _ in xy]), as_row([y for _, y in xy]),
            as_row([np.full(len(x), i, dtype=np.int64) for i, (x, _) in enumerate(xy)]))


def pad_conversations(convs, pad_id, device="cpu"):
    """
    Padded batch: one row per conversation [(ids, mask), ...], right-padded to the longest with `pad_id` (inputs)
    and IGNORE_INDEX (targets). Returns (x, y), int64 (n, L_max) on `device`. Causal attention never lets a real
    token see the padding after it, so the padding changes nothing but compute. Raises ValueError for an empty list.
    """
    if not convs:
        raise ValueError("pad_conversations: no conversation")
    L = max(len(ids) for ids, _ in convs)
    x = np.full((len(convs), L), pad_id, dtype=np.int64)
    y = np.full((len(convs), L), IGNORE_INDEX, dtype=np.int64)
    for i, (ids, mask) in enumerate(convs):
        x[i, :len(ids)], y[i, :len(ids)] = conversation_xy(ids, mask)
    return torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)


def micro_batch(convs, packing, pad_id, device="cpu"):
    """
    The tensors of one micro-batch of one rank: {"x", "y", "doc_ids" (None unless packed), "tokens" (real tokens,
    int), "targets" (trained targets, int)}. An empty list gives the zero-weight dummy micro-batch x = [[pad_id]],
    y = [[IGNORE_INDEX]], which lets a rank with no data left run the same number of forward/backward passes as the
    others (its summed loss is 0, so its gradient is exactly zero).
    """
    if not convs:
        x = torch.full((1, 1), pad_id, dtype=torch.int64, device=device)
        return {"x": x, "y": torch.full_like(x, IGNORE_INDEX), "doc_ids": None, "tokens": 0, "targets": 0}
    if packing:
        x, y, doc_ids = pack_conversations(convs, device)
    else:
        (x, y), doc_ids = pad_conversations(convs, pad_id, device), None
    return {"x": x, "y": y, "doc_ids": doc_ids, "tokens": sum(len(ids) for ids, _ in convs),
            "targets": sum(count_targets(mask) for _, mask in convs)}  # counted on the host: no device read


# ----------------------------------------------------------------------------- assignment to ranks and micro-batches
def lpt_pack(lengths, max_tokens, world_size=1, max_items=0, padded=False):
    """
    Assigns items (conversations) of the given lengths (tokens) to micro-batches and ranks, longest first: the items
    are sorted by decreasing length (ties by index) and each goes to the least-loaded rank of the current micro-batch
    that can still take it; when none can, the micro-batch is closed and the next one opened (LPT scheduling,
    Graham 1969, as in mini_trainer's batch_lengths_to_minibatches_lpt).
    A rank can take an item if its tokens stay <= max_tokens (padded=True: count * longest, the size of the padded
    batch) and, if max_items > 0, it holds fewer than max_items items.
    Returns plan: list over micro-batches of `world_size` lists of item indices (plan[m][r]; an empty list means rank r
    runs a zero-weight micro-batch). Every rank has len(plan) micro-batches; every index appears once; the result is
    a pure function of the arguments (the same on every rank). The longest items land in micro-batch 0, so a memory
    problem shows at the first micro-step. Raises ValueError if an item is empty or longer than max_tokens.
    """
    if max_tokens < 1 or world_size < 1:
        raise ValueError(f"lpt_pack: max_tokens={max_tokens} and world_size={world_size} must be >= 1")
    for i, n in enumerate(lengths):
        if not 1 <= n <= max_tokens:
            raise ValueError(f"lpt_pack: item {i} has {n} tokens; expected 1..max_tokens={max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    plan, pos = [], 0
    while pos < len(order):
        bins, loads = [[] for _ in range(world_size)], [0] * world_size
        while pos < len(order):
            s = lengths[order[pos]]
            best = None
            for r in range(world_size):
                if max_items and len(bins[r]) >= max_items:
                    continue
                cost = (len(bins[r]) + 1) * (lengths[bins[r][0]] if bins[r] else s) if padded else loads[r] + s
                if cost <= max_tokens and (best is None or loads[r] < loads[best]):
                    best = r
            if best is None:
                break
            bins[best].append(order[pos])
            loads[best] += s
            pos += 1
        plan.append(bins)
    return plan


# ----------------------------------------------------------------------------- order of the conversations
def epoch_order(num_items, seed, epoch, shuffle=True):
    """The order of items 0..num_items-1 in epoch `epoch`: a permutation seeded by (seed, epoch) (numpy PCG64), or
    0..num_items-1 when shuffle is False. Returns list[int]; the same on every machine and rank."""
    if not shuffle:
        return list(range(num_items))
    return np.random.default_rng([seed, epoch]).permutation(num_items).tolist()


class ConversationSampler:
    """
    Hands out item indices (0..num_items-1) in epoch_order, epoch after epoch. Its state is (epoch, offset): the
    position of the next unseen item, so a resumed run continues with exactly the next unseen conversation. When an
    epoch is used up the state moves to (epoch + 1, 0) at once, and a state saved as (epoch, num_items) is read the
    same way, so resuming at an epoch boundary neither repeats nor skips an epoch. Identical on every rank (the
    ranks split each step's items with lpt_pack). Raises ValueError if num_items < 1.
    """

    def __init__(self, num_items, seed=0, shuffle=True):
        if num_items < 1:
            raise ValueError(f"ConversationSampler: num_items={num_items}, expected >= 1")
        self.num_items, self.seed, self.shuffle = num_items, seed, shuffle
        self.epoch, self.offset = 0, 0
        self._order_epoch, self._order = None, None

    def take(self, k):
        """The next k item indices (list[int]), crossing into the next epoch when this one runs out."""
        out = []
        while len(out) < k:
            if self._order_epoch != self.epoch:
                self._order = epoch_order(self.num_items, self.seed, self.epoch, self.shuffle)
                self._order_epoch = self.epoch
            n = min(k - len(out), self.num_items - self.offset)
            out += self._order[self.offset:self.offset + n]
            self.offset += n
            if self.offset == self.num_items:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

    def state_dict(self):
        """{"epoch", "offset"} (ints) of the next unseen item."""
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state):
        """Continues from state_dict(). Raises ValueError for an offset outside 0..num_items."""
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if not 0 <= offset <= self.num_items or epoch < 0:
            raise ValueError(f"sampler state {state} does not fit {self.num_items} items (same data set?)")
        self.epoch, self.offset = (epoch + 1, 0) if offset == self.num_items else (epoch, offset)


# ----------------------------------------------------------------------------- loss normalisation
def global_target_count(local_count, device):
    """The number of trained targets of an optimizer step over all ranks (int): all-reduce SUM (exact, int64) of
    this rank's count over its micro-batches, taken before any backward. Without torch.distributed it is local_count."""
    return all_reduce_scalar(int(local_count), "sum", device)  # no process group: no tensor, so no CUDA sync


def token_loss_scale(global_count, world_size=1):
    """
    The factor for each micro-batch's summed loss (GPT.forward(..., loss_reduction="sum")) before backward
    (nanotrain.training.forward_backward's loss_scale):
    world_size / global_count, where world_size is the number of ranks whose gradients DDP averages (1 without DDP).
    Summed over micro-batches and averaged over ranks, the gradient is then exactly that of
    (sum of all per-token losses of the step) / global_count, whatever the split into micro-batches and ranks
    (mini_trainer's scaling; not the per-micro-batch mean of the gradient-accumulation bug that Hugging Face
    transformers fixed in 2024). Returns 0.0 when global_count is 0 (the caller skips that step).
    """
    return 0.0 if global_count == 0 else world_size / global_count


@torch.no_grad()
def evaluate_loss(model, batches, autocast_ctx=None, stop=None):
    """
    Token-weighted mean loss (nats per trained target, float) over an iterable of micro_batch() dicts: sum of
    per-token losses / number of trained targets, both summed over all ranks (all-reduce), so it does not depend
    on how the data is split into micro-batches or ranks. NaN if there is no target at all. Every rank must pass
    the same number of batches (lpt_pack guarantees it). Restores model.train() mode if it was on.
    stop: optional callable, asked before each batch (equally often on every rank, so it may be collective): when
    it returns True the evaluation is abandoned and None is returned (a stop request during a long evaluation).
    """
    total, count, device = None, 0, None
    with eval_mode(model):
        for b in batches:
            if stop is not None and stop():
                return None
            device = b["x"].device
            with autocast_ctx if autocast_ctx is not None else nullcontext():
                loss = model(b["x"], b["y"], loss_reduction="sum", doc_ids=b["doc_ids"])
            total = loss.double() if total is None else total + loss.double()
            count += b["targets"]
    device = device or torch.device("cpu")
    stats = torch.stack([total if total is not None else torch.zeros((), dtype=torch.float64, device=device),
                         torch.tensor(float(count), dtype=torch.float64, device=device)])
    if is_distributed():
        dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[1]).item() if stats[1].item() > 0 else float("nan")


# ----------------------------------------------------------------------------- mid-training token stream
class ConversationTokenStream:
    """
    Mid-training rows (nanochat mid_train): the token lists of the conversations (list of list[int], e.g. rendered
    conversations, every token trained), concatenated in epoch_order and cut into rows of
    max_seq_len + 1 tokens as in pretraining; next_batch() returns (x, y) int64 (batch_size, max_seq_len) on `device`
    with y the next tokens.
    Conversations run across row boundaries and attention is causal over the whole row, like base_train.
    State: (epoch, offset of the conversation holding the next unseen token in the epoch's order, token index in
    it), so resume continues at exactly the next unseen token. Loops over epochs forever. Raises ValueError if there
    are no tokens.
    """

    def __init__(self, token_lists, batch_size, max_seq_len, device="cpu", seed=0, shuffle=True):
        self.tokens = [np.asarray(t, dtype=np.int64) for t in token_lists]
        if sum(len(t) for t in self.tokens) == 0:
            raise ValueError("ConversationTokenStream: no tokens")
        self.batch_size, self.max_seq_len = batch_size, max_seq_len
        self.device, self.seed, self.shuffle = torch.device(device), seed, shuffle
        self.epoch, self.offset, self.token = 0, 0, 0
        self._order_epoch, self._order = None, None

    @property
    def tokens_per_epoch(self):
        """Total tokens of one pass over the conversations (int)."""
        return sum(len(t) for t in self.tokens)

    def state_dict(self):
        """{"epoch", "offset", "token"} (ints) of the next unseen token."""
        return {"epoch": self.epoch, "offset": self.offset, "token": self.token}

    def load_state_dict(self, state):
        """Continues from state_dict() of a stream over the same conversations."""
        self.epoch, self.offset, self.token = int(state["epoch"]), int(state["offset"]), int(state["token"])

    def _take(self, n):
        parts, got = [], 0
        while got < n:
            if self._order_epoch != self.epoch:
                self._order = epoch_order(len(self.tokens), self.seed, self.epoch, self.shuffle)
                self._order_epoch = self.epoch
            if self.offset == len(self._order):
                self.epoch, self.offset, self.token = self.epoch + 1, 0, 0
                continue
            toks = self.tokens[self._order[self.offset]]
            piece = toks[self.token:self.token + (n - got)]
            parts.append(piece)
            got += len(piece)
            self.token += len(piece)
            if self.token >= len(toks):
                self.offset, self.token = self.offset + 1, 0
        return np.concatenate(parts)

    def next_batch(self, batch_size=None):
        """The next (x, y), each int64 (batch_size, max_seq_len) on the device; batch_size defaults to the stream's.
        n rows at once are the same tokens as n calls of one row each."""
        B, T = batch_size or self.batch_size, self.max_seq_len
        rows = torch.from_numpy(self._take(B * (T + 1))).view(B, T + 1)
        x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
        return x.to(self.device), y.to(self.device)

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()
