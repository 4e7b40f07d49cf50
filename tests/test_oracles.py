"""
Oracle tests: the numbers users see (SFT evaluation loss, trained-target counts, bpb, loader positions, auto-batch
candidates, parameter and FLOP counts) pinned to values worked out by hand on tiny inputs or taken from a published
source, never recomputed with the code's own expression.

The hand-computable model (HandModel): a real GPT with model_dim 2, vocab 3 and the output projections at their
zero init, so every position's logits depend on its own input token only: wte rows [1, 1], [1, -1], [-1, 1] are
already RMS-normalised, lm_head is [[1, 1], [0, 0], [0, 0]], so input 0 gives logits [2, 0, 0] and inputs 1, 2 give
[0, 0, 0], soft-capped to [s, 0, 0] with s = 15 tanh(2 / 15). Its per-token losses are then
    nll(0 -> 0) = ln(e^s + 2) - s,   nll(0 -> 1) = nll(0 -> 2) = ln(e^s + 2),   nll(1 or 2 -> any) = ln 3.
"""

import json
import math
from contextlib import nullcontext

import pytest
import torch
from helpers import sft_backward

from nanotrain.auto_batch_size.search import candidate_batch_sizes
from nanotrain.auto_batch_size.stepdown import OOMStepDown, next_smaller_candidate
from nanotrain.dataloader import TokenLoader
from nanotrain.gpt import GPT, GPTConfig, config_from_depth
from nanotrain.loss_eval import evaluate_bpb
from nanotrain.sft_data import (
    IGNORE_INDEX,
    ConversationTokenStream,
    count_targets,
    evaluate_loss,
    global_target_count,
    micro_batch,
    token_loss_scale,
)

pytestmark = pytest.mark.unit

S = 15 * math.tanh(2 / 15)
NLL_00, NLL_01, LN3 = math.log(math.exp(S) + 2) - S, math.log(math.exp(S) + 2), math.log(3)


def hand_model():
    """The model of the module docstring (fp32, CPU)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=3, n_layer=1, n_head=1, n_kv_head=1, model_dim=2))
    model.init_weights()  # zero c_proj: the blocks add nothing to the residual stream
    with torch.no_grad():
        model.wte.weight.copy_(torch.tensor([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0]]))
        model.lm_head.weight.copy_(torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0]]))
    return model


def test_hand_model_losses_are_the_hand_table():
    """The premise of the oracles below: the model's per-token losses are the table of the module docstring."""
    model = hand_model()
    x = torch.tensor([[0, 0, 0, 1, 2]])
    y = torch.tensor([[0, 1, 2, 0, 1]])
    got = model(x, y, loss_reduction="none").tolist()
    assert got == pytest.approx([NLL_00, NLL_01, NLL_01, LN3, LN3], abs=1e-6)


# ----------------------------------------------------------------------------- SFT: targets, counts, loss
# (ids, mask) of four conversations; the trained targets are y[t] = ids[t+1] where mask[t+1] == 1, t < L-1.
A = ([0, 1, 0, 0], [0, 1, 1, 0])        # targets 1 (after 0), 0 (after 1); the masked last token is no target
B = ([1, 0, 1], [1, 1, 1])              # mask[0] never counts (no token before it): targets 0 (after 1), 1 (after 0)
C = ([0, 0], [0, 1])                    # one target: 0 after 0
D = ([2, 0, 0, 1, 0], [0, 0, 1, 0, 1])  # masked user turn, trained, masked, trained last token: 0 after 0, 0 after 1
CONVS = [A, B, C, D]
TARGETS = [2, 2, 1, 2]  # counted by hand from the comments above: 7 trained targets of 14 tokens
HAND_SUM = (NLL_01 + LN3) + (LN3 + NLL_01) + NLL_00 + (NLL_00 + LN3)
HAND_LOSS = HAND_SUM / 7


