"""
The Hugging Face transformers export (nanotrain/export/hf.py, nanotrain/export/hf_modeling.py, scripts/export.py
--format=hf): a tiny GPT with every architecture option on, trained a few steps, exported and loaded back through
AutoModelForCausalLM / AutoTokenizer from its directory, gives the project's fp32 logits (to 1e-5) under each of
transformers' attention implementations, Engine's greedy tokens (generate, and continuous batching in the slow tier),
tiktoken's ids and the project's chat rendering; a checkpoint with an option the export does not implement is
refused. Skipped where transformers is not installed.
"""

import json
import os
import sys

import pytest
import torch
from helpers import LOCAL_MC_TASK, MC_ROWS, run_script

pytest.importorskip("tokenizers", reason="the transformers export needs tokenizers (requirements.txt pins it)")
pytest.importorskip("transformers", reason="the transformers export needs transformers (requirements.txt pins it)")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from nanotrain.checkpoint import save_checkpoint  # noqa: E402
from nanotrain.engine import Engine  # noqa: E402
from nanotrain.errors import UserError
from nanotrain.export import hf as hf_export  # noqa: E402
from nanotrain.export.hf import export_hf, hf_tokenizer, require_transformers  # noqa: E402
from nanotrain.gpt import GPT, GPTConfig  # noqa: E402
from nanotrain.tokenizer import Tokenizer  # noqa: E402

SENTENCES = ["The cat sat on the mat. ", "What is 12 + 30? It is 42. ", "Hello there, how are you doing today? ",
             "Numbers like 2024 and 1999 appear in text. ", "I'm fine, thanks; you're kind.\n\n"]
TRICKY = ["Hello, world! It's 2024.\n\n  naïve café 日本語 x=12345; ok?\r\n\tend  ", "  leading and   runs   ",
          "we'll they've I'M DON'T 3.14159 1000000", "\n\n\n\t \t", "émoji 🙂 mixed ÅÄÖ ß", "a" * 40 + " " + "ab" * 20]


def config(vocab_size, n_layer=3, **options):
    """Every option the export implements on: GQA (4 query heads, 2 kv heads), value embeddings, a rotary base and a
    qk_scale other than their defaults; options: GPTConfig fields to override."""
    return GPTConfig(max_seq_len=64, vocab_size=vocab_size, n_layer=n_layer, n_head=4, n_kv_head=2, model_dim=32,
                     value_embeds=True, rotary_base=1000.0, qk_scale=1.25, **options)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run several times faster on one thread (thread start-up dominates their ops)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok(shared_base_dir):
    return Tokenizer.from_directory(str(shared_base_dir / "tokenizer"))


def trained(tok, cfg):
    """A GPT of `cfg` trained 40 full-batch AdamW steps (lr 1e-2, seed 0) on the sentences (rows of 47 tokens), in
    eval mode."""
    torch.manual_seed(0)
    m = GPT(cfg)
    m.init_weights()
    rows = [tok.encode("".join(SENTENCES[i:] + SENTENCES[:i]), prepend="<|bos|>")[:48] for i in range(len(SENTENCES))]
    data = torch.tensor(rows)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(40):
        loss = m(data[:, :-1].contiguous(), data[:, 1:].contiguous())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.fixture(scope="module")
def model(tok):
    """The GPT of config(), trained (see trained())."""
    return trained(tok, config(tok.get_vocab_size()))


@pytest.fixture(scope="module")
def windowed(tok, tmp_path_factory):
    """(directory, the GPT): config() at depth 4 with sliding windows SSSL of 8 keys back (layers 0-2 see keys
    i-8..i, layer 3 all), trained (see trained()) and exported."""
    m = trained(tok, config(tok.get_vocab_size(), n_layer=4, window_pattern="SSSL", short_window=8))
    path = str(tmp_path_factory.mktemp("hf_windowed") / "export")
    export_hf(m, tok, path)
    return path, m


def load(path, **kwargs):
    """AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs) in eval mode, with the hub offline
    (huggingface_hub reads HF_HUB_OFFLINE at import, so its constant is set too)."""
    import huggingface_hub.constants
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        m.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        return AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, **kwargs).eval()


@pytest.fixture(scope="module")
def exported(model, tok, tmp_path_factory):
    """(directory, the transformers model, the transformers tokenizer), loaded back offline from a local directory."""
    import huggingface_hub.constants
    path = str(tmp_path_factory.mktemp("hf") / "export")
    export_hf(model, tok, path)
    hf = load(path)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("HF_HUB_OFFLINE", "1")
        m.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        return path, hf, AutoTokenizer.from_pretrained(path)


