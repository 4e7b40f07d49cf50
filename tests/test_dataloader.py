"""
Tests of the token loaders (nanotrain/dataloader.py): TokenLoader's shapes, determinism, rank disjointness, exact
resume, epochs and prefetch; exact resume of the mid-training ConversationTokenStream.
"""

import collections
import gc
import io
import json
import random
import time

import pytest
import torch

from nanotrain.dataloader import TokenLoader
from nanotrain.dataset import resolve_data_files
from nanotrain.errors import UserError
from nanotrain.sft_data import ConversationTokenStream

pytestmark = pytest.mark.unit


@pytest.fixture
def files(base_dir):
    return resolve_data_files("builtin", "val")


def drain(loader):
    rows = []
    for x, y in loader:
        assert torch.equal(x[:, 1:], y[:, :-1])
        rows.append(torch.cat([x, y[:, -1:]], dim=1).reshape(-1))
    return torch.cat(rows).numpy()


def test_shapes_and_targets(tiny_tokenizer, files):
    loader = TokenLoader(tiny_tokenizer, files, 4, 32, "cpu")
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert x[0, 0].item() == tiny_tokenizer.get_bos_token_id()  # the stream starts with a document's BOS


# The streams of four_docs ("abcd", "ef", "ghijkl", "m"; BOS 256, letters are their bytes) per rank, written out by
# hand: rank r of w reads documents r, r + w, ...
A, E, G, M = [256, 97, 98, 99, 100], [256, 101, 102], [256, 103, 104, 105, 106, 107, 108], [256, 109]
RANK_STREAMS = {1: [A + E + G + M], 2: [A + G, E + M], 3: [A + M, E, G]}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_read_disjoint_strides_completely(byte_tokenizer, four_docs, world):
    """
    Each rank's stream is exactly the hand-written BOS + tokens of its own documents (RANK_STREAMS), nothing skipped
    or repeated; rows of 2 tokens (max_seq_len 1) leave at most one token of the stream unread. Catches ranks
    reading the same data or a contiguous block instead of a stride, a document's tail dropped at a row boundary,
    documents out of order, and a missing BOS.
    """
    for rank in range(world):
        got = drain(TokenLoader(byte_tokenizer, four_docs, 1, 1, "cpu", rank, world, loop=False)).tolist()
        want = RANK_STREAMS[world][rank]
        assert len(want) - len(got) < 2 and got == want[:len(got)], (world, rank, got)


def test_deterministic(tiny_tokenizer, files):
    a = TokenLoader(tiny_tokenizer, files, 2, 16, "cpu")
    b = TokenLoader(tiny_tokenizer, files, 2, 16, "cpu")
    for _ in range(5):
        assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), b.next_batch()))


@pytest.mark.parametrize("k", [0, 1, 7, 40])
def test_exact_resume(tiny_tokenizer, files, k):
    """
    A loader restored from state_dict() continues with exactly the next unseen tokens, also mid-document and with
    another batch size. Catches: resuming at the start of the document (repeats tokens) or at the next document
    (skips tokens), i.e. a state without the in-document offset.
    """
    a = TokenLoader(tiny_tokenizer, files, 3, 20, "cpu", 1, 2, tokenizer_batch_docs=4)
    for _ in range(k):
        a.next_batch()
    state = a.state_dict()
    rest = torch.cat([torch.cat([x, y[:, -1:]], 1).reshape(-1) for x, y in (a.next_batch() for _ in range(6))])
    b = TokenLoader(tiny_tokenizer, files, 9, 20, "cpu", 1, 2)  # other batch size: the position is in tokens
    b.load_state_dict(state)
    x, y = b.next_batch()
    assert torch.equal(torch.cat([x, y[:, -1:]], 1).reshape(-1), rest[: 9 * 21])
    if k == 7:
        assert state["offset"] > 0  # the interesting case: the position is inside a document