def test_trained_target_counts_are_exact():
    """
    count_targets and micro_batch count exactly the hand-counted targets: 2, 2, 1, 2 (7 of 14 tokens), packed and
    padded, and the packed targets are the literal row below (first label of every conversation masked, last
    position of each conversation IGNORE). Catches the off-by-ones of the SFT loss denominator: counting mask.sum()
    (8: includes B's mask[0]), counting the last position, or letting A's last label point at B's first token.
    """
    assert [count_targets(m) for _, m in CONVS] == TARGETS
    assert count_targets([1]) == 0 and count_targets([0, 0, 0]) == 0 and count_targets([1, 1]) == 1
    packed = micro_batch(CONVS, packing=True, pad_id=2)
    padded = micro_batch(CONVS, packing=False, pad_id=2)
    assert (packed["targets"], packed["tokens"]) == (padded["targets"], padded["tokens"]) == (7, 14)
    n = IGNORE_INDEX
    assert packed["y"].tolist() == [[1, 0, n, n, 0, 1, n, 0, n, n, 0, n, 0, n]]
    assert packed["doc_ids"].tolist() == [[0] * 4 + [1] * 3 + [2] * 2 + [3] * 5]
    assert padded["y"].tolist() == [[1, 0, n, n, n], [0, 1, n, n, n], [0, n, n, n, n], [n, 0, n, 0, n]]
    assert padded["x"].tolist() == [[0, 1, 0, 0, 2], [1, 0, 1, 2, 2], [0, 0, 2, 2, 2], [2, 0, 0, 1, 0]]
    empty = micro_batch([], packing=True, pad_id=2)
    assert (empty["targets"], empty["tokens"], empty["x"].tolist(), empty["y"].tolist()) == (0, 0, [[2]], [[n]])


@pytest.mark.parametrize("packing", [True, False])
@pytest.mark.parametrize("split", [[4], [2, 2], [1, 3], [1, 1, 1, 1]])
def test_sft_evaluation_loss_on_a_known_batch(packing, split):
    """
    evaluate_loss is the hand-computed token mean HAND_LOSS = (2 nll(0->1) + 2 nll(0->0) + 3 ln 3) / 7 = 1.177...,
    whatever the split into micro-batches and with packing or padding. Catches: a mean of per-micro-batch means
    (1.095 for the split 2 + 2), a denominator of tokens (0.589) or of mask ones (1.030), a float32 running sum
    that drifts, or a pad token counted as a target.
    """
    model = hand_model()
    batches, i = [], 0
    for n in split:
        batches.append(micro_batch(CONVS[i:i + n], packing=packing, pad_id=1))
        i += n
    model.train()
    got = evaluate_loss(model, iter(batches), autocast_ctx=nullcontext() if len(split) == 2 else None)
    assert got == pytest.approx(HAND_LOSS, abs=1e-6)
    assert model.training  # train mode restored
    assert math.isnan(evaluate_loss(model, [micro_batch([([0, 0], [1, 0])], packing, 1)]))  # no target: NaN


@pytest.mark.parametrize("autocast_ctx", [None, nullcontext()])
def test_sft_step_count_and_scaled_loss_are_the_hand_values(autocast_ctx):
    """
    sft_backward (global_target_count, then forward_backward with loss_scale) over two micro-batches returns the
    global target count 7 (the denominator) and the scaled loss HAND_SUM / 7, with or without an autocast context (fp32: nullcontext); the gradient of lm_head row 0 is the hand
    value; token_loss_scale and global_target_count are the literal values. Catches a count that is off by one or
    per micro-batch, and a scale of 1 / count that forgets the DDP world size (2 ranks: 2 / 8 = 0.25).
    """
    model = hand_model()
    batches = [micro_batch(CONVS[:2], True, 1), micro_batch(CONVS[2:], True, 1)]
    scaled, count = sft_backward(model, batches, autocast_ctx)
    assert count == 7 and scaled.item() == pytest.approx(HAND_LOSS, abs=1e-6)
    # d loss / d logit_0 = p_0 - [target == 0], times the soft-cap slope 1 - (s/15)^2 at logit 2 (1 at logit 0), times
    # the normalised input [1, 1] (token 0) or [1, -1] (token 1): 2 x (0->1) and 2 x (0->0) with p_0 = q, 3 x (1->0)
    # with p_0 = 1/3; over 7 targets
    q, slope = math.exp(S) / (math.exp(S) + 2), 1 - (S / 15) ** 2
    want = [((4 * q - 2) * slope - 2) / 7, ((4 * q - 2) * slope + 2) / 7]
    assert model.lm_head.weight.grad[0].tolist() == pytest.approx(want, abs=1e-6)
    assert global_target_count(7, "cpu") == 7
    assert token_loss_scale(8, 2) == 0.25 and token_loss_scale(4) == 0.25 and token_loss_scale(0, 2) == 0.0