def hf_module(hf):
    """The module the transformers model was loaded from (modeling_nanotrain.py of the export directory)."""
    return sys.modules[type(hf).__module__]


def rows_for(tok):
    """3 rows of 40 tokens: <|bos|> and the sentences from the first, second and third on."""
    return torch.tensor([tok.encode("".join(SENTENCES[i:] + SENTENCES[:i]), prepend="<|bos|>")[:40] for i in range(3)])


# attn_implementation values whose plain forward is checked; "paged|eager" builds its causal mask only inside
# continuous batching (transformers 5.24 has no mask function for it, for any model), so it is checked there
# (test_continuous_batching_equals_engine, slow tier)
ATTENTION = ["eager", "sdpa", "paged|sdpa"]


def max_diffs(hf, model, idx):
    """The largest |logit difference| against `model` (a GPT) of `hf` on the rows idx (B, 40): (full forward, a
    prefill of 17 tokens then 1-, 1-, 5- and 16-token steps through the transformers KV cache, a batch of row 0 and
    row 1's first 25 tokens left-padded to 40)."""
    with torch.no_grad():
        ref = model(idx)
        full = (hf(idx).logits - ref).abs().max().item()
        out = hf(idx[:, :17], use_cache=True)
        cache, steps = out.cache, [out.logits]
        for lo, hi in [(17, 18), (18, 19), (19, 24), (24, 40)]:
            out = hf(idx[:, lo:hi], cache=cache, use_cache=True)
            steps.append(out.logits)
        cached = (torch.cat(steps, dim=1) - ref).abs().max().item()
        short = idx[1:2, :25]
        batch = torch.cat([idx[:1], torch.cat([torch.zeros(1, 15, dtype=torch.long), short], dim=1)])
        mask = torch.cat([torch.ones(1, 40), torch.cat([torch.zeros(1, 15), torch.ones(1, 25)], dim=1)]).long()
        got = hf(batch, attention_mask=mask).logits
        padded = max((got[0] - ref[0]).abs().max().item(), (got[1, 15:] - model(short)[0]).abs().max().item())
    return full, cached, padded