def test_epochs_wrap_around(tiny_tokenizer, files):
    """With loop=True the loader starts epoch 1 at the first document again after reading everything once."""
    n = len(drain(TokenLoader(tiny_tokenizer, files, 4, 64, "cpu", loop=False)))
    loader = TokenLoader(tiny_tokenizer, files, 4, 64, "cpu")
    first = loader.next_batch()[0]
    for _ in range(n // (4 * 65) + 1):
        loader.next_batch()
    assert loader.state_dict()["epoch"] == 1
    fresh = TokenLoader(tiny_tokenizer, files, 4, 64, "cpu")
    fresh.load_state_dict({"epoch": 1, "doc_index": 0, "offset": 0})
    assert torch.equal(fresh.next_batch()[0], first)


# ---------------------------------------------------------------------------- the prefetch thread

def batches_and_states(loader, sizes):
    """[(x, y, state_dict() after the batch)] for next_batch(size) over `sizes`; a StopIteration is recorded as None."""
    out = []
    for size in sizes:
        try:
            x, y = loader.next_batch(size)
        except StopIteration:
            out.append(None)
            continue
        out.append((x, y, loader.state_dict()))
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None)
        if g is not None:
            assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) and g[2] == w[2]


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetch_same_batches_and_states(tiny_tokenizer, files, depth):
    """
    With the background thread the batches and the state after each batch are exactly those of the synchronous
    loader, including when the batch size changes between calls. Catches: state_dict() reporting the thread's
    read-ahead position (a resume would skip the prefetched batches), a size change serving the stale prefetched
    rows, or a rewind that loses/repeats tokens.
    """
    sizes = [3, 3, 3, 5, 5, 1, 3, 3, 7, 7, 7]
    want = batches_and_states(TokenLoader(tiny_tokenizer, files, 3, 20, "cpu", 1, 2, tokenizer_batch_docs=4,
                                          prefetch=0), sizes)
    loader = TokenLoader(tiny_tokenizer, files, 3, 20, "cpu", 1, 2, tokenizer_batch_docs=4, prefetch=depth)
    got = batches_and_states(loader, sizes)
    assert loader._thread is not None  # the thread did run
    assert_same(got, want)
    assert want[2][2]["offset"] > 0 or want[3][2]["offset"] > 0  # mid-document positions are among the checked ones


def test_prefetch_state_resumes_exactly(tiny_tokenizer, files):
    """
    A state taken from a prefetching loader (whose thread has already produced the next batch) resumes at the next
    batch the caller had not received. Catches: recording the producer's position instead of the caller's.
    """
    a = TokenLoader(tiny_tokenizer, files, 4, 32, "cpu", prefetch=2)
    assert TokenLoader(tiny_tokenizer, files, 4, 32, "cpu").prefetch == 0  # the default on CPU (see the module doc)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    nxt = a.next_batch()
    b = TokenLoader(tiny_tokenizer, files, 4, 32, "cpu", prefetch=0)
    b.load_state_dict(state)
    assert all(torch.equal(u, v) for u, v in zip(b.next_batch(), nxt))
    a.load_state_dict(state)  # also while its thread runs: the queued batches are dropped
    assert all(torch.equal(u, v) for u, v in zip(a.next_batch(), nxt))


def test_prefetch_end_of_data_and_epochs(tiny_tokenizer, files):
    """
    A non-looping prefetching loader yields the same batches, then StopIteration at the same call, with the same
    final state; a looping one crosses the epoch boundary with the same states. Catches: the thread swallowing
    StopIteration (a hang), or dropping the last full batch.
    """
    n = len(list(TokenLoader(tiny_tokenizer, files, 4, 64, "cpu", loop=False, prefetch=0)))
    sizes = [4] * (n + 2)
    for loop in (False, True):
        want = batches_and_states(TokenLoader(tiny_tokenizer, files, 4, 64, "cpu", loop=loop, prefetch=0), sizes)
        got = batches_and_states(TokenLoader(tiny_tokenizer, files, 4, 64, "cpu", loop=loop, prefetch=1), sizes)
        assert_same(got, want)
        assert (want[-1] is None) == (not loop)
    assert want[-1][2]["epoch"] == 1