# ----------------------------------------------------------------------------- bits per byte
def test_bpb_on_a_hand_computable_batch():
    """
    Two batches, token byte lengths [1, 3, 0] (token 2 is special), targets -1 and special targets left out:
    bpb = (2 nll(0->1) + 2 ln 3 + 2 nll(0->0)) / (ln 2 * 12 bytes), counted by hand below; a third batch in the
    iterator is not read (steps=2). Catches: counting the special target's loss (nats without bytes), a target -1
    read as token 0 (one byte too many), a mean of the per-batch bpb, nats reported as bits (no ln 2), or reading
    past `steps`.
    """
    model = hand_model()
    batches = iter([
        # counted: 0->1 (3 bytes), 1->0 (1 byte); not: 0->2 (special), 2->-1 (ignored)
        (torch.tensor([[0, 1, 0, 2]]), torch.tensor([[1, 0, 2, -1]])),
        # counted: 1->1 (3), 0->0 (1), 0->0 (1), 0->1 (3)
        (torch.tensor([[1, 0], [0, 0]]), torch.tensor([[1, 0], [0, 1]])),
        (torch.tensor([[0]]), torch.tensor([[5]])),  # would fail (target outside the vocab) if read
    ])
    got = evaluate_bpb(model, batches, 2, torch.tensor([1, 3, 0]))
    want = (2 * NLL_01 + 2 * LN3 + 2 * NLL_00) / (math.log(2) * 12)
    assert got == pytest.approx(want, abs=1e-6)
    assert evaluate_bpb(model, iter([(torch.tensor([[0]]), torch.tensor([[2]]))]), 1, torch.tensor([1, 3, 0])) \
        == float("inf")  # no byte counted at all


# ----------------------------------------------------------------------------- loader position bookkeeping
@pytest.mark.parametrize("read_ahead", [1, 128])
def test_token_loader_positions_after_k_batches(byte_tokenizer, four_docs, read_ahead):
    """
    Rows of 4 tokens (1 x (3 + 1)) from the stream [B a b c d][B e f][B g h i j k l][B m] | [B a b c d]...: the
    state after k batches is the literal (epoch, doc_index, offset) of token 4k, worked out by hand, whether the
    loader reads 1 or 128 documents ahead. Catches: an offset counted in rows, a doc_index that skips ahead to the
    last document read, an epoch bumped late or early at the wrap, and a state that lands inside the previous
    document at an exact document boundary (k=2).
    """
    B = 256
    loader = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", tokenizer_batch_docs=read_ahead, num_threads=1)
    want = [({"epoch": 0, "doc_index": 0, "offset": 4}, [B, 97, 98, 99]),
            ({"epoch": 0, "doc_index": 2, "offset": 0}, [100, B, 101, 102]),
            ({"epoch": 0, "doc_index": 2, "offset": 4}, [B, 103, 104, 105]),
            ({"epoch": 0, "doc_index": 3, "offset": 1}, [106, 107, 108, B]),
            ({"epoch": 1, "doc_index": 0, "offset": 3}, [109, B, 97, 98])]
    assert loader.state_dict() == {"epoch": 0, "doc_index": 0, "offset": 0}
    for state, row in want:
        x, y = loader.next_batch()
        assert x.tolist() == [row[:3]] and y.tolist() == [row[1:]]
        assert loader.state_dict() == state
    resumed = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1)
    resumed.load_state_dict({"epoch": 0, "doc_index": 2, "offset": 4})
    x, y = resumed.next_batch()
    assert x.tolist() == [[106, 107, 108]] and y.tolist() == [[107, 108, B]]