@pytest.mark.unit
def test_logits_equal_under_each_attention_implementation(exported, model, tok, monkeypatch):
    """
    fp32 logits of the exported model equal GPT's to 1e-5 under attn_implementation eager, sdpa and paged|sdpa (each
    loaded from the directory with it): the full forward of 3 rows, cached steps of 1 to 16 tokens, and a left-padded
    batch (each row equal to that row alone). Catches, each run below as a wrong variant that must fail: rotary with
    the interleaved pairing (x[2i], x[2i+1]) instead of the two halves, the softcap forgotten, the value-embedding
    gate off (a constant 1), and positions of a padded row counted from the padding (they must count its tokens
    only); eager attention with kv heads repeated in the wrong order for GQA, qk_scale left out of the attention's
    scaling, or a mask that lets a query see later keys or padding also change the logits by far more than 1e-5.
    (QK norm before rotary is not wrong: the RMS over the head dim is unchanged by the rotation.)
    """
    path, hf, _ = exported
    idx = rows_for(tok)
    assert hf.config._attn_implementation == "sdpa"  # transformers' default where the model supports it
    for impl in ATTENTION:
        loaded = load(path, attn_implementation=impl)
        assert max(max_diffs(loaded, model, idx)) <= 1e-5, impl
    with torch.no_grad():
        ref = model(idx)
    mod = hf_module(hf)

    def interleaved(x, cos, sin):
        x1, x2 = x[..., 0::2], x[..., 1::2]
        y = torch.stack([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)
        return y.flatten(-2).to(x.dtype)

    wrong = {"interleaved rotary": ("apply_rotary", interleaved), "no softcap": ("SOFTCAP", 1e9)}
    for name, (attr, value) in wrong.items():
        with monkeypatch.context() as m, torch.no_grad():
            m.setattr(mod, attr, value)
            assert (hf(idx).logits - ref).abs().max().item() > 1e-3, name
    with monkeypatch.context() as m, torch.no_grad():  # gate off: 2 * sigmoid(W x) replaced by 1
        for block in hf.blocks:
            if block.attn.ve_gate is not None:
                m.setattr(block.attn.ve_gate, "forward", lambda x, n=block.attn.n_kv_head: x.new_zeros(*x.shape[:-1], n))
        assert (hf(idx).logits - ref).abs().max().item() > 1e-3, "value-embedding gate off"
    with torch.no_grad():  # the padded row without its mask: positions counted from the padding
        short = idx[1:2, :25]
        padded = torch.cat([torch.zeros(1, 15, dtype=torch.long), short], dim=1)
        assert (hf(padded).logits[0, 15:] - model(short)[0]).abs().max().item() > 1e-3, "positions from the padding"


@pytest.mark.unit
def test_attention_goes_through_the_interface(exported, model, tok, monkeypatch):
    """
    An attention function registered with transformers' AttentionInterface under a new name (as vLLM's transformers
    backend registers its own) runs every block's attention, once per block per forward, receives the keyword
    arguments given to the model's forward, and its results are the logits (equal to GPT's to 1e-5). Catches a
    modeling file that does its own attention and ignores attn_implementation (the logits tests would pass for it),
    one that keeps the forward's keyword arguments from the attention (continuous batching's cu_seq_lens and cache
    indices travel that way), and a model without _supports_attention_backend.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import AttentionInterface
    path, _, _ = exported
    calls = []

    def probe(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, kwargs.get("probe_marker")))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "nanotrain_probe", probe)
    hf = load(path, attn_implementation="nanotrain_probe")
    assert type(hf)._supports_attention_backend
    idx = rows_for(tok)
    with torch.no_grad():
        got = hf(idx, probe_marker=7).logits
        assert (got - model(idx)).abs().max().item() <= 1e-5
    assert calls == [(i, 7) for i in range(model.config.n_layer)]


@pytest.mark.unit
def test_greedy_generate_equals_engine(exported, model, tok):
    """
    transformers' generate (greedy, its KV cache, eos = <|assistant_end|> / <|bos|>) gives Engine's greedy tokens for 3
    prompts of different lengths, one at a time and as one left-padded batch. Catches a cache that restarts
    rotary positions at 0 on every decode step (it changes these continuations; the cached logits themselves are
    checked in test_logits_equal_under_each_attention_implementation), and padding that shifts a short prompt's
    positions in the batch.
    """
    _, hf, _ = exported
    prompts = [tok.encode(s, prepend="<|bos|>") for s in ["The cat", "What is 12 + 30? It", "Hello there, how"]]
    want = Engine(model, tok).generate(prompts, max_tokens=12)
    stops = {tok.get_bos_token_id(), tok.encode_special("<|assistant_end|>")}

    def cut(ids):
        return next((ids[:i] for i, t in enumerate(ids) if t in stops), ids)

    assert len({tuple(w) for w in want}) == 3 and all(len(set(w)) > 2 for w in want)  # not a degenerate model
    for p, w in zip(prompts, want):
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=12, do_sample=False)
        assert cut(out[0, len(p):].tolist()) == w
    n = max(map(len, prompts))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert [cut(r) for r in out[:, n:].tolist()] == want


@pytest.mark.unit
def test_sliding_windows_equal_the_project(windowed, tok):
    """
    A GPT with sliding windows (SSSL at depth 4, short_window 8: layers 0-2 see keys i-8..i) exports as transformers'
    own sliding layers, config.json's layer_types [sliding_attention x 3, full_attention] and sliding_window 9 (the
    number of keys, W + 1), and its fp32 logits equal the GPT's to 1e-5 under eager, sdpa and paged|sdpa (the full
    forward of 40-token rows, cached steps, DynamicCache keeping the sliding layers' last 8 keys, and a left-padded
    batch); transformers' greedy generate gives Engine's tokens, one prompt at a time and as a left-padded batch.
    Catches the windows lost on the way (every layer full), the conventions off by one (sliding_window = W: a key
    fewer) and the last layer windowed too: each moves the logits by more than 1e-3.
    """
    path, model = windowed
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    assert saved["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] and saved["sliding_window"] == 9
    idx = rows_for(tok)
    for impl in ATTENTION:
        loaded = load(path, attn_implementation=impl)
        assert max(max_diffs(loaded, model, idx)) <= 1e-5, impl
    hf = load(path)
    with torch.no_grad():
        ref = model(idx)
        for change in ({"layer_types": ["full_attention"] * 4}, {"layer_types": ["sliding_attention"] * 4},
                       {"sliding_window": 8}):
            saved_config = {k: getattr(hf.config, k) for k in change}
            for k, v in change.items():
                setattr(hf.config, k, v)
            assert (hf(idx).logits - ref).abs().max().item() > 1e-3, change
            for k, v in saved_config.items():
                setattr(hf.config, k, v)
        assert (hf(idx).logits - ref).abs().max().item() <= 1e-5
    prompts = [tok.encode(s, prepend="<|bos|>") for s in ["The cat", "What is 12 + 30? It", SENTENCES[2]]]
    want = Engine(model, tok).generate(prompts, max_tokens=12)
    stops = {tok.get_bos_token_id(), tok.encode_special("<|assistant_end|>")}
    cut = lambda ids: next((ids[:i] for i, t in enumerate(ids) if t in stops), ids)  # noqa: E731
    for p, w in zip(prompts, want):
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=12, do_sample=False)
        assert cut(out[0, len(p):].tolist()) == w
    n = max(map(len, prompts))
    ids = torch.tensor([[0] * (n - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert [cut(r) for r in out[:, n:].tolist()] == want


@pytest.mark.slow  # continuous batching starts a scheduler thread and sizes a paged cache: ~1 s per
# implementation here; the default tier keeps the plain forward under each implementation and generate
@pytest.mark.unit
@pytest.mark.parametrize("which", ["full", "windowed"])
def test_continuous_batching_equals_engine(which, exported, model, tok, request):
    """
    transformers' continuous batching (generate_batch, greedy, max_new_tokens 12, a paged cache of 32-token pages)
    on the export, with attn_implementation sdpa and paged|eager, gives Engine's greedy tokens for 4 prompts of
    different lengths decoded together, and each generated token's log-probability equals the project GPT's
    log-softmax at that position to 1e-5 (so the logits under paged|eager, which has no mask outside continuous
    batching, are the project's). Catches positions taken from the cache length instead of the per-token
    position_ids (the prompts are packed into one row), the forward's keyword arguments not passed down to
    cache.update and the attention (the paged cache then has no read/write indices), and logits_to_keep indices
    ignored (logits of the wrong tokens). "windowed": the same for the GPT with sliding windows (the windowed
    fixture; the prompts and their 12 tokens outgrow its 8-key window).
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig
    path = exported[0]
    if which == "windowed":
        path, model = request.getfixturevalue("windowed")
    prompts = [tok.encode(s, prepend="<|bos|>") for s in ["The cat", "What is 12 + 30? It", "Hello there, how",
                                                          "Numbers like 2024 and"]]
    want = Engine(model, tok).generate(prompts, max_tokens=12)
    stops = {tok.get_bos_token_id(), tok.encode_special("<|assistant_end|>")}
    for impl in ["sdpa", "paged|eager"]:
        hf = load(path, attn_implementation=impl)
        gen = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=sorted(stops),
                               pad_token_id=hf.generation_config.pad_token_id)
        cb = ContinuousBatchingConfig(num_blocks=16, page_size=32, max_batch_tokens=128, max_requests_per_batch=4,
                                      return_logprobs=True)
        results = list(hf.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb,
                                         warmup=False).values())
        assert len(results) == len(prompts), impl
        for p, w, r in zip(prompts, want, results):
            got = next((r.generated_tokens[:i] for i, t in enumerate(r.generated_tokens) if t in stops),
                       r.generated_tokens)
            assert got == w, impl
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([p + got]))[0], dim=-1)
            ref = [logp[len(p) - 1 + i, t].item() for i, t in enumerate(got)]
            assert max(abs(a - b) for a, b in zip(ref, r.logprobs)) <= 1e-5, impl