def test_abandoned_loader_thread_exits(tiny_tokenizer, files):
    """
    A loader that is dropped (base_train makes a new validation loader per evaluation) is garbage collected and its
    thread ends. Catches: the thread holding a strong reference to the loader (one leaked thread per evaluation).
    """
    loader = TokenLoader(tiny_tokenizer, files, 2, 16, "cpu", prefetch=1)
    loader.next_batch()
    loader.next_batch()
    thread = loader._thread
    assert thread is not None and thread.is_alive()
    del loader
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_token_stream_resume_exact():
    """The mid-training stream restored from state_dict() after 3 batches yields exactly the batches of an
    uninterrupted stream, across an epoch boundary, and every epoch covers all tokens once. Catches a resume at a
    conversation start (losing the offset inside a conversation) or a restart of the epoch."""
    g = random.Random(0)
    convs = [[g.randrange(100) for _ in range(g.randint(3, 30))] for _ in range(12)]
    total = sum(len(c) for c in convs)
    a = ConversationTokenStream(convs, batch_size=2, max_seq_len=15, seed=1)
    assert a.tokens_per_epoch == total
    straight = [a.next_batch() for _ in range(12)]
    b = ConversationTokenStream(convs, batch_size=2, max_seq_len=15, seed=1)
    for _ in range(3):
        b.next_batch()
    c = ConversationTokenStream(convs, batch_size=2, max_seq_len=15, seed=1)
    c.load_state_dict(b.state_dict())
    for i in range(3, 12):
        x, y = c.next_batch()
        assert torch.equal(x, straight[i][0]) and torch.equal(y, straight[i][1])
    epoch0 = torch.cat([torch.cat([x, y[:, -1:]], 1).flatten() for x, y in straight])[:total]
    assert sorted(epoch0.tolist()) == sorted(t for c_ in convs for t in c_)


# ---------------------------------------------------------------------------- best-fit rows (best_fit, bos_aligned)

def rows_of(loader, n):
    """The next n rows of `loader` (one per call) as lists of max_seq_len + 1 tokens."""
    out = []
    for _ in range(n):
        x, y = loader.next_batch(1)
        out.append(torch.cat([x, y[:, -1:]], 1)[0].tolist())
    return out


def test_bos_aligned_rows_by_hand(byte_tokenizer, four_docs):
    """
    four_docs (A = BOS abcd, E = BOS ef, G = BOS ghijkl, M = BOS m: 5, 3, 7, 2 tokens) in rows of 7, a buffer of 2
    documents read one at a time, looping: the rows worked out by hand from the rules (a document at least a row long
    heads the row; else the largest one that fits, the oldest of equal length; when none fits, the shortest is
    cropped and its rest dropped):
      1. buffer A E: A fits (5); space 2, buffer E G: none fits, E (shortest) cropped to BOS e;
      2. buffer G M: G is a row long, it heads the row;
      3. buffer M A (epoch 1): A is the largest that fits; space 2, buffer M E: M fits exactly;
      4. buffer E G: G;
      5. buffer E M: E; space 4, buffer M A (epoch 2): M; space 2, buffer A E: none fits, E (shorter than A) cropped.
    Catches: first fit instead of best fit (row 3 would be M + A), cropping the oldest document instead of the
    shortest (row 5 would end with BOS a), keeping a cropped document's rest (row 2 would start with f, not BOS).
    """
    loader = TokenLoader(byte_tokenizer, four_docs, 1, 6, "cpu", tokenizer_batch_docs=1, num_threads=1,
                         row_packing="bos_aligned", buffer_docs=2)
    assert rows_of(loader, 5) == [
        [256, 97, 98, 99, 100, 256, 101],
        [256, 103, 104, 105, 106, 107, 108],
        [256, 97, 98, 99, 100, 256, 109],
        [256, 103, 104, 105, 106, 107, 108],
        [256, 101, 102, 256, 109, 256, 101],
    ]
    assert loader.epoch == 2


def test_best_fit_rows_by_hand(byte_tokenizer, four_docs):
    """
    The same documents and settings as the BOS-aligned case above, with "best_fit": a cut-off part goes back into
    the buffer (written e: the f of E) and can be placed later. Worked out by hand:
      1. buffer A E: A; space 2, buffer E G: none fits, E cut to BOS e, its f back in: buffer G f;
      2. G heads the row (a row long); buffer f M;
      3. M is the largest that fits (2); space 5, buffer f A (epoch 1): A fits exactly;
      4. buffer f E: E; space 4, buffer f G: f; space 3, buffer G M: M; space 1, buffer G A (epoch 2): none
         fits, A (shorter than G) cut to its BOS, abcd back in;
      5. buffer G abcd: G.
    Catches the cut-off part dropped (row 4 would not hold the f, as in "bos_aligned"), and a rest put back at the
    front of the buffer (the oldest place: row 3 would start with f).
    """
    loader = TokenLoader(byte_tokenizer, four_docs, 1, 6, "cpu", tokenizer_batch_docs=1, num_threads=1,
                         row_packing="best_fit", buffer_docs=2)
    assert rows_of(loader, 5) == [
        [256, 97, 98, 99, 100, 256, 101],
        [256, 103, 104, 105, 106, 107, 108],
        [256, 109, 256, 97, 98, 99, 100],
        [256, 101, 102, 102, 256, 109, 256],
        [256, 103, 104, 105, 106, 107, 108],
    ]