def test_token_loader_rank_positions_are_global_doc_indices(byte_tokenizer, four_docs):
    """
    Rank 1 of 2 reads documents 1 and 3 only ([B e f][B m], 5 tokens per epoch); rows of 2 tokens: states are
    literal global document indices. Catches a doc_index counted among the rank's own documents (0, 1 instead of
    1, 3) and a wrap that restarts at document 0 (rank 0's).
    """
    B = 256
    loader = TokenLoader(byte_tokenizer, four_docs, 1, 1, "cpu", rank=1, world_size=2, num_threads=1)
    want = [({"epoch": 0, "doc_index": 1, "offset": 2}, [B, 101]),
            ({"epoch": 0, "doc_index": 3, "offset": 1}, [102, B]),
            ({"epoch": 1, "doc_index": 1, "offset": 1}, [109, B])]
    for state, row in want:
        x, y = loader.next_batch()
        assert [x.item(), y.item()] == row and loader.state_dict() == state


def test_conversation_stream_positions_after_k_batches():
    """
    Conversations [1 2 3] [4 5] [6 7 8 9] unshuffled, rows of 3 tokens: the (epoch, offset, token) state after k
    batches is the literal table. Catches a token index not reset at a conversation end, an offset that skips a
    conversation, or an epoch that never advances.
    """
    s = ConversationTokenStream([[1, 2, 3], [4, 5], [6, 7, 8, 9]], batch_size=1, max_seq_len=2, shuffle=False)
    want = [((0, 1, 0), [1, 2, 3]), ((0, 2, 1), [4, 5, 6]), ((0, 3, 0), [7, 8, 9]), ((1, 1, 0), [1, 2, 3]),
            ((1, 2, 1), [4, 5, 6])]
    for (epoch, offset, token), row in want:
        x, y = s.next_batch()
        assert x.tolist() == [row[:2]] and y.tolist() == [row[1:]]
        assert s.state_dict() == {"epoch": epoch, "offset": offset, "token": token}


# ----------------------------------------------------------------------------- auto batch size
def test_auto_batch_candidates_and_step_down_are_literal_lists():
    """
    Literal divisor lists, worked out by hand: 524288 tokens of 2048 on 8 ranks -> 32 rows -> [1, 2, 4, 8, 16, 32];
    12288 / 256 = 48 rows; 2304 / 64 = 36 rows capped at 10; 896 / 128 = 7 (prime). The step-down from 48 visits every
    smaller divisor in order. Catches powers of two only (misses 3, 6, 12, ...), a cap applied as '<', a missing
    square-root divisor (6 of 36), and a step-down by halving (48 -> 24 -> 12 skips 16).
    """
    assert candidate_batch_sizes(524288, 2048, 8) == [1, 2, 4, 8, 16, 32]
    assert candidate_batch_sizes(12288, 256, 1) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 48]
    assert candidate_batch_sizes(2304, 64, 1, max_batch_size=9) == [1, 2, 3, 4, 6, 9]
    assert candidate_batch_sizes(2304, 64, 1, max_batch_size=10) == [1, 2, 3, 4, 6, 9]
    assert candidate_batch_sizes(896, 128, 1) == [1, 7]
    assert candidate_batch_sizes(128, 128, 1) == [1]
    cands, size, seen = candidate_batch_sizes(12288, 256, 1), 48, []
    while size is not None:
        size = next_smaller_candidate(cands, size)
        seen.append(size)
    assert seen == [24, 16, 12, 8, 6, 4, 3, 2, 1, None]


class OOMAbove(torch.nn.Module):
    """A tiny real model that raises a real torch.OutOfMemoryError for micro-batches above `limit` rows."""

    def __init__(self, limit):
        super().__init__()
        self.limit, self.calls, self.w = limit, [], torch.nn.Parameter(torch.ones(()))

    def forward(self, x, y):
        self.calls.append(x.size(0))
        if x.size(0) > self.limit:
            raise torch.OutOfMemoryError("simulated")
        return self.w * (x == y).float().mean()


