"""
Tests of nanotrain/engine.py with real tiny models: KV-cache generation equals a no-cache argmax loop, batching does
not mix rows, a batch of mixed-length prompts decodes exactly as each prompt alone (greedy, with and without the
tool; per-step logits), sampling is seeded, and generation stops at <|assistant_end|> / <|bos|> (on a model trained
in-test to emit them).
"""

import pytest
import torch

from nanotrain.engine import Engine
from nanotrain.errors import UserError
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.tokenizer import SPECIAL_TOKENS, Tokenizer

TEXT = ["hello there, how are you? ok fine. what is 2 + 3? it is 5."] * 20


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run several times faster on one thread (thread start-up dominates their ops)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_from_iterator(iter(TEXT), 256 + 9 + 30)


def random_model(tok, seed=0, n_layer=2):
    """A tiny GPT with all weights random (init_weights zeroes the output projections; here attention matters)."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(max_seq_len=32, vocab_size=tok.get_vocab_size(), n_layer=n_layer, n_head=2, n_kv_head=1,
                          model_dim=32))
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval()


@torch.no_grad()
def argmax_no_cache(model, prompt, max_tokens, stop_ids):
    """Reference: re-run the whole sequence every step (no KV cache), greedy, stop before a stop token."""
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        nxt = model(torch.tensor([seq]))[0, -1].argmax().item()
        if nxt in stop_ids:
            break
        seq.append(nxt)
        out.append(nxt)
    return out


def train_on(tok, rows, steps):
    """
    A 1-layer GPT (model_dim 64, 2 heads, 64 positions, seed 0) trained in-test with AdamW (lr 1e-2) for `steps`
    full-batch steps on `rows` (lists of token ids, right-padded with untrained 0s). Returns (the model in eval mode,
    the loss of the last step: a 0-dim tensor).
    """
    n = max(map(len, rows))
    data = torch.tensor([r + [0] * (n - len(r)) for r in rows])
    targets = torch.tensor([r[1:] + [-1] * (n - len(r) + 1) for r in rows])
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=64, vocab_size=tok.get_vocab_size(), n_layer=1, n_head=2, n_kv_head=2,
                          model_dim=64))
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = model(data, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), loss.detach()


def prompts_for(tok):
    bos = tok.get_bos_token_id()
    return [[bos, 5, 6], [bos] + tok.encode("hello there"), [bos] + tok.encode("what is 2"), [bos, 7, 8],
            [bos] + tok.encode("how are you? ok fine.")]


@pytest.mark.unit
def test_kv_cache_generation_equals_no_cache(tok):
    """
    Catches KV-cache bugs (wrong positions for rotary after the prefill, keys overwritten, the prefill not causal,
    GQA heads misaligned) and batching bugs (rows of the same length mixed up): every row's greedy completion must
    equal the no-cache argmax loop's, token for token.
    """
    model = random_model(tok)
    engine = Engine(model, tok)
    prompts = prompts_for(tok)
    stop = {tok.encode_special("<|assistant_end|>"), tok.get_bos_token_id()}
    expected = [argmax_no_cache(model, p, 40, stop) for p in prompts]
    assert engine.generate(prompts, max_tokens=40) == expected
    assert max(len(e) for e in expected) > 20  # long enough to exercise the decode steps
    assert [list(engine.generate_stream(p, max_tokens=40)) for p in prompts] == expected
    assert engine.generate(prompts, max_tokens=40, max_batch=1) == expected  # one prompt per cache
    assert engine.generate(prompts, max_tokens=0) == [[] for _ in prompts]


@pytest.mark.unit
def test_sampling_is_seeded_and_top_k_1_is_greedy(tok):
    """Catches an unseeded sampler, a top-k that keeps k+1 tokens, and a temperature applied the wrong way round."""
    model = random_model(tok, seed=1)
    engine = Engine(model, tok)
    prompts = prompts_for(tok)
    a = engine.generate(prompts, 30, temperature=1.0, seed=3)
    assert a == engine.generate(prompts, 30, temperature=1.0, seed=3)
    assert a != engine.generate(prompts, 30, temperature=1.0, seed=4)
    greedy = engine.generate(prompts, 30)
    assert engine.generate(prompts, 30, temperature=1.0, top_k=1, seed=5) == greedy
    assert engine.generate(prompts, 30, temperature=1e-4, seed=5) == greedy
    p = prompts[1]
    assert list(engine.generate_stream(p, 30, temperature=0.8, top_k=5, seed=9)) == \
        engine.generate([p], 30, temperature=0.8, top_k=5, seed=9)[0]


@pytest.mark.unit
def test_stops_at_assistant_end_and_bos(tok):
    """
    A model trained to answer "ok" then <|assistant_end|> (or <|bos|>) and then keep talking: the engine returns only
    "ok", and the no-stop continuation shows it really would have gone on. Catches ignoring a stop token, returning
    it, or stopping one token late.
    """
    s = {n: tok.encode_special(n) for n in SPECIAL_TOKENS}
    ok, more = tok.encode(" ok fine."), tok.encode(" what is 2 + 3? it is 5.")
    seq_a = [s["<|bos|>"], s["<|user_start|>"]] + tok.encode("hello") + [s["<|user_end|>"], s["<|assistant_start|>"]]
    seq_b = [s["<|bos|>"], s["<|user_start|>"]] + tok.encode("how are") + [s["<|user_end|>"], s["<|assistant_start|>"]]
    rows = [seq_a + ok + [s["<|assistant_end|>"]] + more, seq_b + ok + [s["<|bos|>"]] + more]
    model, loss = train_on(tok, rows, 80)
    assert loss.item() < 0.1  # the first user token is a coin flip between the rows: ~0.03 is the floor
    engine = Engine(model, tok)
    assert engine.generate([seq_a, seq_b], max_tokens=20) == [ok, ok]
    assert list(engine.generate_stream(seq_b, max_tokens=20)) == ok
    # without stopping, the model would go on past the stop token
    cont = list(engine.generate_stream(seq_a, max_tokens=len(ok) + 3, ignore_eos=True))
    assert cont[:len(ok) + 1] == ok + [s["<|assistant_end|>"]] and cont[len(ok) + 1:] == more[:2]


@pytest.mark.unit
def test_errors(tok):
    """Bad arguments raise UserError with the reason instead of an index error deep in the model."""
    engine = Engine(random_model(tok, n_layer=1), tok)
    with pytest.raises(UserError, match="empty"):
        engine.generate([[1, 2], []], 5)
    with pytest.raises(UserError, match="exceeds"):
        engine.generate([[1] * 300], 30)
    with pytest.raises(UserError, match="temperature"):
        list(engine.generate_stream([1], 5, temperature=-1.0))


# ----------------------------------------------------------------------------- load_model on damaged checkpoints

class Planted:
    """Unpickling it with weights_only=False would create the file `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def run(tok, tmp_path, monkeypatch):
    """A base dir with `tok` as its tokenizer and a base run "r" with checkpoints 1, 2, 3 of random_model(tok)."""
    from nanotrain.checkpoint import save_checkpoint
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    tok.save(str(tmp_path / "tokenizer"))
    models = {}
    for step in (1, 2, 3):
        models[step] = random_model(tok, seed=step, n_layer=1)
        save_checkpoint(str(tmp_path / "base" / "r"), step, models[step], [],
                        {"config": {}, "model_config": vars(models[step].config),
                         "tokenizer_sha256": tok.fingerprint()}, {})
    return tmp_path / "base" / "r" / "checkpoints", models


def truncate(file):
    with open(file, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)


@pytest.mark.unit
def test_load_model_falls_back_to_the_newest_readable_checkpoint(run, tmp_path, capsys):
    """
    Without a step, load_model skips the newest checkpoints that cannot be used (step 3's model.pt truncated, step
    2's a planted pickle) and loads step 1, printing one `warning:` line on stderr that names both bad files and the
    checkpoint loaded; the marker is never created. The old code raised torch's zip-reader RuntimeError.
    """
    from nanotrain.checkpoint import load_model
    ckpts, models = run
    truncate(ckpts / "step_000003" / "model.pt")
    torch.save(Planted(tmp_path / "marker"), ckpts / "step_000002" / "model.pt")
    model, _, path, meta = load_model("base", "r")
    assert path == str(ckpts / "step_000001") and meta["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), models[1].state_dict().values()))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: loaded the older checkpoint {ckpts / 'step_000001'}: "), err
    assert "step_000003/model.pt is not a plain tensor file: truncated, damaged" in err[0], err
    assert "step_000002/model.pt is not a plain tensor file" in err[0] and "system" in err[0], err
    assert not (tmp_path / "marker").exists()


@pytest.mark.unit
def test_load_model_refuses_in_one_line_when_nothing_or_the_requested_step_is_unreadable(run, tmp_path, capsys):
    """
    An unreadable checkpoint asked for by step is an error naming it even when another one is readable (never a
    silent substitute); with every checkpoint unreadable the error names the newest's bad file and counts the rest.
    Covered: a meta.json without "model_config" (the old code: KeyError: 'model_config'), model.pt saved as an empty
    dict (the old code: load_state_dict's missing-keys RuntimeError), a planted pickle (torch's advice in several
    paragraphs), random bytes. Each is one UserError line without a traceback's worth of text, and nothing is
    printed.
    """
    import json

    from nanotrain.checkpoint import load_model
    ckpts, _ = run
    meta_file = ckpts / "step_000002" / "meta.json"
    meta = json.load(open(meta_file))
    del meta["model_config"]
    json.dump(meta, open(meta_file, "w"))
    torch.save({}, ckpts / "step_000003" / "model.pt")

    def error(**kwargs):
        with pytest.raises(UserError) as info:
            load_model("base", "r", **kwargs)
        assert "\n" not in str(info.value) and "weights_only" not in str(info.value), str(info.value)
        return str(info.value)
    assert error(step=2) == (f"cannot read the checkpoint {ckpts / 'step_000002'}: meta.json lacks the key "
                             f"'model_config'")
    assert error(step=3) == (f"cannot read the checkpoint {ckpts / 'step_000003'}: model.pt holds an empty dict, "
                             f"not the model's weights (a state dict of tensors)")
    torch.save(Planted(tmp_path / "marker"), ckpts / "step_000001" / "model.pt")
    assert error(step=1).startswith(f"cannot read the checkpoint {ckpts / 'step_000001'}: model.pt is not a plain "
                                    f"tensor file: truncated, damaged, or holding arbitrary Python objects; refusing "
                                    f"to load it (UnpicklingError: ")
    assert error() == (f"cannot read the checkpoint {ckpts / 'step_000003'}: model.pt holds an empty dict, not the "
                       f"model's weights (a state dict of tensors) (and the 2 older checkpoints cannot be read either)")
    with open(ckpts / "step_000003" / "model.pt", "wb") as f:
        f.write(bytes(range(256)) * 8)
    assert "model.pt is not a plain tensor file: truncated, damaged" in error(step=3)
    assert capsys.readouterr().err == "" and not (tmp_path / "marker").exists()


@pytest.fixture(scope="module")
def tool_model(tok):
    """
    The tool tests' model: trained in-test (train_on, 100 steps) on two scripted replies that call the tool, with a
    WRONG tool output in its data (see the test below). Returns (s: special token name -> id, prompt_a, prompt_b,
    reply(expr, out) -> the scripted reply's ids, the model).
    """
    s = {n: tok.encode_special(n) for n in SPECIAL_TOKENS}
    head = [s["<|bos|>"], s["<|user_start|>"]]
    prompt_a = head + tok.encode("hello") + [s["<|user_end|>"], s["<|assistant_start|>"]]
    prompt_b = head + tok.encode("there") + [s["<|user_end|>"], s["<|assistant_start|>"]]
    prompt_a = prompt_a[:2] + [5] + prompt_a[2:]  # the same length as prompt_b: one batch, one KV cache

    def reply(expr, out):
        return (tok.encode(" it is ") + [s["<|python_start|>"]] + tok.encode(expr) + [s["<|python_end|>"],
                s["<|output_start|>"]] + tok.encode(out) + [s["<|output_end|>"]] + tok.encode(" ok"))
    rows = [prompt_a + reply("2 + 3", "7") + [s["<|assistant_end|>"]],
            prompt_b + reply("2 ** 3", "9") + [s["<|assistant_end|>"]]]
    model, _ = train_on(tok, rows, 100)
    return s, prompt_a, prompt_b, reply, model


@pytest.mark.unit
def test_the_tool_forces_the_calculator_output_with_mask_0(tok, tool_model):
    """
    A model trained in-test on two scripted replies that call the tool, with a WRONG tool output in its data:
      row a: " it is " <python_start> "2 + 3" <python_end> <output_start> "7" <output_end> " ok" <assistant_end>
      row b: the same with "2 ** 3" (the calculator refuses powers) and output "9".
    With tool=False both rows are the model's own greedy text (the no-cache argmax: "7" and "9"). With tool=True, in
    one batch: row a's "7" is replaced by the calculator's "5" right after <python_end>, those three tokens carry mask
    0 and every other token mask 1, and what follows is the model's own greedy continuation of the forced context
    (the KV cache was fed the forced tokens); row b is unchanged (a refused expression forces nothing).
    Catches forcing one token late or early, forcing into the wrong row, masks of 1 on forced tokens, a cache that
    still holds the sampled token, and a tool that changes generation when it has nothing to say.
    """
    s, prompt_a, prompt_b, reply, model = tool_model
    assert len(prompt_a) == len(prompt_b)
    engine = Engine(model, tok)
    stop = {s["<|assistant_end|>"], s["<|bos|>"]}
    # tool off: the model's own greedy text, the wrong outputs it was trained on
    off = engine.generate([prompt_a, prompt_b], max_tokens=30)
    assert off == [argmax_no_cache(model, p, 30, stop) for p in (prompt_a, prompt_b)]
    assert off == [reply("2 + 3", "7"), reply("2 ** 3", "9")]
    # tool on: row a forced to the calculator's "5", mask 0 on the three forced tokens; row b untouched
    (ids_a, mask_a), (ids_b, mask_b) = engine.sample([prompt_a, prompt_b], max_tokens=30, tool=True)
    k = len(tok.encode(" it is ")) + len(tok.encode("2 + 3")) + 2  # up to and including <python_end>
    forced = [s["<|output_start|>"]] + tok.encode("5") + [s["<|output_end|>"]]
    assert ids_a[:k] == off[0][:k] and ids_a[k:k + len(forced)] == forced
    assert mask_a == [1] * k + [0] * len(forced) + [1] * (len(ids_a) - k - len(forced))
    assert ids_a[k + len(forced):] == argmax_no_cache(model, prompt_a + ids_a[:k + len(forced)], 30 - k - len(forced),
                                                      set())[:len(ids_a) - k - len(forced)]
    assert ids_b == off[1] + [s["<|assistant_end|>"]] and mask_b == [1] * len(ids_b)
    assert list(engine.generate_stream(prompt_a, 30, tool=True)) == engine.generate([prompt_a], 30, tool=True)[0]
    assert engine.generate([prompt_a], 30, tool=True)[0] == [t for t in ids_a if t not in stop]


# ----------------------------------------------------------------------------- mixed-length batches

LENGTHS = (1, 3, 7, 12, 20)


def smear_model(tok, seed):
    """random_model with smear on (and value embeddings, GQA): every per-row path of the cache matters."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(max_seq_len=32, vocab_size=tok.get_vocab_size(), n_layer=2, n_head=2, n_kv_head=1,
                          model_dim=32, smear=True))
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval()


def random_prompts(seed, lengths):
    """Prompts of the given lengths, random byte tokens (never a stop token), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.unit
def test_mixed_length_batch_equals_one_prompt_at_a_time(tok):
    """
    Prompts of lengths 1, 3, 7, 12, 20 (two of length 7, not adjacent) in one batch, greedy, on random models with
    smear, value embeddings and GQA (3 seeds, 3 orders, max_batch 64 and 2): every row's tokens equal the prompt's
    alone (one row, a uniform cache), token for token. Catches one rotary offset for all rows (the longest row's
    position), new keys written at one shared slot instead of each row's own, keys past a row's length not masked
    (the stale or zero slots a shorter row has not filled: what left padding without masking the pads does), smear
    reading another row's previous embedding or none in decode, and results put back in the wrong prompt order.
    """
    for seed in range(3):
        engine = Engine(smear_model(tok, seed), tok)
        prompts = random_prompts(seed, LENGTHS + (7,))
        alone = [engine.sample([p], max_tokens=24)[0] for p in prompts]
        assert sum(len(ids) for ids, _ in alone) > 60  # the rows decode for a while (not all stopped at once)
        for order in (range(6), [5, 0, 4, 1, 3, 2], range(5, -1, -1)):
            got = engine.sample([prompts[i] for i in order], max_tokens=24)
            assert got == [alone[i] for i in order], (seed, list(order))
        assert engine.sample(prompts, max_tokens=24, max_batch=2) == alone


@pytest.mark.unit
def test_mixed_length_batch_with_the_tool_equals_one_prompt_at_a_time(tok, tool_model):
    """
    On the tool tests' trained model, with tool=True: rows of 4 different lengths, two of which call the tool at
    different steps (prompt_a, and prompt_a followed by " it is ", which reaches <python_end> 3 tokens sooner) and
    one whose expression the calculator refuses, in two orders: (ids, mask) of every row equal the prompt's alone.
    Catches forced (and sampled) tokens fed at one position for all rows (one rotary offset, one shared write slot,
    lengths that do not advance) and per-row tool states mixed up by the sort by length.
    """
    s, prompt_a, prompt_b, reply, model = tool_model
    engine = Engine(model, tok)
    prompts = [prompt_a, prompt_b[:4], prompt_a + tok.encode(" it is "), prompt_b + [5]]
    assert len({len(p) for p in prompts}) == 4
    alone = [engine.sample([p], max_tokens=24, tool=True)[0] for p in prompts]
    forced_at = [mask.index(0) for _, mask in alone if 0 in mask]
    assert len(set(forced_at)) == 2  # two rows call the tool, at different steps
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        assert engine.sample([prompts[i] for i in order], max_tokens=24, tool=True) == [alone[i] for i in order]


@pytest.mark.unit
def test_mixed_length_logits_equal_the_full_forward_of_each_row(tok):
    """
    Every step's logits of every row of one mixed-length cache (prompt lengths 7, 1, 12, 12, 7, 20, 3: a length in
    two runs, a run of two rows prefilled together) equal the no-cache forward of that row's own tokens alone (prompt + generated) at that position,
    to atol 1e-5 + rtol 1.3e-6 (torch's fp32 defaults: logits reach ~10 here, and the one-prompt cache already
    differs from the full forward by up to ~1.2e-5 on such models, from reduction order). Catches what token
    equality could miss by luck: a slightly wrong rotary position (off by one for some rows), a mask that lets a row
    see one stale slot, a smear of the wrong token or row; and (each row's tokens must be the argmax of its own
    full-forward logits) prefill logits returned for the wrong rows.
    """
    model = smear_model(tok, 7)
    engine = Engine(model, tok)
    prompts = random_prompts(7, (7, 1, 12, 12, 7, 20, 3))
    outs = []
    hook = model.register_forward_hook(lambda m, args, out: outs.append(out[:, -1]))
    try:
        columns = list(engine._columns(prompts, 16, 0.0, None, None))
    finally:
        hook.remove()
    steps = [torch.cat(outs[:len(outs) - 15])] + outs[len(outs) - 15:]  # the prefill's forwards, then 15 decodes
    assert len(steps) == 16 and all(x.shape == (7, tok.get_vocab_size()) for x in steps)
    with torch.no_grad():
        for r, p in enumerate(prompts):
            seq = p + [col[r] for col in columns]
            full = model(torch.tensor([seq]))[0, len(p) - 1:len(seq) - 1]  # (16, vocab_size)
            torch.testing.assert_close(torch.stack([x[r] for x in steps]), full, atol=1e-5, rtol=1.3e-6)
            assert seq[len(p):] == full.argmax(dim=-1).tolist()


def test_text_stream_never_sends_half_a_character(tiny_tokenizer):
    """
    TextStream fed the real tokenizer's ids of a text with a 4-byte emoji and accented letters, one token at a time:
    no piece contains U+FFFD, some token adds nothing (a character still open), and the pieces joined are the text.
    Catches decoding each token alone (the emoji's bytes arrive as replacement characters) and dropping the bytes
    held back (the joined text loses the emoji).
    """
    from nanotrain.engine import TextStream
    text = "Hi \U0001F600 caf\u00e9 \u00fcber ok"
    ids = tiny_tokenizer.encode(text)
    assert sum("\ufffd" in tiny_tokenizer.decode([t]) for t in ids) >= 2  # the emoji is split across tokens
    stream = TextStream(tiny_tokenizer)
    pieces = [stream.add([t]) for t in ids] + [stream.add([], final=True)]
    assert "" in pieces[:-1] and not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == text
