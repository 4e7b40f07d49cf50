"""
Export a GPT and its tokenizer as a Hugging Face transformers directory: AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True) and AutoTokenizer.from_pretrained(dir, trust_remote_code=True) load it offline;
tok.apply_chat_template(messages, add_generation_prompt=True) and model.generate chat with it (scripts/export.py
--format=hf). fp32 logits equal the project's to 1e-5 and greedy generate gives Engine's tokens
(tests/test_hf_export.py). The model's attention goes through transformers' attention interface
(ALL_ATTENTION_FUNCTIONS, _supports_attention_backend): eager, sdpa and paged|eager run it, continuous batching
(model.generate_batch) gives Engine's greedy tokens, and it is the interface vLLM's transformers backend
(--model-impl transformers) requires of a remote-code model (vLLM was not run here). Sliding windows travel as
transformers' own layer_types and sliding_window (= the project's window + 1: transformers counts keys). A checkpoint
trained with smear, backout or x0_lambdas is refused in one line. lm-evaluation-harness runs on any export:
`lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,add_bos_token=True --tasks hellaswag`.
`transformers serve` (OpenAI's API) runs it through `python -m nanotrain.export.hf_serve DIR --trust-remote-code`
(nanotrain.export.hf_serve: plain `transformers serve` looks the architecture up among its own classes and fails).

The directory holds config.json (nanotrain.export.hf_modeling.NanotrainConfig, auto_map naming modeling_nanotrain.py),
generation_config.json, model.safetensors (the GPT's own parameter names), modeling_nanotrain.py (a verbatim copy
of nanotrain/export/hf_modeling.py: torch + transformers only), and the tokenizer as a PreTrainedTokenizerFast
(tokenizer.json, tokenizer_config.json, the chat template).

The tokenizer conversion is exact for tiktoken's BPE: every token of rank r > 255 becomes the merge of the two pieces
that byte-level BPE over the ranks below r splits it into (the method of transformers' TikTokenConverter), vocab
strings are the bytes through GPT-2's bytes_to_unicode table, and ignore_merges=True reproduces tiktoken's shortcut
of a regex piece that is itself a token. The split regex is the tokenizer's own (Oniguruma reads its possessive
quantifiers and \\p classes). The 9 special tokens are added tokens; the post-processor puts <|bos|> first when
add_special_tokens is on (the project's documents start with it).

Differences from nanotrain.tokenizer, by design of transformers: text passed to the HF tokenizer has its
special-token strings (e.g. "<|bos|>") read as special tokens, where the project encodes them as plain text; and the
chat template renders consecutive text parts of one assistant message as one string, encoded together, where the
project encodes each part alone (equal ids whenever no merge crosses the parts' boundary).
"""

import importlib
import json
import os
import shutil

import torch

from nanotrain.common import atomic_write_text
from nanotrain.durable import commit, fsync_path, recover
from nanotrain.errors import UserError
from nanotrain.export.safetensors_file import clean_state_dict

HF_HINT = "pip install transformers==5.24.0 tokenizers==0.23.3 (the pins of requirements.txt)"
MARKER = "modeling_nanotrain.py"  # written last: its presence marks a complete export directory
MODELING_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_modeling.py")

# the project's chat format (nanotrain.tokenizer.render_conversation) as Jinja: a leading system message is folded into
# the first user message (system + "\n\n" + user); assistant content is a string or a list of parts
# {"type": "text" | "python" | "python_output", "text": ...}
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "<|bos|>"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{%- set ns.system = message['content'] + '\n\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "<|user_start|>{{ ns.system }}{{ message['content'] }}<|user_end|>{%- set ns.system = '' -%}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant_start|>"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'python' -%}<|python_start|>{{ part['text'] }}<|python_end|>"
    "{%- elif part['type'] == 'python_output' -%}<|output_start|>{{ part['text'] }}<|output_end|>"
    "{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<|assistant_end|>"
    "{%- else -%}{{ raise_exception('unknown role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant_start|>{%- endif -%}"
)


def require_transformers():
    """Imports transformers and tokenizers; raises UserError (one line saying what to install) when either is
    missing."""
    for name in ("tokenizers", "transformers"):
        try:
            importlib.import_module(name)
        except ImportError:
            raise UserError(f"--format=hf needs transformers and tokenizers ({name} cannot be imported): "
                            f"{HF_HINT}") from None


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable unicode character table (Radford et al. 2019, encoder.py): dict int ->
    str over the 256 byte values."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars)))


def bpe_split(ranks, token, max_rank):
    """
    tiktoken's byte-pair merge of `token` (bytes) using only the ranks below max_rank: repeatedly merge the adjacent
    pair whose concatenation has the lowest rank (the leftmost on ties). Returns the list of byte pieces.
    """
    parts = [bytes([b]) for b in token]
    while True:
        best, best_rank = None, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < max_rank and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best is None:
            return parts
        parts = parts[:best] + [parts[best] + parts[best + 1]] + parts[best + 2:]