def test_best_fit_loses_no_token_of_an_epoch(byte_tokenizer, tmp_path):
    """
    200 seeded random documents of 1 to 120 letters (many longer than the rows of 33) through a non-looping
    "best_fit" loader: the rows hold every token of the epoch exactly once (as a multiset) except fewer than one
    row's worth at the very end, and more rows start at a BOS than the contiguous rows' share. Catches a cut-off part
    dropped or placed twice, and "bos_aligned"'s loss (about a third of these tokens).
    """
    g = random.Random(1)
    texts = ["".join(g.choice("abcdefgh") for _ in range(g.randint(1, 120))) for _ in range(200)]
    path = tmp_path / "random.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    want = collections.Counter(tok for t in texts for tok in [256] + [ord(c) for c in t])
    for packing in ("best_fit", "bos_aligned"):
        rows = drain(TokenLoader(byte_tokenizer, [str(path)], 4, 32, "cpu", loop=False, num_threads=1,
                                 row_packing=packing, buffer_docs=16)).reshape(-1, 33)
        got = collections.Counter(rows.reshape(-1).tolist())
        missing = sum((want - got).values())
        assert not got - want  # nothing placed twice, nothing made up
        if packing == "best_fit":
            assert missing < 4 * 33, missing  # at most the last, unfinished batch of 4 rows
            assert (rows[:, 0] == 256).mean() > 0.3
        else:
            assert missing > sum(want.values()) / 4, missing


def test_bos_aligned_long_document_heads_its_row(byte_tokenizer, tmp_path):
    """
    Documents BOS a, BOS bcdefghi, BOS j (2, 9, 2 tokens) in rows of 5: the long one heads the only full row and
    loses just its 4 tokens beyond it; the short ones (4 tokens together) cannot fill a second row of a non-looping
    loader. Catches: best fit only (nanochat's rule fills the row with BOS a, BOS j and then crops the long document
    to its BOS: [256, 97, 256, 106, 256]).
    """
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a", "bcdefghi", "j"]))
    loader = TokenLoader(byte_tokenizer, [str(path)], 1, 4, "cpu", loop=False, num_threads=1,
                         row_packing="bos_aligned", buffer_docs=3)
    assert drain(loader).tolist() == [256, 98, 99, 100, 101]
    # "best_fit" keeps the long document's rest bcde -> fghi (4 tokens) and fills its row with a cut BOS a
    loader = TokenLoader(byte_tokenizer, [str(path)], 1, 4, "cpu", loop=False, num_threads=1,
                         row_packing="best_fit", buffer_docs=3)
    assert drain(loader).tolist() == [256, 98, 99, 100, 101, 102, 103, 104, 105, 256]


def test_bos_aligned_rows_start_with_bos_and_hold_documents_from_their_start(byte_tokenizer, tmp_path):
    """
    200 seeded random documents of 1 to 40 letters in rows of 33: every row starts with BOS, every piece between two
    BOS tokens is the beginning of a document (checked against the documents themselves), and rows hold several
    documents. Catches: rows cut from the token stream (mid-document starts), a cropped document's rest used later
    (a piece that is no document's beginning).
    """
    g = random.Random(0)
    texts = ["".join(g.choice("abcdefgh") for _ in range(g.randint(1, 40))) for _ in range(200)]
    path = tmp_path / "random.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    docs = [[256] + [ord(c) for c in t] for t in texts]
    loader = TokenLoader(byte_tokenizer, [str(path)], 4, 32, "cpu", num_threads=1, row_packing="bos_aligned",
                         buffer_docs=16)
    pieces = rows = 0
    for _ in range(40):
        x, y = loader.next_batch()
        for row in torch.cat([x, y[:, -1:]], 1).tolist():
            assert row[0] == 256
            cuts = [i for i, t in enumerate(row) if t == 256] + [len(row)]
            for a, b in zip(cuts, cuts[1:]):
                assert any(d[:b - a] == row[a:b] for d in docs), row[a:b]
            pieces, rows = pieces + len(cuts) - 1, rows + 1
    assert pieces > 1.3 * rows


