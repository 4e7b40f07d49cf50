"""
nanotrain/serve/batch_engine.py on a real tiny model: requests arriving at different times, decoded together with
continuous batching, each get the greedy tokens nanotrain.engine.Engine gives them alone; the queue is bounded; a
cancelled request frees its row.
"""

import time

import pytest
import torch
from helpers import tiny_model

from nanotrain.engine import Engine
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.serve.batch_engine import BatchEngine, QueueFull
from nanotrain.serve.request import GenerationRequest as Gen

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
        reqs.append(batch.submit(Gen(p, 4 + i)))
        time.sleep(spacing)
    got = [list(r) for r in reqs]
    assert got == want and vocab == 64
    assert [r.finish_reason for r in reqs] == ["length" if len(w) == 4 + i else "stop" for i, w in enumerate(want)]


def test_the_queue_is_bounded_and_cancel_frees_the_row():
    """One row, one waiting place (150 tokens of a 2-layer model: long enough): a third request is refused with QueueFull; cancelling the decoding one frees its
    row, the waiting one then runs to its end. Catches an unbounded queue and a cancelled row that decodes on."""
    batch = BatchEngine(model(), Tok(), max_batch=1, max_queue=1, context_len=160)
    first = batch.submit(Gen([1, 2, 3], 150))
    time.sleep(0.2)  # the first holds the row
    second = batch.submit(Gen([4, 5], 3))
    with pytest.raises(QueueFull):
        batch.submit(Gen([6], 3))
    first.cancel()
    assert len(list(first)) < 150
    assert len(list(second)) <= 3 and batch.active() == 0


def solo(m, prompt, n, **kw):
    """Engine.generate of one prompt alone (greedy unless kw says): the tokens a batched request must get."""
    return Engine(m, Tok()).generate([prompt], n, **kw)[0]


def test_a_tiny_temperature_is_greedy_and_breaks_no_one():
    """
    Temperature 1e-300 (and 1e-9) beside greedy requests in one decode batch: every request gets its solo greedy
    tokens and nothing raises. Catches sampling that divides the logits by the temperature as it is (1e-300 is 0 in
    fp32: inf / NaN, and multinomial raises inside the shared decode step, failing every request of the batch).
    """
    m = model()
    prompts = [[(3 * i + j) % 58 for j in range(4 + i)] for i in range(4)]
    batch = BatchEngine(m, Tok(), max_batch=4, max_queue=4, context_len=32)
    reqs = [batch.submit(Gen(p, 10, temperature=t, seed=i)) for i, (p, t) in
            enumerate(zip(prompts, [0.0, 1e-300, 1e-9, 0.0]))]
    assert [list(r) for r in reqs] == [solo(m, p, 10) for p in prompts]


def test_a_failing_request_fails_alone():
    """
    Two requests that fail inside the engine, one when admitted (a seed torch.Generator refuses: 2**64) and one when
    sampled (top_k 2.5: torch.topk refuses a float), share the batch with three good ones: each failing request
    raises in its reader, the good ones get exactly their solo greedy tokens, and the engine serves a request after.
    Catches an engine that hands one request's exception to every request of the step (and resets their rows).
    """
    m = model()
    prompts = [[(5 * i + j) % 58 for j in range(3 + i)] for i in range(5)]
    batch = BatchEngine(m, Tok(), max_batch=5, max_queue=5, context_len=32)
    gens = [Gen(prompts[0], 12), Gen(prompts[1], 12, seed=2**64), Gen(prompts[2], 12),
            Gen(prompts[3], 12, temperature=1.0, top_k=2.5), Gen(prompts[4], 12)]
    reqs = [batch.submit(g) for g in gens]
    for i in (1, 3):
        with pytest.raises((RuntimeError, TypeError, ValueError, OverflowError)):
            list(reqs[i])
    for i in (0, 2, 4):
        assert list(reqs[i]) == solo(m, prompts[i], 12), i
    assert list(batch.submit(Gen(prompts[0], 5))) == solo(m, prompts[0], 5)