def test_oom_step_down_visits_the_literal_sequence(tmp_path, monkeypatch):
    """
    12 rows, candidates of 12 rows [1, 2, 3, 4, 6, 12], memory for 3 rows: the micro-batch sizes tried are exactly
    12, 6, 4, then four of 3; the record gets [step, 12, 3] and the loss is the mean of the rows. Catches a step-down
    by halving (12 -> 6 -> 3 skips 4), a step-down that restarts from the top, and a loss not averaged over the
    micro-batches (x == y on 6 of 12 rows: 0.5); the log lines name each step-down with its accumulation steps.
    """
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    model = OOMAbove(limit=3)
    x = torch.zeros(12, 2, dtype=torch.long)
    y = torch.cat([torch.zeros(6, 2), torch.ones(6, 2)]).long()
    record = {"candidates": [1, 2, 3, 4, 6, 12], "cache_key": {}}
    logs = []
    step_down = OOMStepDown(record, None, 12, log=logs.append)
    loss = step_down.forward_backward(model, x, y, nullcontext(), step=7)
    assert model.calls == [12, 6, 4, 3, 3, 3, 3]
    assert logs == [f"out of memory at device_batch_size={a}: stepping down to {b} (grad_accum_steps {m} -> {n}) and "
                    f"redoing this step" for a, b, m, n in [(12, 6, 1, 2), (6, 4, 2, 3), (4, 3, 3, 4)]]
    assert step_down.device_batch_size == 3 and record["step_downs"] == [[7, 12, 3]]
    assert loss.item() == 0.5 and model.w.grad.item() == 0.5


@pytest.mark.parametrize("cands,eager,limit,want,calls", [
    ([1, 2, 4, 8, 16, 32], 2, 64, 8, [2, 4, 8]),  # fits everywhere: 3 probes at most, so 8 (not 32)
    ([1, 2, 4], 4, 64, 4, [4]),  # the largest candidate: nothing above it to try
    ([1, 2, 4], 2, 64, 4, [2, 4]),  # one step up to the largest
    ([1, 2, 4, 8], 2, 1, 1, [2, 1]),  # down to the smallest candidate, which fits
])
def test_compiled_refinement_literal_probe_sequences(cands, eager, limit, want, calls):
    """
    The compiled check of the eager answer probes exactly the listed sizes (worked out by hand from the rule: verify,
    step down on failure, else step up while the next fits, 3 probes in all). Catches a budget of 4 probes (16 or 32
    instead of 8), an index run past the largest candidate (IndexError), a step-down that stops before the smallest
    candidate (an error although 1 fits), and a step-up that skips a candidate.
    """
    from nanotrain.auto_batch_size.search import _refine_compiled
    seen = []

    def fits(b):
        seen.append(b)
        return b <= limit
    assert _refine_compiled(fits, cands, eager) == want and seen == calls


def test_check_probes_rejects_a_size_that_also_failed():
    """A cache entry whose probes say its size both fits and does not fit is contradictory and rejected. Catches a
    comparison that accepts a failure at the size itself (only failures strictly below it)."""
    from nanotrain.auto_batch_size.cache import check_probes
    fits = {"batch_size": 4, "peak_bytes": 10, "result": "fits", "phase": "search"}
    check_probes(4, [fits, {**fits, "batch_size": 8, "result": "OOM"}], 100)  # consistent: no error
    with pytest.raises(ValueError, match=r"not the answer of its search probes \(fits: \[4\]; does not fit: \[4\]\)"):
        check_probes(4, [fits, {**fits, "result": "over budget"}], 100)


@pytest.mark.parametrize("packing", [True, False])
def test_sft_probe_model_is_the_rows_chat_sft_trains(packing):
    """
    sft_builder's probe model on (B, T) rows gives the loss of B independent conversations: packed (one row of B * T
    tokens in B segments) or padded, both equal the mean of the per-row losses of the plain model, computed one row
    at a time. Its cache key records the packing. Catches segments that leak attention or positions across rows,
    a packed path that drops doc_ids, and a key without packing (a padded entry reused for packed runs).
    """
    from helpers import tiny_model

    from nanotrain.auto_batch_size.builders import sft_builder
    model = tiny_model()
    build = sft_builder(model.config, packing, weight_decay=0.0)
    assert build.key_fields["packing"] is packing and build.key_fields["optimizer_kwargs"] == {"weight_decay": 0.0}
    probe, optimizers = build("cpu")
    assert probe.packing is packing and len(optimizers) == 2 and probe.model.activation_checkpointing == "none"
    checkpointed = sft_builder(model.config, packing, activation_checkpointing="full")
    assert checkpointed.key_fields["activation_checkpointing"] == "full"
    assert checkpointed("cpu")[0].model.activation_checkpointing == "full"
    probe.model.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 64, (3, 16), generator=g), torch.randint(0, 64, (3, 16), generator=g)
    per_row = torch.stack([model(x[i:i + 1], y[i:i + 1]) for i in range(3)]).mean()
    assert probe(x, y).item() == pytest.approx(per_row.item(), abs=1e-5)