def same_state(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                        for k in a)


@pytest.mark.parametrize("packing", ["best_fit", "bos_aligned"])
@pytest.mark.parametrize("k", [0, 3, "epoch"])
def test_best_fit_exact_resume_and_batch_size(tiny_tokenizer, files, k, packing):
    """
    A best-fit loader restored from state_dict() after k batches ("epoch": until epoch 1 has begun, then 2 more, so
    the buffer holds pieces of two epochs) yields exactly the rows of the uninterrupted one, also with another batch size, and its
    state survives a save and load through torch.save (the checkpoint's rank file, weights_only). Catches: a state
    without the buffered documents (a resumed loader would refill and pack other rows), or n rows at once differing
    from n calls of one row.
    """
    a = TokenLoader(tiny_tokenizer, files, 3, 20, "cpu", 1, 2, row_packing=packing, buffer_docs=8)
    for _ in range(k if k != "epoch" else 2):
        a.next_batch()
    while k == "epoch" and a.epoch == 0:
        a.next_batch()
    state = a.state_dict()
    rest = torch.cat([torch.cat([x, y[:, -1:]], 1) for x, y in (a.next_batch() for _ in range(6))])
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    b = TokenLoader(tiny_tokenizer, files, 9, 20, "cpu", 1, 2, row_packing=packing, buffer_docs=8)
    b.load_state_dict(torch.load(buf, weights_only=True))
    x, y = b.next_batch()
    assert torch.equal(torch.cat([x, y[:, -1:]], 1), rest[:9])
    assert state["buffer_tokens"].dtype == torch.int32 and (len(state["buffer_docs"]) > 0) == (k != 0)
    if k == "epoch":
        assert state["epoch"] == 1


@pytest.mark.parametrize("packing", ["best_fit", "bos_aligned"])
def test_best_fit_prefetch_same_rows_and_states(tiny_tokenizer, files, packing):
    """
    With the background thread the best-fit rows and the state after each batch are those of the synchronous
    loader, through batch size changes (each rewinds to the caller's state). Catches: the state after a batch taken
    from the thread's read-ahead buffer, or a rewind that loads the thread's private state form.
    """
    sizes = [3, 3, 5, 5, 1, 3, 7, 7]
    want = batches_and_states(TokenLoader(tiny_tokenizer, files, 3, 20, "cpu", row_packing=packing, buffer_docs=8,
                                          prefetch=0), sizes)
    loader = TokenLoader(tiny_tokenizer, files, 3, 20, "cpu", row_packing=packing, buffer_docs=8, prefetch=2)
    got = batches_and_states(loader, sizes)
    assert loader._thread is not None
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) and same_state(g[2], w[2])


def test_best_fit_piece_exactly_a_row_long_heads_the_row_before_a_longer_one(byte_tokenizer, tmp_path):
    """
    Documents BOS abc, BOS defgh (4 and 6 tokens) in rows of 4, a buffer of 2: both are at least a row long, so the
    oldest, BOS abc, heads the first row whole; BOS defgh is cut to BOS def and its rest gh (2 tokens) cannot fill a
    third row of a non-looping loader. Catches "longer than a row" in place of "at least a row long" (the piece of
    exactly a row's length is then only the largest that fits: BOS defgh heads the first row and BOS abc follows).
    """
    path = tmp_path / "exact.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["abc", "defgh"]))
    loader = TokenLoader(byte_tokenizer, [str(path)], 1, 3, "cpu", loop=False, num_threads=1,
                         row_packing="best_fit", buffer_docs=2)
    assert drain(loader).tolist() == [256, 97, 98, 99, 256, 100, 101, 102]


