"""
The BPE tokenizer: merges are trained with rustbpe (Rust, byte-level BPE on a GPT-4-style regex pre-split), inference
runs on tiktoken (multi-threaded batch encoding). The 9 special tokens get the ids right after the merges, i.e. the
last 9 ids of the vocabulary. Scheme as in nanochat (karpathy/nanochat, nanochat/tokenizer.py).

Saved as plain data (no pickle) under <base_dir>/tokenizer/:
- tokenizer.json: {"format": "nanotrain-bpe-1", "pattern", "vocab_size", "special_tokens": {name: id},
  "mergeable_ranks": [[base64 token bytes, rank], ...]} with ranks 0..n-1 in order.
- token_bytes.npy: int32 (vocab_size,), the UTF-8 byte length of every token (0 for special tokens), for bits per byte.
The two files are one unit: saved together by one directory rename (Tokenizer.save, nanotrain.durable), and every
load checks that token_bytes.npy holds the byte lengths of the tokenizer.json beside it (get_token_bytes).

Chat format (render_conversation / render_for_completion; the schema is nanotrain.conversation): nanochat's layout of user and assistant
turns between special tokens, with a mask that trains the assistant's tokens only.
"""

import base64
import binascii
import hashlib
import json
import os
import shutil

import numpy as np
import torch

from nanotrain.common import atomic_write_text, get_base_dir
from nanotrain.conversation import chat_messages, messages_list
from nanotrain.durable import best_copy, commit, fsync_path, recover
from nanotrain.errors import UserError

SPECIAL_TOKENS = [
    "<|bos|>",  # every document starts with it
    "<|user_start|>", "<|user_end|>",  # chat turns (used from mid-training on)
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # the assistant calling the python tool
    "<|output_start|>", "<|output_end|>",  # the tool's output
]

# GPT-4's split pattern (tiktoken cl100k_base) with numbers grouped by 1-2 digits instead of 1-3, as in nanochat
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
)

MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the 256 single bytes + the special tokens, no merges
FORMAT = "nanotrain-bpe-1"
TOKENIZER_FILE = "tokenizer.json"
TOKEN_BYTES_FILE = "token_bytes.npy"
TRAIN_HINT = "run `python scripts/tok_train.py` to train it"