def hf_tokenizer(tokenizer):
    """
    A transformers PreTrainedTokenizerFast equal to `tokenizer` (a nanotrain.tokenizer.Tokenizer) on plain text (see
    the module docstring), with bos_token <|bos|>, eos_token <|assistant_end|> and the chat template. Raises
    ValueError if a token cannot be reached by merging two lower-ranked tokens (not a BPE vocabulary).
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    table = bytes_to_unicode()
    ranks = tokenizer.mergeable_ranks

    def text(b):
        return "".join(table[x] for x in b)

    vocab = {text(b): r for b, r in ranks.items()}
    merges = []
    for b, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(b) == 1:
            continue
        parts = bpe_split(ranks, b, r)
        if len(parts) != 2:
            raise ValueError(f"token {r} ({b!r}) is not the merge of two lower-ranked tokens")
        merges.append((text(parts[0]), text(parts[1])))
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=True))
    raw.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(tokenizer.pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    raw.decoder = decoders.ByteLevel()
    specials = sorted(tokenizer.special_tokens.items(), key=lambda kv: kv[1])
    raw.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in specials])
    for name, i in specials:
        if raw.token_to_id(name) != i:
            raise ValueError(f"special token {name} got id {raw.token_to_id(name)}, expected {i}")
    bos = tokenizer.get_bos_token_id()
    raw.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                       special_tokens=[("<|bos|>", bos)])
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<|bos|>", eos_token="<|assistant_end|>",
                                 model_max_length=None, clean_up_tokenization_spaces=False)
    hf.chat_template = CHAT_TEMPLATE
    return hf


def hf_model(model):
    """A nanotrain.export.hf_modeling.NanotrainForCausalLM holding the weights of `model` (a GPT, possibly wrapped by
    torch.compile / DDP), fp32 on the CPU, in eval mode; its config's eos_token_id is [<|assistant_end|>, <|bos|>]
    when a tokenizer is passed to export_hf. Raises UserError (one line naming the option) for a GPT built with
    smear, backout or x0_lambdas: options that lost the project's ablation (dev/LOG.md, "The ablation table in one
    stack") and that the transformers modeling file does not implement."""
    from nanotrain.export.hf_modeling import NOT_IMPLEMENTED, NanotrainConfig, NanotrainForCausalLM
    fields = dict(vars(getattr(model, "module", model).config))
    for name in NOT_IMPLEMENTED:
        if fields.pop(name, False):
            raise UserError(f"the checkpoint was trained with {name}=True, an option the transformers export does "
                            f"not implement (scripts/export.py --format=safetensors exports it)")
    config = NanotrainConfig(**fields)
    out = NanotrainForCausalLM(config)
    state = clean_state_dict(model.state_dict())
    out.load_state_dict({k: v.detach().to("cpu", out.state_dict()[k].dtype) for k, v in state.items()}, strict=True)
    return out.eval()


def export_hf(model, tokenizer, path, dtype=None):
    """
    Writes the transformers directory `path` (see the module docstring) for `model` (a nanotrain GPT) and
    `tokenizer` (its nanotrain Tokenizer) as one unit (nanotrain.durable): everything goes into <path>.tmp/,
    modeling_nanotrain.py last as the marker, which then replaces `path` with one rename. dtype: None or
    torch.float32 stores fp32, torch.bfloat16 halves the weights (config.json's dtype says which). Raises UserError
    when transformers or tokenizers is missing (one line, what to install), ValueError if the tokenizer is not BPE
    (see hf_tokenizer), OSError naming `path`. Returns `path`.
    """
    require_transformers()
    hf = hf_model(model)
    if dtype is not None:
        hf = hf.to(dtype)
    bos, end = tokenizer.get_bos_token_id(), tokenizer.encode_special("<|assistant_end|>")
    hf.config.bos_token_id, hf.config.eos_token_id = bos, [end, bos]
    hf.config.auto_map = {"AutoConfig": "modeling_nanotrain.NanotrainConfig",
                          "AutoModelForCausalLM": "modeling_nanotrain.NanotrainForCausalLM"}
    hf.config.architectures = ["NanotrainForCausalLM"]
    hf.generation_config.bos_token_id, hf.generation_config.eos_token_id = bos, [end, bos]
    hf.generation_config.pad_token_id = end
    tok = hf_tokenizer(tokenizer)
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    recover(path, MARKER)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with torch.no_grad():
            hf.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        config_file = os.path.join(tmp, "tokenizer_config.json")
        with open(config_file, encoding="utf-8") as f:
            tok_config = json.load(f)
        # transformers 5 names its fast tokenizer TokenizersBackend; the older name loads in transformers 4 and 5
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        atomic_write_text(config_file, json.dumps(tok_config, indent=2) + "\n")
        for name in os.listdir(tmp):
            fsync_path(os.path.join(tmp, name))
        with open(MODELING_SOURCE, encoding="utf-8") as f:
            atomic_write_text(os.path.join(tmp, MARKER), f.read())
        fsync_path(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return commit(tmp, path, MARKER)