def test_best_fit_state_of_the_other_packing_is_refused(byte_tokenizer, four_docs):
    """A state of contiguous rows given to a best-fit loader, and the reverse, is one UserError naming --row_packing
    (not a KeyError, not rows from a misread position); an unknown row_packing and buffer_docs < 1 are refused, with
    the whole line pinned; a buffer of 1 is accepted (catches the bound written as <= 1 or < 2)."""
    plain = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1)
    fitted = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1, row_packing="best_fit")
    fitted.next_batch()
    with pytest.raises(UserError) as e:
        plain.load_state_dict(fitted.state_dict())
    assert str(e.value) == ("loader state of best-fit rows, but this run packs --row_packing=contiguous; resume with "
                            "the --row_packing of the checkpoint")
    with pytest.raises(UserError) as e:
        fitted.load_state_dict(plain.state_dict())
    assert str(e.value) == ("loader state of contiguous rows, but this run packs --row_packing=best_fit; resume with "
                            "the --row_packing of the checkpoint")
    with pytest.raises(ValueError, match="buffer_docs=0"):
        TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", row_packing="best_fit", buffer_docs=0)
    with pytest.raises(ValueError) as e:
        TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", row_packing="bestfit")
    assert str(e.value) == "row_packing='bestfit': expected one of contiguous, best_fit, bos_aligned"
    # a buffer of one piece is the smallest allowed: the rows take the pieces in reading order
    one = TokenLoader(byte_tokenizer, four_docs, 1, 6, "cpu", tokenizer_batch_docs=1, num_threads=1,
                      row_packing="best_fit", buffer_docs=1)
    assert rows_of(one, 2) == [[256, 97, 98, 99, 100, 256, 101], [102, 256, 103, 104, 105, 106, 107]]


# ---------------------------------------------------------------------------- errors, devices, threads (literal cases)

def test_loader_errors_name_the_rank_and_the_state(byte_tokenizer, four_docs):
    """
    Rank 4 of 5 over 4 documents gets none: one UserError naming the rank and the file; a state whose document does
    not exist stops with one naming the state; states at a rank's last document and at the very end of an epoch
    resume into the next epoch (literal rows). Catches an endless loop over empty epochs (a hang), a resume that
    silently starts elsewhere, and a resume at the epoch's end taken for a rank without documents.
    """
    from nanotrain.errors import UserError
    with pytest.raises(UserError, match=r"rank 4 of 5 got no document from \[.*docs.jsonl'\]: the data split is too "
                                        r"small for this many ranks"):
        TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", rank=4, world_size=5, num_threads=1).next_batch()
    loader = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1)
    with pytest.raises(UserError, match=r"loader state \{'epoch': 0, 'doc_index': 7, 'offset': 2\} does not match "
                                        r"the data files"):
        loader.load_state_dict({"epoch": 0, "doc_index": 7, "offset": 2})
    resumed = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", rank=1, world_size=2, num_threads=1)
    resumed.load_state_dict({"epoch": 0, "doc_index": 3, "offset": 0})  # rank 1's last document, then a new epoch
    assert [resumed.next_batch()[0].tolist() for _ in range(2)] == [[[256, 109, 256]], [[102, 256, 109]]]
    at_end = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1)
    at_end.load_state_dict({"epoch": 0, "doc_index": 4, "offset": 0})  # saved at the very end of epoch 0
    assert at_end.next_batch()[0].tolist() == [[256, 97, 98]] and at_end.state_dict()["epoch"] == 1
    one_doc = four_docs[0].replace("docs.jsonl", "one.jsonl")
    open(one_doc, "w").write('{"text": "abc"}\n')
    at_end = TokenLoader(byte_tokenizer, [one_doc], 1, 3, "cpu", num_threads=1)
    at_end.load_state_dict({"epoch": 0, "doc_index": 1, "offset": 0})  # the end of a one-document epoch
    assert at_end.next_batch()[0].tolist() == [[256, 97, 98]] and at_end.state_dict()["epoch"] == 1
    resumed = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", rank=4, world_size=5, num_threads=1)
    resumed.load_state_dict({"epoch": 0, "doc_index": 0, "offset": 0})
    with pytest.raises(UserError, match="rank 4 of 5 got no document"):  # also after a resume: no endless epochs
        resumed.next_batch()