@pytest.mark.unit
def test_options_the_export_does_not_implement_are_refused(tok, tmp_path):
    """
    A GPT trained with smear, backout or x0_lambdas (options that lost the project's ablation, not implemented by
    the modeling file) is refused by export_hf with one UserError line naming the option, before anything is
    written; the modeling file's config refuses them too. Catches an export that silently drops the option (its
    logits would differ from the checkpoint's) or writes a directory first.
    """
    for name in ("smear", "backout", "x0_lambdas"):
        torch.manual_seed(0)
        m = GPT(config(tok.get_vocab_size(), n_layer=2, **{name: True}))
        m.init_weights()
        with pytest.raises(UserError) as err:
            export_hf(m, tok, str(tmp_path / name))
        assert str(err.value) == (f"the checkpoint was trained with {name}=True, an option the transformers export "
                                  f"does not implement (scripts/export.py --format=safetensors exports it)")
        assert os.listdir(tmp_path) == []
    from nanotrain.export.hf_modeling import NanotrainConfig
    with pytest.raises(ValueError, match="backout=True is not implemented"):
        NanotrainConfig(backout=True)
    assert not hasattr(NanotrainConfig(smear=False), "smear")


@pytest.mark.unit
def test_tokenizer_ids_equal_tiktoken(exported, tok, monkeypatch):
    """
    The exported PreTrainedTokenizerFast gives tiktoken's ids on the sentences and on text that exercises the split
    regex (contractions, 1-2 digit groups, unicode letters, runs of spaces, \\r\\n, a long repeated word) and decodes
    them back; with add_special_tokens it puts <|bos|> first; special tokens keep their ids. Catches each merge taken
    as the leftmost split of its token into two tokens instead of the split BPE itself reaches (run below: it must
    fail), no <|bos|> from add_special_tokens, and a split regex other than the tokenizer's. (Without tiktoken's
    whole-piece shortcut, ignore_merges, the ids are the same: every token is reached by BPE over its own bytes,
    which hf_tokenizer checks.)
    """
    _, _, hf_tok = exported
    texts = SENTENCES + TRICKY
    for t in texts:
        ids = hf_tok(t, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode(t), t
        assert hf_tok.decode(ids) == t
    assert hf_tok("The cat")["input_ids"] == tok.encode("The cat", prepend="<|bos|>")
    for name, i in tok.special_tokens.items():
        assert hf_tok.convert_tokens_to_ids(name) == i
    digits = Tokenizer.train_from_iterator(iter(["12 34 2024 1999 123456 we'll I'M fine"] * 30), 256 + 9 + 24)
    for t in ["12345 2024", "x=1234567;", "we'll I'M 1999"]:  # merged digit pairs: the 1-2 digit groups matter
        assert hf_tokenizer(digits)(t, add_special_tokens=False)["input_ids"] == digits.encode(t), t

    def leftmost_split(ranks, token, max_rank):
        i = next(i for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks)
        return [token[:i], token[i:]]

    monkeypatch.setattr(hf_export, "bpe_split", leftmost_split)
    wrong = hf_tokenizer(tok)
    assert any(wrong(t, add_special_tokens=False)["input_ids"] != tok.encode(t) for t in texts)


CONVERSATION = {"messages": [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me compute. "},
                                      {"type": "python", "text": "12 + 30"},
                                      {"type": "python_output", "text": "42"},
                                      {"type": "text", "text": " It is 42."}]},
    {"role": "user", "content": "And 2024 + 1?"},
    {"role": "assistant", "content": "2025."},
]}