def test_ignore_eos_decodes_max_tokens():
    """
    A request with ignore_eos whose greedy reply would stop early (the model's argmax made the stop token by
    choosing Tok's assistant_end as the first greedy token's id) gets exactly max_tokens tokens, equal to
    Engine.generate(ignore_eos=True); without it, the request stops. Catches an engine that ignores the flag.
    """
    m = model()
    prompt = [1, 2, 3]
    first = solo(m, prompt, 1, ignore_eos=True)[0]

    class StopTok(Tok):  # the prompt's first greedy token is the stop token
        def encode_special(self, name):
            return first if name == "<|assistant_end|>" else super().encode_special(name)
    batch = BatchEngine(m, StopTok(), max_batch=2, max_queue=2, context_len=32)
    want = Engine(m, StopTok()).generate([prompt], 9, ignore_eos=True)[0]
    assert len(want) == 9 and want[0] == first
    assert list(batch.submit(Gen(prompt, 9, ignore_eos=True))) == want
    assert list(batch.submit(Gen(prompt, 9))) == []


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps():
    """
    Eight streams decoding, then a 200-token prompt arrives (prefill_chunk 64): every model forward is recorded (a
    forward pre-hook on the real model); from its arrival on, between two decode steps the prompt tokens prefilled
    are at most 64 (one chunk), the streams decode on while the long prompt's chunks go in (at least 3 decode steps
    from its arrival to its first token), and every request, the long one included, gets its solo greedy tokens. Counts forwards, not
    seconds: robust on a loaded machine. Catches a long prompt prefilled whole between two decode steps (the
    streams wait for all of it), and chunks whose keys or positions are wrong (the long reply differs).
    """
    torch.manual_seed(0)
    m = GPT(GPTConfig(max_seq_len=256, vocab_size=64, n_layer=2, n_head=2, n_kv_head=2, model_dim=32))
    m.init_weights()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "c_proj" in name or "lm_head" in name:
                p.normal_(0, 0.05)
    m.eval()
    class NoStop(Tok):  # every request runs its max_tokens
        def encode_special(self, name):
            return 1000

        def get_bos_token_id(self):
            return 1001
    calls = []
    m.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(tuple(args[0].shape)), with_kwargs=True)
    prompts = [[(7 * i + j) % 58 for j in range(3 + i)] for i in range(8)]
    long_prompt = [(11 * j + 5) % 58 for j in range(200)]
    want = [Engine(m, NoStop()).generate([p], n)[0] for p, n in zip(prompts + [long_prompt], [40] * 8 + [8])]
    calls.clear()
    batch = BatchEngine(m, NoStop(), max_batch=9, max_queue=9, context_len=256, prefill_chunk=64)
    reqs = [batch.submit(Gen(p, 40)) for p in prompts]
    its = [iter(r) for r in reqs]
    firsts = [next(it) for it in its]  # every stream has its first token: all eight decode
    arrived = len(calls)
    reqs.append(batch.submit(Gen(long_prompt, 8)))
    got = [[first] + list(it) for first, it in zip(firsts, its)]
    assert got == want[:8] and list(reqs[-1]) == want[8]
    prefilled, worst = 0, 0
    for B, T in calls[arrived:]:
        if T == 1:
            worst, prefilled = max(worst, prefilled), 0
        else:
            prefilled += B * T
    assert max(worst, prefilled) <= 64, calls
    chunks = [i for i, (B, T) in enumerate(calls) if i >= arrived and (B, T) in ((1, 64), (1, 8))]
    assert len(chunks) == 4 and sum(T == 1 for _, T in calls[chunks[0]:chunks[-1]]) >= 3, calls[arrived:]


@pytest.mark.parametrize("smear", [False, True])
def test_the_static_decode_step_equals_solo_greedy(smear):
    """
    The decode step that CUDA graphs capture (nanotrain.serve.decode: every row over every key slot, each row masked
    to its own tokens, keys written at each row's own slot) run eagerly on the CPU: staggered requests still get
    their solo greedy tokens, smear's embedding kept per row. Catches a static step that writes a key at the wrong
    slot, attends past a row's length, advances a free row's length, or loses smear's embedding.
    """
    from nanotrain.serve.decode import compiled_decode
    m, tok = model(smear), Tok()
    prompts = [[(7 * i + j) % 58 for j in range(3 + i)] for i in range(6)]
    want = [Engine(m, tok).generate([p], 4 + i)[0] for i, p in enumerate(prompts)]
    batch = BatchEngine(m, tok, max_batch=3, max_queue=9, context_len=32)
    batch.decode = compiled_decode(m, 3, compile=False)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(batch.submit(Gen(p, 4 + i)))
        time.sleep(0.003)
    assert [list(r) for r in reqs] == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_decode_step_on_cuda():
    """
    On CUDA the decode step through torch.compile(mode="reduce-overhead") (CUDA graphs): staggered requests get
    their solo greedy tokens (fp32), and the engine did not fall back to the eager step (a compile that fails
    prints a warning and decodes eagerly). Catches a compiled step that fails to capture or replays stale inputs.
    """
    m, tok = model(True).cuda(), Tok()
    prompts = [[(7 * i + j) % 58 for j in range(3 + i)] for i in range(6)]
    want = [Engine(m, tok).generate([p], 4 + i)[0] for i, p in enumerate(prompts)]
    batch = BatchEngine(m, tok, max_batch=3, max_queue=9, context_len=32, compile=True)
    reqs = []
    for i, p in enumerate(prompts):
        reqs.append(batch.submit(Gen(p, 4 + i)))
        time.sleep(0.003)
    assert [list(r) for r in reqs] == want and batch.decode is not None