def test_no_document_message_lists_at_most_three_files(byte_tokenizer, tmp_path):
    """The no-document error names the first three files and marks more with ' ...'. Catches a message that lists
    every file (thousands of shards) or hides that there are more."""
    from nanotrain.errors import UserError
    files = []
    for i in range(4):
        files.append(str(tmp_path / f"f{i}.jsonl"))
        open(files[-1], "w").write('{"text": "ab"}\n')
    for n, tail in ((3, r"f2.jsonl'\]: the data"), (4, r"f2.jsonl'\] \.\.\.: the data")):
        with pytest.raises(UserError, match=tail):
            TokenLoader(byte_tokenizer, files[:n], 1, 3, "cpu", rank=4, world_size=5, num_threads=1).next_batch()


def test_epochs_count_up_and_the_thread_is_a_named_daemon(byte_tokenizer, four_docs):
    """
    After 9 rows of 4 tokens over 17-token epochs the state is (epoch 2, document 0, offset 2): 36 = 2 x 17 + 2.
    The prefetch thread is a daemon named TokenLoader-prefetch, and prefetch=0 starts none. Catches an epoch counter
    stuck at 1, a non-daemon thread that keeps the interpreter from exiting, a thread with an unbounded queue, and one
    that gives up while its queue is full (the next batch would never come).
    """
    loader = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1, prefetch=1)
    for _ in range(9):
        loader.next_batch()
    assert loader.state_dict() == {"epoch": 2, "doc_index": 0, "offset": 2}
    assert loader._thread.daemon and loader._thread.name == "TokenLoader-prefetch"
    loader.close()
    slow = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1, prefetch=1)
    rows = [slow.next_batch()[0].tolist()]
    time.sleep(0.5)  # a slow training step: the thread waits on its full queue (timeouts of 0.1 s) and stays alive
    assert slow._thread.is_alive()
    rows += [slow.next_batch()[0].tolist() for _ in range(2)]
    assert rows == [[[256, 97, 98]], [[100, 256, 101]], [[256, 103, 104]]]
    slow.close()
    sync = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1, prefetch=0)
    sync.next_batch()
    assert sync._thread is None  # prefetch=0: no thread (a queue of size 0 would be unbounded)


def test_batches_land_on_the_device(byte_tokenizer, four_docs):
    """Both loaders move their batches to `device` (meta stands in for an accelerator, which the CPU suite lacks).
    Catches a device argument that is dropped."""
    x, y = TokenLoader(byte_tokenizer, four_docs, 2, 3, "meta", num_threads=1).next_batch()
    assert x.device.type == y.device.type == "meta" and x.shape == (2, 3)
    x, y = ConversationTokenStream([[1, 2, 3]], 1, 2, device="meta").next_batch()
    assert x.device.type == y.device.type == "meta"


def test_close_and_exit_stop_the_thread_and_keep_the_position(byte_tokenizer, four_docs):
    """
    close() (and the interpreter-exit hook) stop the prefetch thread; the loader then continues exactly where the
    caller was, not where the thread had read to. Catches a thread left running at exit (an abort in finalisation)
    and a close that loses the batches the thread produced ahead.
    """
    from nanotrain import dataloader
    sync = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1)
    want = [sync.next_batch()[0].tolist() for _ in range(4)]
    loader = TokenLoader(byte_tokenizer, four_docs, 1, 3, "cpu", num_threads=1, prefetch=2)
    got = [loader.next_batch()[0].tolist() for _ in range(2)]
    thread = loader._thread
    loader.close()
    assert loader._thread is None and not thread.is_alive()
    got += [loader.next_batch()[0].tolist()]
    dataloader._stop_prefetch_threads()
    assert not loader._thread.is_alive()
    loader._thread = None  # its stop event is set: a new thread starts on demand (as close() leaves it)
    loader.load_state_dict(loader._state)
    got += [loader.next_batch()[0].tolist()]
    assert got == want


def test_conversation_stream_seed_shuffle_and_errors():
    """The seed and shuffle settings reach the order (shuffle=False: the given order, the default shuffles), and a
    stream without tokens is refused. Catches the seed or shuffle argument dropped."""
    convs = [[i] for i in range(30)]
    first = lambda **kw: ConversationTokenStream(convs, 1, 29, **kw).next_batch()[0].flatten().tolist()
    assert first(shuffle=False) == list(range(29))
    assert first(seed=1) != first(seed=2) and first() != list(range(29))
    with pytest.raises(ValueError, match="^ConversationTokenStream: no tokens$"):
        ConversationTokenStream([[], []], 1, 2)