@pytest.mark.unit
def test_chat_template_ids_equal_the_project_rendering(exported, tok):
    """
    apply_chat_template's ids equal render_conversation's for a multi-turn conversation with a system message and a
    tool call (python block and its output), and with add_generation_prompt equal render_for_completion's. Catches a
    template that renders the system message as its own turn (or drops it), forgets <|bos|>, wraps the tool output in
    python tags, or puts the generation prompt anywhere but after the last user turn.
    """
    _, _, hf_tok = exported

    def ids(messages, **kw):
        out = hf_tok.apply_chat_template(messages, tokenize=True, **kw)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    want, _ = tok.render_conversation(CONVERSATION)
    assert ids(CONVERSATION["messages"]) == want
    prompt = {"messages": CONVERSATION["messages"][:-1]}
    assert ids(prompt["messages"], add_generation_prompt=True) == tok.render_for_completion(prompt)
    s = tok.special_tokens
    assert want.count(s["<|python_start|>"]) == 1 and want.count(s["<|output_start|>"]) == 1


@pytest.mark.unit
def test_round_trip_every_option(exported, model, tok, tmp_path):
    """
    The directory holds config.json with every GPTConfig field, model.safetensors with the GPT's own parameter names
    (every tensor torch.equal after the load), modeling_nanotrain.py and the tokenizer files, and nothing else
    (no temporary copy beside it). A 2-layer export (value embeddings on the other parity of blocks) and a bfloat16
    export load too. Catches a field lost on the way (e.g. value_embeds or qk_scale back at its default), a dropped or renamed
    tensor, a config that ties lm_head to wte, and stop tokens other than Engine's.
    """
    path, hf, _ = exported
    assert {f for f in os.listdir(path)} >= {"config.json", "model.safetensors", "modeling_nanotrain.py",
                                            "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    assert sorted(os.listdir(os.path.dirname(path))) == ["export"]
    with open(os.path.join(path, "tokenizer_config.json")) as f:
        assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"
    for field, value in vars(model.config).items():
        if field not in hf_module(hf).NOT_IMPLEMENTED:  # options the export refuses (all False here)
            assert getattr(hf.config, field) == value, field
    theirs, ours = hf.state_dict(), model.state_dict()
    assert sorted(theirs) == sorted(ours)
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert hf.lm_head.weight.data_ptr() != hf.wte.weight.data_ptr()
    stops = Engine(model, tok).stop_ids  # generate stops where Engine does
    assert set(hf.config.eos_token_id) == stops and set(hf.generation_config.eos_token_id) == stops

    torch.manual_seed(1)
    two = GPT(config(tok.get_vocab_size(), n_layer=2))
    two.init_weights()
    export_hf(two, tok, str(tmp_path / "two"), dtype=torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "two"), trust_remote_code=True)
    assert sorted(loaded.value_embeds.keys()) == ["1"] and loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.wte.weight.float(), two.wte.weight.bfloat16().float())