def test_agree_reraises_and_cache_warnings_name_the_reason(tmp_path, monkeypatch):
    """
    _agree re-raises the error of its function (single process: the rank's own exception); a cache file with another
    key or a size that is not a candidate is ignored with a warning naming the reason. Catches an error swallowed
    into a None result (discovery would go on without a model) and a warning that does not say why the entry was
    dropped.
    """
    from nanotrain.auto_batch_size.cache import cache_path, read_cached, write_cached
    from nanotrain.auto_batch_size.search import _agree
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    with pytest.raises(ZeroDivisionError):
        _agree(lambda: 1 / 0, torch.device("cpu"), "testing")
    assert _agree(lambda: 7, torch.device("cpu"), "testing") == 7
    key = {"candidates": [1, 2, 4], "x": 1}
    probes = [{"batch_size": 2, "peak_bytes": 1, "result": "fits", "phase": "search"}]
    write_cached(key, 2, probes)
    entry = json.load(open(cache_path(key)))
    for edit, reason in [({"key": {**key, "x": 2}}, "ValueError: its key does not match this run's key"),
                         ({"device_batch_size": 3}, "ValueError: device_batch_size=3 is not a candidate")]:
        json.dump({**entry, **edit}, open(cache_path(key), "w"))
        logs = []
        assert read_cached(key, 10, log=logs.append) is None
        assert len(logs) == 1 and logs[0].endswith(reason)


# ----------------------------------------------------------------------------- parameters and FLOPs
def hand_shapes(vocab, dim, n_layer, n_head, n_kv_head):
    """The parameter shapes of the architecture, written out module by module (no biases, untied head)."""
    hd = dim // n_head
    shapes = {"wte.weight": (vocab, dim), "lm_head.weight": (vocab, dim)}
    for i in range(n_layer):
        shapes.update({f"blocks.{i}.attn.c_q.weight": (n_head * hd, dim),
                       f"blocks.{i}.attn.c_k.weight": (n_kv_head * hd, dim),
                       f"blocks.{i}.attn.c_v.weight": (n_kv_head * hd, dim),
                       f"blocks.{i}.attn.c_proj.weight": (dim, n_head * hd),
                       f"blocks.{i}.mlp.c_fc.weight": (4 * dim, dim),
                       f"blocks.{i}.mlp.c_proj.weight": (dim, 4 * dim)})
    return shapes


def test_parameter_shapes_and_counts_by_hand():
    """
    With value embeddings and smear off (the nanochat v1 model; test_gpt.py counts them), every parameter's name and shape
    equals the hand-written module list, and num_params() the sum, worked out:
    depth 2 (dim 128, 1 head of 128), vocab 300: per block 4 * 128^2 + 2 * 4 * 128^2 = 196,608, two blocks 393,216,
    wte + lm_head 2 * 300 * 128 = 76,800: 470,016. GQA (dim 64, 4 heads of 16, 2 kv heads), 3 blocks, vocab 500:
    per block 4096 + 2 * 2048 + 4096 + 2 * 16384 = 45,056, x3 = 135,168, + 2 * 32,000 = 199,168. Catches biases,
    tied embeddings, k/v sized with n_head under GQA and a wrong MLP width.
    """
    for config, total in [(config_from_depth(2, 300, 16, value_embeds=False, smear=False), 470_016),
                          (GPTConfig(max_seq_len=48, vocab_size=500, n_layer=3, n_head=4, n_kv_head=2, model_dim=64,
                                     value_embeds=False, smear=False), 199_168)]:
        with torch.device("meta"):
            model = GPT(config)
        got = {name: tuple(p.shape) for name, p in model.named_parameters()}
        c = config
        assert got == hand_shapes(c.vocab_size, c.model_dim, c.n_layer, c.n_head, c.n_kv_head)
        assert model.num_params() == total