class Tokenizer:
    """
    A byte-level BPE tokenizer: `mergeable_ranks` (token bytes -> id, ids 0..n-1, the 256 single bytes included),
    the regex split `pattern`, and the special tokens at ids n..n+8 (vocab_size = n + 9).
    Text is always encoded as plain text: special-token strings typed in user text stay ordinary text.
    """

    def __init__(self, mergeable_ranks, pattern=SPLIT_PATTERN):
        import tiktoken
        self.mergeable_ranks = dict(mergeable_ranks)
        self.pattern = pattern
        n = len(self.mergeable_ranks)
        self.special_tokens = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        self.enc = tiktoken.Encoding("nanotrain", pat_str=pattern, mergeable_ranks=self.mergeable_ranks,
                                     special_tokens=self.special_tokens)

    @classmethod
    def train_from_iterator(cls, text_iterator, vocab_size):
        """
        Trains BPE merges with rustbpe on the strings of `text_iterator` until the vocabulary holds `vocab_size`
        tokens, the 9 special tokens included (so 256 bytes + vocab_size - 265 merges). Fewer merges are learned if
        the text runs out of pairs to merge; get_vocab_size() gives the actual size.
        Raises UserError if vocab_size < 265 (256 bytes + 9 specials).
        Algorithm: byte-level BPE (Sennrich et al. 2016; GPT-2, Radford et al. 2019).
        """
        import rustbpe
        if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
            raise UserError(f"--vocab_size={vocab_size}: expected an int >= {MIN_VOCAB_SIZE} "
                            f"(256 bytes + {len(SPECIAL_TOKENS)} special tokens)")
        bpe = rustbpe.Tokenizer()
        bpe.train_from_iterator(text_iterator, vocab_size - len(SPECIAL_TOKENS), pattern=SPLIT_PATTERN)
        return cls(dict(bpe.get_mergeable_ranks()), bpe.get_pattern())

    @classmethod
    def from_directory(cls, path):
        """
        Loads <path>/tokenizer.json (from the newest complete copy of `path` an interrupted save left: readable_dir).
        Raises UserError (one line naming the file and `python scripts/tok_train.py`)
        if it is missing or not a valid nanotrain tokenizer (format, keys, contiguous ranks 0..n-1, special ids).
        """
        file = os.path.join(readable_dir(path), TOKENIZER_FILE)
        if not os.path.exists(file):
            raise UserError(f"tokenizer not found: {file} is missing; {TRAIN_HINT}")
        try:
            with open(file, encoding="utf-8") as f:
                data = json.load(f)
            ranks, pattern = _validate(data)
            return cls(ranks, pattern)
        except (ValueError, TypeError, KeyError, binascii.Error, UnicodeDecodeError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(f"corrupt tokenizer file {file} ({reason}); {TRAIN_HINT} again") from None

    def save(self, path):
        """
        Writes tokenizer.json and token_bytes.npy into the directory `path` as one unit (nanotrain.durable): both go
        into <path>.tmp/ first (each fsynced, tokenizer.json last as the directory's marker), which then replaces
        `path` with one rename. A kill at any instant leaves either the old pair or the new pair (readers take the
        newest complete copy: from_directory, get_token_bytes); an error while writing leaves the old pair as it was
        and no temp directory. `path` holds these two files only: anything else in it is replaced with it. A
        symlinked `path` is written through (its target is replaced). Raises OSError (naming the file in `path`, not
        its temporary copy).
        """
        path = os.path.realpath(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        recover(path, TOKENIZER_FILE)  # finish or undo an interrupted earlier save
        ranks = sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1])
        data = {
            "format": FORMAT,
            "pattern": self.pattern,
            "vocab_size": self.get_vocab_size(),
            "special_tokens": self.special_tokens,
            "mergeable_ranks": [[base64.b64encode(b).decode("ascii"), r] for b, r in ranks],
        }
        tmp = path + ".tmp"
        os.makedirs(tmp)
        try:
            with open(os.path.join(tmp, TOKEN_BYTES_FILE), "wb") as f:
                np.save(f, self.token_bytes().numpy().astype(np.int32), allow_pickle=False)
                f.flush()
                os.fsync(f.fileno())
            fsync_path(tmp)
            atomic_write_text(os.path.join(tmp, TOKENIZER_FILE), json.dumps(data) + "\n")  # the marker: last
            fsync_path(tmp)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            name = os.fsdecode(exc.filename) if isinstance(exc, OSError) and exc.filename is not None else ""
            if name.startswith(tmp + os.sep):  # name the file the user knows, not the temp directory's copy
                raise OSError(exc.errno, exc.strerror, path + name[len(tmp):]) from exc
            raise
        commit(tmp, path, TOKENIZER_FILE)

    def get_vocab_size(self):
        """Number of token ids: merges (256 bytes included) + 9 special tokens."""
        return len(self.mergeable_ranks) + len(self.special_tokens)

    def fingerprint(self):
        """
        sha256 hex digest (64 chars) of what the tokenizer maps: the split pattern, every (token bytes, id) and the
        special tokens. Equal for equal tokenizers however the file is formatted; a tokenizer retrained with the same
        vocab_size but other merges gets another one. Stored in every checkpoint and checked when one is loaded.
        """
        h = hashlib.sha256()
        h.update(json.dumps([self.pattern, self.special_tokens], sort_keys=True).encode())
        for token, rank in sorted(self.mergeable_ranks.items(), key=lambda kv: kv[1]):
            h.update(rank.to_bytes(4, "little") + len(token).to_bytes(4, "little") + token)
        return h.hexdigest()

    def get_bos_token_id(self):
        """The id of <|bos|>, which starts every document."""
        return self.special_tokens["<|bos|>"]

    def encode_special(self, name):
        """The id of the special token `name` (e.g. "<|bos|>"). Raises ValueError for an unknown name."""
        if name not in self.special_tokens:
            raise ValueError(f"unknown special token {name!r}; expected one of {SPECIAL_TOKENS}")
        return self.special_tokens[name]

    def encode(self, text, prepend=None, num_threads=8):
        """
        Encodes plain text (special-token strings in it are NOT interpreted). `text` is a str -> list[int], or a
        list[str] -> list[list[int]] (encoded in parallel on `num_threads` threads). `prepend` (an id or a special
        token string, e.g. "<|bos|>") is put before each sequence.
        """
        if prepend is not None and not isinstance(prepend, int):
            prepend = self.encode_special(prepend)
        if isinstance(text, str):
            ids = self.enc.encode_ordinary(text)
            return ids if prepend is None else [prepend] + ids
        if isinstance(text, (list, tuple)):
            batch = self.enc.encode_ordinary_batch(list(text), num_threads=num_threads)
            return batch if prepend is None else [[prepend] + ids for ids in batch]
        raise TypeError(f"encode expects a str or a list of str, got {type(text).__name__}")

    def decode(self, ids):
        """Decodes a sequence of ids to a str (special tokens as their strings; broken UTF-8 becomes U+FFFD)."""
        return self.enc.decode(list(ids))

    def render_conversation(self, conversation, max_tokens=2048):
        """
        Renders a chat conversation for training, nanochat's format (karpathy/nanochat, tokenizer.py):
            <|bos|>
            <|user_start|> user text <|user_end|>                        mask 0
            <|assistant_start|>                                          mask 0
            assistant text                                               mask 1
            <|python_start|> code <|python_end|>                         mask 1 (the tool call is trained)
            <|output_start|> tool output <|output_end|>                  mask 0 (the tool writes it at test time)
            <|assistant_end|>                                            mask 1
            ... more turns
        conversation: {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]}; user and system
        content is a str; assistant content is a str or a list of parts {"type": "text"|"python"|"python_output",
        "text": str}. A leading system message is folded into the first user message: its text + "\n\n" + the
        user's text (the format has no system role). Other keys are ignored.
        Returns (ids, mask): two list[int] of the same length, truncated to the first `max_tokens` tokens; mask[i] is 1
        where ids[i] is a target to train on. Raises ValueError (see chat_messages) for a malformed conversation.
        """
        ids, mask = [self.get_bos_token_id()], [0]

        def add(tokens, m):
            ids.extend(tokens)
            mask.extend([m] * len(tokens))

        s = self.special_tokens
        for role, content in chat_messages(conversation):
            if role == "user":
                add([s["<|user_start|>"]] + self.encode(content) + [s["<|user_end|>"]], 0)
                continue
            add([s["<|assistant_start|>"]], 0)
            for part in ([{"type": "text", "text": content}] if isinstance(content, str) else content):
                if part["type"] == "text":
                    add(self.encode(part["text"]), 1)
                elif part["type"] == "python":
                    add([s["<|python_start|>"]] + self.encode(part["text"]) + [s["<|python_end|>"]], 1)
                else:  # python_output
                    add([s["<|output_start|>"]] + self.encode(part["text"]) + [s["<|output_end|>"]], 0)
            add([s["<|assistant_end|>"]], 1)
        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conversation):
        """
        The prompt for generating the assistant's next reply: the conversation rendered as in render_conversation
        (not truncated) without its last message if that is the assistant's, followed by <|assistant_start|>.
        Returns list[int]. Raises ValueError for a malformed conversation or one that (after dropping the assistant's
        last message) does not end with a user message.
        """
        messages = list(messages_list(conversation))
        if messages and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant":
            messages.pop()
        if not messages or not isinstance(messages[-1], dict) or messages[-1].get("role") != "user":
            raise ValueError("render_for_completion: the conversation must end with a user message "
                             "(optionally followed by the assistant's reply, which is dropped)")
        ids, _ = self.render_conversation({"messages": messages}, max_tokens=2**62)
        return ids + [self.special_tokens["<|assistant_start|>"]]

    def token_bytes(self):
        """
        torch.int64 (vocab_size,): the number of UTF-8 bytes each token stands for, 0 for special tokens. Taken from
        the token's bytes directly (not decode-to-str, which miscounts tokens holding part of a multi-byte char).
        """
        out = np.zeros(self.get_vocab_size(), dtype=np.int64)
        for b, r in self.mergeable_ranks.items():
            out[r] = len(b)
        return torch.from_numpy(out)