@pytest.mark.slow  # importing the optional harness and its run take ~20 s; the default tier keeps the exported
# directory it reads (the tests above) and no other test runs the harness (lm_eval is not in requirements.txt)
@pytest.mark.unit
def test_lm_eval_local_task_scores_the_project_loglikelihoods(exported, model, tok, tmp_path, monkeypatch):
    """
    lm-evaluation-harness (skipped where lm_eval is not installed) runs a local multiple-choice task YAML with local
    JSONL rows, offline, on the exported directory (nanotrain.evaluation.lm_harness.run_lm_eval): every request's
    log-likelihood equals the project GPT's summed log-probability of the continuation " choice" after <|bos|> +
    question (to 1e-4), and acc is the share of rows whose gold choice scores highest. Catches requests scored
    without <|bos|> (the project's documents start with it), an exported model the harness cannot load, and the
    per-row results read in another order; an unknown task is one UserError line.
    """
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional (pip install lm_eval[hf])")
    import huggingface_hub.constants

    from nanotrain.evaluation.lm_harness import run_lm_eval
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    path, _, _ = exported
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in MC_ROWS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "local_mc.yaml").write_text(LOCAL_MC_TASK.format(name="nanotrain_local_mc", data=data))
    results, samples = run_lm_eval(path, "nanotrain_local_mc", str(tmp_path / "tasks"), log_samples=True)

    def loglik(context, continuation, bos=True):
        ctx = tok.encode(context, prepend="<|bos|>" if bos else None)
        whole = tok.encode(context + continuation, prepend="<|bos|>" if bos else None)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0], dim=-1)
        return sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))

    rows = sorted(samples["nanotrain_local_mc"], key=lambda s: s["doc_id"])
    assert len(rows) == len(MC_ROWS)
    correct = 0
    for row, sample in zip(MC_ROWS, rows):
        want = [loglik(row["question"], " " + c) for c in row["choices"]]
        got = [r[0][0] for r in sample["resps"]]
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4
        assert max(abs(a - b) for a, b in zip(got, [loglik(row["question"], " " + c, False)
                                                   for c in row["choices"]])) > 1e-3  # without <|bos|>
        correct += want.index(max(want)) == row["answer"]
    assert results["nanotrain_local_mc"]["acc,none"] == pytest.approx(correct / len(MC_ROWS))
    with pytest.raises(UserError, match="no_such_task"):
        run_lm_eval(path, "no_such_task", str(tmp_path / "tasks"))


@pytest.mark.unit
def test_missing_transformers_is_one_line(monkeypatch):
    """Without transformers, --format=hf is a UserError naming what to install (the script prints it as one line and
    exits non-zero through run_script)."""
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(UserError, match=r"\(transformers cannot be imported\): pip install transformers==\S+ "):
        require_transformers()


