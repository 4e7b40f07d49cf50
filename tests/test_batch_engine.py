"""
nanotrain/batch_engine.py on a real tiny model: requests arriving at different times, decoded together with
continuous batching, each get the greedy tokens nanotrain.engine.Engine gives them alone; the queue is bounded; a
cancelled request frees its row.
"""

import time

import pytest
import torch
from helpers import tiny_model

from nanotrain.batch_engine import BatchEngine, QueueFull
from nanotrain.engine import Engine
from nanotrain.gpt import GPT, GPTConfig

pytestmark = pytest.mark.unit


class Tok:
    """The two special tokens the engines look up, on a 64-token vocabulary (no tool)."""

    def encode_special(self, name):
        return {"<|assistant_end|>": 62, "<|python_start|>": 60, "<|python_end|>": 61, "<|output_start|>": 58,
                "<|output_end|>": 59}[name]

    def get_bos_token_id(self):
        return 63


def model(smear=False):
    torch.manual_seed(0)
    m = tiny_model()
    if smear:  # the same weights plus smear's gate (its cache keeps the last fed token's embedding)
        c = m.config
        m2 = GPT(GPTConfig(**{**c.__dict__, "smear": True}))
        m2.init_weights()
        m2.load_state_dict(m.state_dict(), strict=False)
        with torch.no_grad():
            m2.smear_lambda.fill_(0.5)
            m2.smear_gate.weight.normal_(0, 0.5)
        m = m2
    m.eval()
    return m


@pytest.mark.parametrize("spacing,smear", [(0.005, False), (0.0, False), (0.0, True)])
def test_staggered_requests_equal_their_solo_greedy_tokens(spacing, smear):
    """
    Nine prompts of lengths 3-11 submitted `spacing` s apart into 3 rows with max_tokens 4-12: every request's tokens
    equal Engine.generate of that prompt alone, and finish_reason is "length" exactly when it got max_tokens. At
    spacing 0 several requests join in one step (one right-padded prefill); rows end
    out of order, so busy rows move down into freed ones. Catches a joining row prefilled at another row's position,
    a padded row's length or logits taken at the pad, a pad that is not the row's last token (smear keeps the last fed token's embedding), a moved row's keys or
    length not moved with it, a free row's stale keys attended to, and a token emitted twice when a row joins.
    """
    m, tok = model(smear), Tok()
    vocab = m.config.vocab_size
    prompts = [[(7 * i + j) % 58 for j in range(3 + i)] for i in range(9)]
    want = [Engine(m, tok).generate([p], 4 + i)[0] for i, p in enumerate(prompts)]
    batch = BatchEngine(m, tok, max_batch=3, max_queue=9, context_len=32)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(batch.submit(p, 4 + i))
        time.sleep(spacing)
    got = [list(r) for r in reqs]
    assert got == want and vocab == 64
    assert [r.finish_reason for r in reqs] == ["length" if len(w) == 4 + i else "stop" for i, w in enumerate(want)]


def test_the_queue_is_bounded_and_cancel_frees_the_row():
    """One row, one waiting place (150 tokens of a 2-layer model: long enough): a third request is refused with QueueFull; cancelling the decoding one frees its
    row, the waiting one then runs to its end. Catches an unbounded queue and a cancelled row that decodes on."""
    batch = BatchEngine(model(), Tok(), max_batch=1, max_queue=1, context_len=160)
    first = batch.submit([1, 2, 3], 150)
    time.sleep(0.2)  # the first holds the row
    second = batch.submit([4, 5], 3)
    with pytest.raises(QueueFull):
        batch.submit([6], 3)
    first.cancel()
    assert len(list(first)) < 150
    assert len(list(second)) <= 3 and batch.active() == 0