PATTERN_PROBE = "Hello, world! It's 2024.\n\n  naïve café 日本語 x=12345; ok?\r\n\tend  "


def _check_pattern(pattern):
    """
    Raises ValueError if the split pattern is empty or matches the empty string (at the start or anywhere in a probe
    text): tiktoken accepts such a pattern and then panics (a Rust traceback) at the first encode. A pattern the
    `regex` module cannot compile is left to tiktoken, which reports it as a ValueError.
    """
    import regex  # tiktoken's own dependency, with the same \p{...} classes and possessive quantifiers
    if not pattern:
        raise ValueError("'pattern' (the split regex) is empty")
    try:
        compiled = regex.compile(pattern)
    except regex.error:
        return
    if compiled.match("") is not None or any(m.end() == m.start() for m in compiled.finditer(PATTERN_PROBE)):
        raise ValueError(f"'pattern' {pattern[:80]!r} matches the empty string; tiktoken cannot split text with it")


def _validate(data):
    """Checks a loaded tokenizer.json; returns (mergeable_ranks dict, pattern). Raises ValueError with the reason."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"expected a JSON object with \"format\": \"{FORMAT}\"")
    for key in ("pattern", "vocab_size", "special_tokens", "mergeable_ranks"):
        if key not in data:
            raise ValueError(f"missing key {key!r}")
    pattern, entries = data["pattern"], data["mergeable_ranks"]
    if not isinstance(pattern, str) or not isinstance(entries, list):
        raise ValueError("'pattern' must be a string and 'mergeable_ranks' a list")
    _check_pattern(pattern)
    ranks = {}
    for i, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and entry[1] == i
                and type(entry[1]) is int):
            raise ValueError(f"mergeable_ranks[{i}] is not [base64 bytes, {i}] (ranks must be 0..n-1 in order)")
        b = base64.b64decode(entry[0], validate=True)
        if not b or b in ranks:
            raise ValueError(f"mergeable_ranks[{i}] is empty or a duplicate token")
        ranks[b] = i
    if any(bytes([i]) not in ranks for i in range(256)):
        raise ValueError("mergeable_ranks lacks some of the 256 single bytes")
    n = len(ranks)
    expected = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
    if data["special_tokens"] != expected:
        raise ValueError(f"special_tokens must be {SPECIAL_TOKENS} at ids {n}..{n + len(SPECIAL_TOKENS) - 1}")
    if data["vocab_size"] != n + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {data['vocab_size']} != {n} merges + {len(SPECIAL_TOKENS)} special tokens")
    return ranks, pattern


def get_tokenizer_dir():
    """<base_dir>/tokenizer, where scripts/tok_train.py saves the tokenizer."""
    return os.path.join(get_base_dir(), "tokenizer")


def readable_dir(path):
    """The copy of the tokenizer directory `path` to read: the newest complete one an interrupted save left
    (<path>.tmp, <path>, <path>.old; nanotrain.durable.best_copy), else `path` itself (whose files may be missing)."""
    return best_copy(path, TOKENIZER_FILE) or path


def get_tokenizer():
    """The trained tokenizer from <base_dir>/tokenizer. Raises UserError (naming tok_train.py) if missing/corrupt."""
    return Tokenizer.from_directory(get_tokenizer_dir())


def get_token_bytes(device="cpu"):
    """
    torch.int64 (vocab_size,) on `device`: UTF-8 byte length per token id (0 for special tokens), read from
    <base_dir>/tokenizer/token_bytes.npy (the same copy of the directory get_tokenizer reads: readable_dir).
    Raises UserError (naming tok_train.py) if missing, corrupt, or not the byte lengths of the tokens of the
    tokenizer.json beside it (checked entry by entry against Tokenizer.token_bytes: a token_bytes.npy of another
    tokenizer of the same vocab size would silently give a wrong bits-per-byte).
    """
    d = readable_dir(get_tokenizer_dir())
    file = os.path.join(d, TOKEN_BYTES_FILE)
    if not os.path.exists(file):
        raise UserError(f"tokenizer not found: {file} is missing; {TRAIN_HINT}")
    tokenizer = Tokenizer.from_directory(d)
    vocab_size = tokenizer.get_vocab_size()
    try:
        arr = np.load(file, allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise UserError(f"corrupt tokenizer file {file} ({e}); {TRAIN_HINT} again") from None
    if arr.shape != (vocab_size,) or arr.dtype.kind not in "iu" or (arr < 0).any():
        raise UserError(f"corrupt tokenizer file {file} (expected {vocab_size} non-negative ints, got shape "
                        f"{arr.shape} {arr.dtype}); {TRAIN_HINT} again")
    expected = tokenizer.token_bytes().numpy()
    wrong = np.flatnonzero(arr != expected)
    if wrong.size:
        i = int(wrong[0])
        raise UserError(f"{file} does not belong to the tokenizer.json beside it: the byte lengths of {wrong.size} of "
                        f"{vocab_size} tokens differ (token {i}: {int(arr[i])} in the file, {int(expected[i])} in "
                        f"the tokenizer), so bits per byte would be wrong; {TRAIN_HINT} again")
    return torch.from_numpy(arr.astype(np.int64)).to(device)