@pytest.mark.slow  # a subprocess importing torch and transformers; the default tier keeps the export and the Auto
# loads offline in-process (test_round_trip_every_option, the exported fixture) and the missing-transformers line
@pytest.mark.smoke
def test_export_script_hf_offline(base_dir, model, tok):
    """
    scripts/export.py --format=hf on a saved checkpoint, with HF_HUB_OFFLINE=1: writes the directory, loads it back
    through the Auto classes and prints its verification line; a bad --format, and a checkpoint trained with backout
    (an option the export does not implement), are one line and a non-zero exit.
    """
    save_checkpoint(str(base_dir / "base" / "t"), 1, model, [], {"model_config": vars(model.config),
                                                                 "tokenizer_sha256": tok.fingerprint()}, {})
    r = run_script("export.py", "--source=base", "--format=hf", base_dir=base_dir, env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "verified: transformers logits within" in r.stdout and "tokenizer ids equal" in r.stdout
    assert os.path.isfile(base_dir / "base" / "t" / "export" / "hf" / "modeling_nanotrain.py")
    r = run_script("export.py", "--format=onnx", base_dir=base_dir)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].endswith("expected 'safetensors' or 'hf'")
    torch.manual_seed(0)
    backout = GPT(config(tok.get_vocab_size(), n_layer=2, backout=True))
    backout.init_weights()
    save_checkpoint(str(base_dir / "base" / "b"), 1, backout, [], {"model_config": vars(backout.config),
                                                                   "tokenizer_sha256": tok.fingerprint()}, {})
    r = run_script("export.py", "--source=base", "--run_name=b", "--format=hf", base_dir=base_dir,
                   env={"HF_HUB_OFFLINE": "1"})
    assert r.returncode != 0 and "backout=True" in r.stderr.strip().splitlines()[-1]
    assert not os.path.exists(base_dir / "base" / "b" / "export")


@pytest.mark.unit
def test_transformers_serve_finds_the_registered_architecture(exported, model, tok):
    """
    nanotrain.export.hf_serve.register: transformers serve's own lookup of the export, getattr(transformers,
    config.architectures[0]) (transformers 5.24's ModelManager._load_model), finds the directory's own class, its
    name is a causal LM's (serve's modality check), and that class's from_pretrained (what serve calls, with
    trust_remote_code) gives the project's logits. Catches the lookup that fails without it ("module transformers has
    no attribute NanotrainForCausalLM") and a class registered under another name than the config's.
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from nanotrain.export.hf_serve import register
    path, _, _ = exported
    name = json.load(open(os.path.join(path, "config.json")))["architectures"][0]
    try:
        cls = register(path)
        assert getattr(transformers, name) is cls and name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
        hf = getattr(transformers, name).from_pretrained(path, trust_remote_code=True).eval()
        idx = rows_for(tok)
        with torch.no_grad():
            assert (hf(idx).logits - model(idx)).abs().max().item() < 1e-5
    finally:
        transformers.__dict__.pop(name, None)
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.pop("nanotrain", None)


@pytest.mark.slow  # transformers serve starts in ~20 s; needs transformers[serving] (accelerate: serve sets device_map)
def test_transformers_serve_answers_engines_greedy_reply(exported, model, tok):
    """
    `python -m nanotrain.export.hf_serve DIR --trust-remote-code --device cpu` (transformers serve on the export,
    offline): a chat completion at temperature 0 of 8 tokens is Engine's greedy reply to the project's rendering of
    the same conversation. Catches a server that cannot load the export and a chat template or a generation that
    differ from the project's.
    """
    import importlib.util
    import socket
    import subprocess
    import time
    import urllib.request

    from helpers import REPO
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers serve needs transformers[serving] (accelerate)")
    path, _, _ = exported
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.Popen([sys.executable, "-m", "nanotrain.export.hf_serve", path, "--trust-remote-code", "--device",
                          "cpu", "--host", "127.0.0.1", "--port", str(port)], env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    messages = [{"role": "user", "content": "What is 12 + 30?"}]
    try:
        deadline, reply = time.time() + 180, None
        while reply is None and time.time() < deadline and p.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", method="POST", data=json.dumps(
                    {"model": path, "messages": messages, "max_tokens": 8, "temperature": 0}).encode(),
                    headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    reply = json.loads(r.read())["choices"][0]["message"]["content"]
            except OSError:
                time.sleep(1)
        assert reply is not None, p.stderr.read()[-3000:] if p.poll() is not None else "no answer in 180 s"
    finally:
        p.terminate()
        p.wait(timeout=30)
    ids = tok.render_for_completion({"messages": messages})
    want = Engine(model, tok).generate([ids], max_tokens=8)[0]
    assert reply == tok.decode(want)
