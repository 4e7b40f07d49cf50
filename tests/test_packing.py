"""
Packing and ordering of chat data (nanotrain/sft_data.py, GPT.forward(doc_ids=...)): packed rows equal unpacked
conversations, the LPT packer's invariants, long-conversation policy, and exact resume of the sampler.
Tiny real GPT in fp32 on CPU.
"""

import math
import random

import pytest
import torch

import nanotrain.gpt as gpt_module
from nanotrain.attention import segment_info
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.sft_data import (
    IGNORE_INDEX,
    ConversationSampler,
    conversation_xy,
    fit_conversation,
    lpt_pack,
    micro_batch,
    pack_conversations,
    pad_conversations,
)

pytestmark = pytest.mark.unit

# every model option on: smear, value embeddings and the lambdas must not carry information across a boundary
TINY = dict(vocab_size=128, n_layer=2, model_dim=64, n_head=2, n_kv_head=1, max_seq_len=64, smear=True, backout=True,
            x0_lambdas=True)


def make_model(seed=0):
    """A tiny fp32 GPT whose zero-initialised projections are filled with random values (so attention matters)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**TINY))
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # the lambdas: moved off their init
                p.add_(torch.randn_like(p), alpha=0.1)
            elif name != "wte.weight":
                p.normal_(0.0, 1.0 / math.sqrt(p.size(1)))
    return model


def make_convs(all_trained):
    """4 conversations of 5..23 tokens; all_trained: every token is a target (mid-training style, where a target
    crossing a boundary would be trained), else the first half of each is masked (SFT style)."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n in (23, 5, 17, 11):
        ids = torch.randint(0, TINY["vocab_size"], (n,), generator=g).tolist()
        out.append((ids, [1] * n if all_trained else [0] * (n // 2) + [1] * (n - n // 2)))
    return out


def loss_and_grad(model, x, y, doc_ids=None):
    model.zero_grad(set_to_none=True)
    loss = model(x, y, loss_reduction="sum", doc_ids=doc_ids)
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()])


def unpacked(model, convs):
    """Each conversation alone as a (1, L) batch with the plain causal path; summed loss and its gradient."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for ids, mask in convs:
        x, y = conversation_xy(ids, mask)
        loss = model(torch.from_numpy(x)[None], torch.from_numpy(y)[None], loss_reduction="sum")
        loss.backward()
        total += loss.item()
    return total, torch.cat([p.grad.flatten() for p in model.parameters()])


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("all_trained", [True, False])
def test_packed_row_equals_unpacked(all_trained):
    """
    One packed row (block-diagonal causal mask, positions restarting per conversation, the boundary target masked)
    gives the summed loss and gradient of the conversations run one by one, within 1e-6 relative; so does the
    padded layout. Catches (both exercised, each must differ by > 1e-2): a row without doc_ids (attention and
    positions run across conversations), and, on fully trained data, targets that cross into the next conversation.
    """
    convs = make_convs(all_trained)
    model = make_model()
    ref_loss, ref_grad = unpacked(model, convs)
    x, y, doc_ids = pack_conversations(convs)
    assert x.shape == (1, sum(len(ids) for ids, _ in convs))
    loss, grad = loss_and_grad(model, x, y, doc_ids)
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss and rel(grad, ref_grad) <= 1e-6
    padded = micro_batch(convs, packing=False, pad_id=3)
    loss_p, grad_p = loss_and_grad(model, padded["x"], padded["y"])
    assert abs(loss_p - ref_loss) <= 1e-6 * ref_loss and rel(grad_p, ref_grad) <= 1e-6
    # wrong: no block-diagonal mask and no position restart
    _, grad_w = loss_and_grad(model, x, y)
    assert rel(grad_w, ref_grad) > 1e-2
    if all_trained:  # wrong: the last token of each conversation is trained to predict the next one's first token
        y_cross = y.clone()
        starts = [0]
        for ids, _ in convs[:-1]:
            starts.append(starts[-1] + len(ids))
        for s in starts[1:]:
            assert y_cross[0, s - 1] == IGNORE_INDEX
            y_cross[0, s - 1] = x[0, s]
        _, grad_c = loss_and_grad(model, x, y_cross, doc_ids)
        assert rel(grad_c, ref_grad) > 1e-2


def test_segment_info_positions_and_cu_seqlens():
    """Positions restart at every change of doc id (also when ids repeat across rows), cu_seqlens = [0, cumsum of
    segment lengths] over the flattened rows, and the SDPA mask is block-diagonal causal. Catches segments keyed on
    the raw id (row 2 reuses id 0) and off-by-one starts."""
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 5, 5, 5, 5]])
    seg = segment_info(doc_ids, varlen=True)
    assert seg.positions.tolist() == [[0, 1, 2, 0, 1, 0], [0, 1, 0, 1, 2, 3]]
    assert seg.cu_seqlens.tolist() == [0, 3, 5, 6, 8, 12] and seg.cu_seqlens.dtype == torch.int32
    assert seg.max_seqlen == 4
    mask = segment_info(doc_ids).mask
    assert mask.shape == (2, 1, 6, 6)
    expected = torch.zeros(6, 6, dtype=torch.bool)
    expected[:3, :3] = torch.ones(3, 3).tril().bool()
    expected[3:5, 3:5] = torch.ones(2, 2).tril().bool()
    expected[5, 5] = True
    assert torch.equal(mask[0, 0], expected)
    with pytest.raises(ValueError):
        make_model()(torch.zeros(1, 4, dtype=torch.long), doc_ids=torch.zeros(1, 3, dtype=torch.long))


def plan_cost(items, lengths, padded):
    return len(items) * max(lengths[i] for i in items) if padded else sum(lengths[i] for i in items)


def test_lpt_pack_invariants_random_cases():
    """
    Over 600 seeded random cases (lengths, budget, world size 1-5, item cap, padded or not): every item is assigned
    exactly once, every (micro-batch, rank) is within the token budget and the item cap, every rank has the same
    number of micro-batches, no micro-batch is empty on all ranks, the longest item is in micro-batch 0, and the
    plan is a pure function of the inputs (equal on a second call, with no rank argument). Catches greedy packers
    that overfill a bin, lose or duplicate an index, or give ranks different micro-batch counts (a DDP hang).
    """
    rng = random.Random(1234)
    for case in range(600):
        budget = rng.randint(1, 300)
        lengths = [rng.randint(1, budget) for _ in range(rng.randint(0, 60))]
        world_size, max_items, padded = rng.randint(1, 5), rng.choice([0, 0, 1, 2, 5]), rng.random() < 0.3
        plan = lpt_pack(lengths, budget, world_size, max_items, padded)
        assert plan == lpt_pack(list(lengths), budget, world_size, max_items, padded), case
        seen = sorted(i for mb in plan for bins in mb for i in bins)
        assert seen == list(range(len(lengths))), case
        for mb in plan:
            assert len(mb) == world_size, case
            assert any(mb), case
            for items in mb:
                if items:
                    assert plan_cost(items, lengths, padded) <= budget, case
                    assert not max_items or len(items) <= max_items, case
        if lengths:
            assert max(lengths) in [lengths[i] for bins in plan[0] for i in bins], case
    with pytest.raises(ValueError):
        lpt_pack([5, 11], 10)


def test_lpt_pack_fill_and_balance():
    """On a simple case the packer fills the ranks evenly: 8 equal items on 2 ranks at a budget of 2 items give
    2 micro-batches of 2 + 2 (not a greedy 4 micro-batches or one rank doing all the work)."""
    plan = lpt_pack([10] * 8, 20, world_size=2)
    assert [[len(b) for b in mb] for mb in plan] == [[2, 2], [2, 2]]


def test_fit_conversation_policies():
    """Longer than the limit: truncate keeps the first max_len tokens and says so, drop returns None; shorter ones
    pass unchanged. Catches a silent drop or a truncation that keeps the tail."""
    ids, mask = list(range(10)), [0] * 5 + [1] * 5
    assert fit_conversation(ids, mask, 10, "drop") == (ids, mask, "ok")
    assert fit_conversation(ids, mask, 6, "truncate") == (ids[:6], mask[:6], "truncated")
    assert fit_conversation(ids, mask, 6, "drop") == (None, None, "dropped")
    with pytest.raises(ValueError):
        fit_conversation(ids, mask, 6, "crop")


class BoundarySkippingSampler(ConversationSampler):
    """The wrong variant (like verl's bug): a restored state (epoch e > 0, offset 0) is taken as 'epoch e finished'."""

    def load_state_dict(self, state):
        super().load_state_dict(state)
        if self.offset == 0 and self.epoch > 0:
            self.epoch += 1


@pytest.mark.parametrize("first", [3, 10, 20, 25])
def test_sampler_resume_next_unseen(first):
    """
    Saving after `first` items (mid-epoch 3, exactly at the epoch boundary 10 and 20, and 25) and restoring into a
    new sampler continues with exactly the items an uninterrupted sampler hands out next; each epoch is a
    permutation of all items. Catches resume that restarts the epoch or skips the next epoch at a boundary
    (BoundarySkippingSampler, exercised: it must fail at the boundaries).
    """
    straight = ConversationSampler(10, seed=5)
    items = straight.take(40)
    assert sorted(items[:10]) == list(range(10)) and sorted(items[10:20]) == list(range(10))
    assert items[:10] != items[10:20]  # a new order every epoch
    cut = ConversationSampler(10, seed=5)
    cut.take(first)
    state = cut.state_dict()
    for cls in (ConversationSampler, BoundarySkippingSampler):
        resumed = cls(10, seed=5)
        resumed.load_state_dict(dict(state))
        ok = resumed.take(15) == items[first:first + 15]
        assert ok if cls is ConversationSampler else ok == (first % 10 != 0)
    legacy = ConversationSampler(10, seed=5)  # a state written as (epoch, num_items) is the next epoch's start
    legacy.load_state_dict({"epoch": 0, "offset": 10})
    assert legacy.take(5) == items[10:15]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_flash_varlen_matches_sdpa_mask():
    """On CUDA in bf16 with flash-attn installed, the varlen kernel path equals the SDPA block-diagonal mask path
    (loss within 1e-2 relative). Catches wrong cu_seqlens or a (B*T, H, D) layout mix-up."""
    if gpt_module.flash_attn_varlen_func is None:
        pytest.skip("flash-attn is not installed")
    model = make_model().cuda()
    x, y, doc_ids = pack_conversations(make_convs(True), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        flash = model(x, y, doc_ids=doc_ids).item()
        gpt_module.flash_attn_varlen_func, saved = None, gpt_module.flash_attn_varlen_func
        try:
            sdpa = model(x, y, doc_ids=doc_ids).item()
        finally:
            gpt_module.flash_attn_varlen_func = saved
    assert abs(flash - sdpa) <= 1e-2 * abs(sdpa)


def test_lpt_pack_literal_plans():
    """
    Plans worked out by hand. Equal loads go to the lowest rank first; a rank at max_items is skipped while another
    rank still has room; padded=False counts tokens (4 + 1 + 1 + 1 = 7 fits one budget of 7) where padded=True counts
    rows x longest (2 x 4 > 7: the 4 goes alone). Catches a full rank that closes the micro-batch for every rank,
    the padded cost used for packed rows (3x the micro-batches), and a tie rule that changes the plan between runs.
    """
    assert lpt_pack([2, 2], 10, world_size=2) == [[[0], [1]]]
    assert lpt_pack([1, 1, 1], 10, world_size=2, max_items=1) == [[[0], [1]], [[2], []]]
    assert lpt_pack([4, 1, 1, 1], 7) == [[[0, 1, 2, 3]]]
    assert lpt_pack([4, 1, 1, 1], 7, padded=True) == [[[0]], [[1, 2, 3]]]
    assert lpt_pack([], 7) == []


def test_sft_data_errors_name_the_problem():
    """The ValueErrors users meet name what is wrong (policy, max_len, the empty list, the item, the sizes, the
    sampler state). Catches a bare or empty message."""
    with pytest.raises(ValueError, match=r"long_conversations='crop': expected one of \('truncate', 'drop'\)"):
        fit_conversation([1, 2], [0, 1], 6, "crop")
    with pytest.raises(ValueError, match="max_len=1: a conversation needs at least 2 tokens"):
        fit_conversation([1, 2], [0, 1], 1)
    assert fit_conversation([1, 2], [0, 1], 2) == ([1, 2], [0, 1], "ok")  # 2 tokens: the smallest allowed max_len
    with pytest.raises(ValueError, match="^pack_conversations: no conversation$"):
        pack_conversations([])
    with pytest.raises(ValueError, match="^pad_conversations: no conversation$"):
        pad_conversations([], pad_id=0)
    with pytest.raises(ValueError, match=r"lpt_pack: max_tokens=0 and world_size=1 must be >= 1"):
        lpt_pack([1], 0)
    with pytest.raises(ValueError, match=r"lpt_pack: max_tokens=5 and world_size=0 must be >= 1"):
        lpt_pack([1], 5, world_size=0)
    with pytest.raises(ValueError, match=r"lpt_pack: item 1 has 0 tokens; expected 1..max_tokens=5"):
        lpt_pack([1, 0], 5)
    with pytest.raises(ValueError, match="ConversationSampler: num_items=0, expected >= 1"):
        ConversationSampler(0)
    with pytest.raises(ValueError, match=r"sampler state \{'epoch': -1, 'offset': 0\} does not fit 3 items"):
        ConversationSampler(3).load_state_dict({"epoch": -1, "offset": 0})
    with pytest.raises(ValueError, match="does not fit 3 items"):
        ConversationSampler(3).load_state_dict({"epoch": 0, "offset": 4})


def test_sampler_literal_orders_and_states():
    """
    One item: every take returns it and each one is an epoch; unshuffled: 0..n-1 in order; a saved (epoch, n) loads
    as (epoch + 1, 0); the seed and the shuffle setting reach the order: the first two epochs of 20 items with seed 1
    are the literal permutations below (numpy's PCG64 generator seeded with [seed, epoch], as sft_data documents it;
    recorded with numpy 2.4.6), not recomputed with epoch_order, which the sampler itself calls. Catches num_items=1
    refused, the seed or shuffle argument dropped (every run the same order, or a shuffle that cannot be turned off),
    an order seeded by the seed alone (epoch 1 would repeat epoch 0) or by seed + epoch, and an epoch-end state that
    repeats the epoch.
    """
    one = ConversationSampler(1)
    assert one.take(3) == [0, 0, 0] and one.state_dict() == {"epoch": 3, "offset": 0}
    plain = ConversationSampler(5, shuffle=False)
    assert plain.take(7) == [0, 1, 2, 3, 4, 0, 1] and plain.state_dict() == {"epoch": 1, "offset": 2}
    s = ConversationSampler(4)
    s.load_state_dict({"epoch": 2, "offset": 4})
    assert s.state_dict() == {"epoch": 3, "offset": 0}
    orders = {tuple(ConversationSampler(20, seed=seed).take(20)) for seed in (1, 2)}
    assert len(orders) == 2 and all(sorted(o) == list(range(20)) for o in orders)
    assert ConversationSampler(20, seed=1).take(40) == [
        1, 10, 18, 16, 7, 11, 12, 17, 15, 2, 3, 4, 5, 8, 0, 9, 14, 13, 6, 19,  # epoch 0
        7, 6, 19, 16, 12, 4, 18, 2, 14, 15, 9, 17, 1, 0, 3, 5, 8, 11, 10, 13]  # epoch 1


def test_batches_land_on_the_requested_device():
    """pack_conversations, pad_conversations and the empty micro-batch put their tensors on `device` (the meta
    device here stands in for CUDA, whose path the CPU suite cannot run). Catches a device argument dropped."""
    convs = [([1, 2, 3], [0, 1, 1]), ([4, 5], [1, 1])]
    assert {t.device.type for t in pack_conversations(convs, "meta")} == {"meta"}
    assert {t.device.type for t in pad_conversations(convs, 0, "meta")} == {"meta"}
    empty = micro_batch([], packing=True, pad_id=0, device="meta")
    assert empty["x"].device.type == empty["y"].device.type == "meta" and empty["x"].dtype == torch.int64