def test_flops_per_token_golden_values():
    """
    estimate_flops() of the nanochat v1 model (value embeddings and smear off) against values with a source: nanochat's d20
    speedrun report card (karpathy/nanochat,
    report.md, "Base model training": "Number of parameters: 560,988,160", "Number of FLOPs per token:
    3.491758e+09") and, for the GQA model above, a hand count: 6 FLOPs per weight of the 167,168 matmul weights
    (all but wte: training = forward 2 + backward 4 per multiply-add) = 1,003,008, plus attention scores and values
    over the full 48 x 48 window, 3 layers x 4 heads x (2 + 2) x 16 x 48 FLOPs x 3 (forward + backward) = 110,592:
    1,113,600. Catches counting the embedding, counting attention with n_kv_head, or forward-only FLOPs.
    """
    with torch.device("meta"):
        d20 = GPT(config_from_depth(20, 65536, 2048, value_embeds=False, smear=False))
        gqa = GPT(GPTConfig(max_seq_len=48, vocab_size=500, n_layer=3, n_head=4, n_kv_head=2, model_dim=64,
                            value_embeds=False, smear=False))
    assert d20.num_params() == 560_988_160
    assert f"{d20.estimate_flops():.6e}" == "3.491758e+09"
    assert gqa.estimate_flops() == 1_113_600


# ----------------------------------------------------------------------------- Muon's Newton-Schulz
# On a diagonal matrix the quintic Newton-Schulz map acts on each singular value alone: x <- a x + b x^3 + c x^5 with
# Keller Jordan's published (a, b, c) = (3.4445, -4.7750, 2.0315), starting from G / ||G||_F. For diag(3, 4) the
# start is (0.6, 0.8); by hand (a calculator, 6 decimals) the 5 steps give
#   0.6 -> 1.193269 -> 0.911918 -> 0.801138 -> 0.974702 -> 0.722876
#   0.8 -> 0.976482 -> 0.721118 -> 1.089457 -> 0.696045 -> 1.119204
NS_1_STEP, NS_5_STEPS = (1.193269, 0.976482), (0.722876, 1.119204)


def test_newton_schulz_on_a_diagonal_matrix_is_the_hand_sequence():
    """
    zeropower_via_newtonschulz5 of diag(3, 4), padded to 2 x 3 (wide) and 3 x 2 (tall: the transposed path), after 1
    and 5 steps, is the hand sequence above. Catches wrong or reordered coefficients, a spectral instead of Frobenius
    normalisation, a missing transpose back, and a step count off by one.
    """
    from nanotrain.muon import zeropower_via_newtonschulz5
    wide = torch.tensor([[3.0, 0.0, 0.0], [0.0, 4.0, 0.0]])
    for steps, (s1, s2) in ((1, NS_1_STEP), (5, NS_5_STEPS)):
        want = torch.tensor([[s1, 0.0, 0.0], [0.0, s2, 0.0]])
        got = zeropower_via_newtonschulz5(wide, steps=steps, dtype=torch.float32)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
        torch.testing.assert_close(zeropower_via_newtonschulz5(wide.T, steps=steps, dtype=torch.float32), want.T,
                                   atol=2e-5, rtol=0)


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_first_step_is_the_hand_value(nesterov):
    """
    One Muon step from p = 0 with gradient diag(3, 4) padded to 3 x 2 (tall), lr 0.1: the first momentum buffer is
    (1 - m) g and the Nesterov look-ahead (1 - m^2) g, both along g, and Newton-Schulz ignores the scale, so the update
    is -0.1 * sqrt(3 / 2) * NS(g): -0.1 * 1.224745 * (0.722876, 1.119204) on the diagonal = (-0.088534, -0.137074).
    Catches a missing or inverted aspect-ratio scale (sqrt(2/3) on a tall matrix), an lr ignored or applied twice, and
    an update that is not orthogonalised.
    """
    from nanotrain.muon import Muon
    p = torch.nn.Parameter(torch.zeros(3, 2))
    p.grad = torch.tensor([[3.0, 0.0], [0.0, 4.0], [0.0, 0.0]])
    Muon([p], lr=0.1, momentum=0.9, nesterov=nesterov, ns_dtype="float32").step()
    want = torch.tensor([[-0.088534, 0.0], [0.0, -0.137074], [0.0, 0.0]])
    torch.testing.assert_close(p.detach(), want, atol=2e-6, rtol=0)
