"""Tests of nanotrain/tokenizer.py (a real tiny BPE trained in-process) and scripts/tok_train.py end to end."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from nanotrain.errors import UserError
from nanotrain.tokenizer import (
    SPECIAL_TOKENS,
    TRAIN_HINT,
    Tokenizer,
    get_token_bytes,
    get_tokenizer,
    get_tokenizer_dir,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2024 and we've got 123456 reasons to train.",
    "Numbers: 3.14159, 2718, 1000000 and 42; dates 1999-12-31.",
    "Naïve café résumé: Ελληνικά, русский, 日本語のテキスト, 中文文本。",
    "Emoji: 😀😀 👍🏽 👨‍👩‍👧 🎉🎉 — and some <|bos|> look-alikes.",
    "def f(x):\n    return x * 2\n\n\nclass A:\n    pass\n",
] * 20

TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.\n\nNew paragraph\twith tab.",
    "naïve café — Ελληνικά 日本語 русский текст",
    "emoji 😀 👍🏽 👨‍👩‍👧 🎉 and ZWJ sequences",
    "digits 1234567890 and 3.14159",
    "",
    "   leading and trailing spaces   \n\n\n",
]

VOCAB_SIZE = 256 + 9 + 120


@pytest.fixture(autouse=True)
def base_dir(tmp_path, monkeypatch):
    # shadows conftest's base_dir (which links the shared corpus/tokenizer): these tests write their own
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train_from_iterator(iter(TRAIN_TEXT), VOCAB_SIZE)


@pytest.mark.unit
def test_vocab_size_and_roundtrip(tok):
    """Catches a wrong bytes<->rank mapping or a split pattern that drops characters (decode(encode(x)) != x)."""
    assert tok.get_vocab_size() == VOCAB_SIZE
    for text in TEXTS + TRAIN_TEXT[:5]:
        ids = tok.encode(text)
        assert all(0 <= i < VOCAB_SIZE - 9 for i in ids)
        assert tok.decode(ids) == text
    # merges were learned: a frequent word is shorter than its bytes
    assert len(tok.encode(" quick brown fox")) < len(" quick brown fox")


@pytest.mark.unit
def test_digits_split_by_one_or_two(tok):
    """Catches training with rustbpe's default pattern (\\p{N}{1,3}) instead of nanochat's 1-2 digit groups."""
    for b, _ in tok.mergeable_ranks.items():
        assert sum(ch in b"0123456789" for ch in b) <= 2, b
    assert tok.decode(tok.encode("123456")) == "123456"


@pytest.mark.unit
def test_special_tokens_are_last_ids(tok):
    """Catches special tokens placed before the merges or in another order, and a broken prepend."""
    ids = [tok.encode_special(name) for name in SPECIAL_TOKENS]
    assert ids == list(range(VOCAB_SIZE - 9, VOCAB_SIZE))
    assert tok.get_bos_token_id() == VOCAB_SIZE - 9
    assert tok.decode(ids) == "".join(SPECIAL_TOKENS)
    body = tok.encode("hello")
    assert tok.encode("hello", prepend="<|bos|>") == [tok.get_bos_token_id()] + body
    assert tok.encode("hello", prepend=ids[3]) == [ids[3]] + body
    assert tok.encode(["hi", "yo"], prepend="<|bos|>") == [[ids[0]] + tok.encode("hi"), [ids[0]] + tok.encode("yo")]
    with pytest.raises(ValueError):
        tok.encode_special("<|nope|>")


@pytest.mark.unit
def test_special_strings_in_user_text_stay_text(tok):
    """Catches encoding user text with special tokens allowed (a prompt-injection hole: '<|bos|>' typed by a user)."""
    text = "a <|bos|> b <|assistant_start|> c <|python_end|>"
    ids = tok.encode(text)
    assert all(i < VOCAB_SIZE - 9 for i in ids)
    assert tok.decode(ids) == text
    assert all(all(i < VOCAB_SIZE - 9 for i in row) for row in tok.encode([text, text]))


@pytest.mark.unit
def test_batch_equals_single(tok):
    """Catches batch encoding that reorders texts or differs from single encoding (threads mixing outputs)."""
    texts = TEXTS * 5
    assert tok.encode(texts, num_threads=4) == [tok.encode(t) for t in texts]
    assert tok.encode([]) == []


@pytest.mark.unit
def test_token_bytes_counts_utf8_bytes(tok):
    """
    Catches token byte lengths computed by decoding each token to str and re-encoding: tokens holding part of a
    multi-byte character decode to U+FFFD (3 bytes), so the sum over an encoding would not equal the text's bytes.
    """
    tb = tok.token_bytes()
    assert tb.dtype.is_floating_point is False and tb.shape == (VOCAB_SIZE,)
    assert tb[-9:].tolist() == [0] * 9
    assert tb[:256].tolist() == [1] * 256
    for text in TEXTS + TRAIN_TEXT[:5]:
        assert int(tb[tok.encode(text)].sum()) == len(text.encode("utf-8")), text
    # the check above is meaningful: some learned tokens are partial UTF-8 sequences whose str round trip miscounts
    wrong = [len(tok.decode([i]).encode("utf-8")) for i in range(VOCAB_SIZE - 9)]
    assert any(w != int(tb[i]) for i, w in enumerate(wrong))


@pytest.mark.unit
def test_save_load_roundtrip(tok, base_dir):
    """Catches a save format that loses merges, ranks or the pattern (loaded encodings would differ)."""
    tok.save(get_tokenizer_dir())
    files = sorted(os.listdir(get_tokenizer_dir()))
    assert files == ["token_bytes.npy", "tokenizer.json"]  # no leftover temp files
    loaded = get_tokenizer()
    assert loaded.get_vocab_size() == tok.get_vocab_size()
    assert loaded.pattern == tok.pattern and loaded.mergeable_ranks == tok.mergeable_ranks
    for text in TEXTS + TRAIN_TEXT[:5]:
        assert loaded.encode(text) == tok.encode(text)
    assert get_token_bytes("cpu").tolist() == tok.token_bytes().tolist()
    arr = np.load(os.path.join(get_tokenizer_dir(), "token_bytes.npy"), allow_pickle=False)
    assert arr.dtype == np.int32 and arr.shape == (VOCAB_SIZE,)
    data = json.load(open(os.path.join(get_tokenizer_dir(), "tokenizer.json")))
    assert data["format"] == "nanotrain-bpe-1" and data["special_tokens"]["<|bos|>"] == VOCAB_SIZE - 9


def tokenizer_bytes():
    """{file name: bytes} of every file in the tokenizer directory."""
    d = get_tokenizer_dir()
    return {name: open(os.path.join(d, name), "rb").read() for name in sorted(os.listdir(d))}


@pytest.mark.unit
def test_failed_save_keeps_the_old_tokenizer(tok, monkeypatch):
    """
    Catches a save that replaces one file before the other is written (on the old code: a failing token_bytes.npy
    write left the new tokenizer.json next to the old token_bytes.npy, and a temp file behind).
    """
    tok.save(get_tokenizer_dir())
    before = tokenizer_bytes()
    other = Tokenizer.train_from_iterator(iter(TRAIN_TEXT), VOCAB_SIZE - 20)

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")
    monkeypatch.setattr(np, "save", disk_full)
    with pytest.raises(OSError, match="No space"):
        other.save(get_tokenizer_dir())
    assert tokenizer_bytes() == before


@pytest.mark.unit
def test_token_bytes_of_another_tokenizer_of_the_same_size_is_refused(tok):
    """
    tokenizer.json of one tokenizer beside token_bytes.npy of another with the same vocab size (what a kill between
    the two file replacements of the old save left, or a hand copy): get_token_bytes refuses in one line naming the
    file. Catches the old check, which compared only the array's shape, so bits per byte came out silently wrong.
    """
    other = Tokenizer.train_from_iterator(iter([t[::-1] for t in TRAIN_TEXT]), VOCAB_SIZE)
    assert other.get_vocab_size() == VOCAB_SIZE and not np.array_equal(other.token_bytes(), tok.token_bytes())
    tok.save(get_tokenizer_dir())
    np.save(os.path.join(get_tokenizer_dir(), "token_bytes.npy"), other.token_bytes().numpy().astype(np.int32))
    with pytest.raises(UserError, match=r"token_bytes\.npy does not belong to the tokenizer\.json") as info:
        get_token_bytes("cpu")
    assert "\n" not in str(info.value)


@pytest.mark.unit
def test_a_kill_at_every_operation_of_a_save_leaves_the_old_pair_or_the_new_pair(tok, monkeypatch):
    """
    A save of another tokenizer over `tok`, cut short before each of its file-system operations in turn (what a
    SIGKILL leaves): the readers then get the old tokenizer or the new one, always with its own token bytes, the
    new one from the moment its tokenizer.json was complete; the next save leaves no temp directory behind.
    Catches the old save, which replaced token_bytes.npy and tokenizer.json one after the other (a kill between the
    two renames left a mixed pair).
    """
    from helpers import run_with_kill
    other = Tokenizer.train_from_iterator(iter([t[::-1] for t in TRAIN_TEXT]), VOCAB_SIZE)
    old, new = tok.fingerprint(), other.fingerprint()
    tok.save(get_tokenizer_dir())
    total = len(run_with_kill(monkeypatch, lambda: other.save(get_tokenizer_dir()), None)[0])
    assert total >= 5  # token_bytes.npy written and fsynced, tokenizer.json fsynced, the renames
    for k in range(total + 1):
        tok.save(get_tokenizer_dir())
        done, cut = run_with_kill(monkeypatch, lambda: other.save(get_tokenizer_dir()), k)
        assert cut == (k < total)
        marker_done = any(n == "replace" and str(a[1]).endswith(os.path.join("tokenizer.tmp", "tokenizer.json"))
                          for n, a in done)
        loaded = get_tokenizer()
        assert loaded.fingerprint() == (new if marker_done else old), (k, done[-1:])
        assert get_token_bytes("cpu").tolist() == loaded.token_bytes().tolist()
    other.save(get_tokenizer_dir())
    assert sorted(os.listdir(os.path.dirname(get_tokenizer_dir()))) == ["tokenizer"]
    assert get_tokenizer().fingerprint() == new


@pytest.mark.unit
def test_missing_tokenizer_is_a_user_error():
    """Catches a raw FileNotFoundError traceback instead of a one-line hint to run tok_train.py."""
    with pytest.raises(UserError, match=r"tokenizer\.json.*tok_train\.py"):
        get_tokenizer()
    with pytest.raises(UserError, match="tok_train.py"):
        get_token_bytes("cpu")


def _corruptions(data):
    """(description, tokenizer.json text) pairs, each broken in one way."""
    def edit(fn):
        d = json.loads(json.dumps(data))
        fn(d)
        return json.dumps(d)
    ranks = data["mergeable_ranks"]
    return [
        ("truncated", json.dumps(data)[: len(json.dumps(data)) // 2]),
        ("not json", "\x00\x01 garbage"),
        ("wrong format", edit(lambda d: d.update(format="something-else"))),
        ("missing key", edit(lambda d: d.pop("pattern"))),
        ("rank gap", edit(lambda d: d["mergeable_ranks"].pop(300))),
        ("ranks swapped", edit(lambda d: d.update(mergeable_ranks=[ranks[1], ranks[0]] + ranks[2:]))),
        ("bad base64", edit(lambda d: d["mergeable_ranks"][270].__setitem__(0, "!!notbase64!!"))),
        ("duplicate token", edit(lambda d: d["mergeable_ranks"][270].__setitem__(0, ranks[5][0]))),
        ("special ids", edit(lambda d: d["special_tokens"].update({"<|bos|>": 0}))),
        ("vocab size", edit(lambda d: d.update(vocab_size=d["vocab_size"] + 1))),
        ("bad pattern", edit(lambda d: d.update(pattern="(unclosed"))),
        ("empty pattern", edit(lambda d: d.update(pattern=""))),
        ("pattern matching the empty string", edit(lambda d: d.update(pattern=r"\p{L}+|\s*"))),
    ]


@pytest.mark.unit
def test_corrupt_tokenizer_is_a_user_error(tok):
    """Catches loading a damaged file silently (wrong encodings later) or crashing with a raw traceback."""
    d = get_tokenizer_dir()
    tok.save(d)
    path = os.path.join(d, "tokenizer.json")
    data = json.load(open(path))
    for what, text in _corruptions(data):
        with open(path, "w") as f:
            f.write(text)
        with pytest.raises(UserError, match=r"tokenizer\.json.*tok_train\.py") as e:
            get_tokenizer()
        assert "\n" not in str(e.value), what
    tok.save(d)
    np.save(os.path.join(d, "token_bytes.npy"), np.zeros(7, dtype=np.int32))
    with pytest.raises(UserError, match=r"token_bytes\.npy.*tok_train\.py"):
        get_token_bytes("cpu")


@pytest.mark.unit
@pytest.mark.parametrize("pattern, reason", [
    ("", "'pattern' (the split regex) is empty"),
    (r"a*|\s+", r"'pattern' 'a*|\\s+' matches the empty string; tiktoken cannot split text with it"),
])
def test_a_split_pattern_that_matches_nothing_is_one_line_naming_the_file(tok, pattern, reason):
    """
    A tokenizer.json whose split pattern is empty, or matches the empty string: one UserError line naming the file
    and the pattern when it is loaded. tiktoken accepts such a pattern and panics at the first encode (the old code:
    a Rust panic and its backtrace, pyo3_runtime.PanicException "range end index 2 out of range for slice").
    """
    d = get_tokenizer_dir()
    tok.save(d)
    path = os.path.join(d, "tokenizer.json")
    data = json.load(open(path))
    data["pattern"] = pattern
    json.dump(data, open(path, "w"))
    with pytest.raises(UserError) as e:
        get_tokenizer().encode("hello world")
    assert str(e.value) == f"corrupt tokenizer file {path} ({reason}); {TRAIN_HINT} again"


@pytest.mark.unit
def test_vocab_size_too_small():
    """Catches a vocab_size that leaves no room for the 256 bytes and 9 specials being passed on to rustbpe."""
    with pytest.raises(UserError, match="vocab_size"):
        Tokenizer.train_from_iterator(iter(["abc"]), 256 + 8)


@pytest.mark.smoke
def test_tok_train_script(base_dir):
    """Catches a broken tok_train.py: flags, training on the builtin corpus, saving where get_tokenizer() looks."""
    cmd = [sys.executable, os.path.join(REPO, "scripts", "tok_train.py"), "--vocab_size=400", "--max_chars=300000"]
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "vocab size: 400" in r.stdout and "chars/token" in r.stdout and "training time" in r.stdout
    tok = get_tokenizer()
    assert tok.get_vocab_size() == 400
    assert get_token_bytes("cpu").shape == (400,)
    text = "Return the list of files in the directory."
    assert tok.decode(tok.encode(text)) == text

    bad = subprocess.run(cmd[:2] + ["--vocab_size=100"], capture_output=True, text=True, env=env, timeout=60)
    err = [ln for ln in bad.stderr.splitlines() if not ln.startswith("Overriding: ")]
    assert bad.returncode == 2 and len(err) == 1 and err[0].startswith("error: --vocab_size=100")


@pytest.mark.smoke
@pytest.mark.parametrize("train_text", ["", "a"], ids=["empty", "no_merge"])
def test_tok_train_refuses_useless_text_and_keeps_the_tokenizer(tok, base_dir, train_text):
    """
    Catches tok_train.py overwriting a good tokenizer from data it cannot learn from (on the old code: exit 0 and a
    265-token tokenizer, no merges, in place of the old one): an empty train split, and train text with no pair of
    bytes to merge. Expects one `error: --data=...` line, exit 2, and both tokenizer files unchanged byte for byte.
    """
    tok.save(get_tokenizer_dir())
    before = tokenizer_bytes()
    data = base_dir / "data_dir"
    data.mkdir()
    (data / "train.txt").write_text(train_text)
    (data / "val.txt").write_text("some val text")
    cmd = [sys.executable, os.path.join(REPO, "scripts", "tok_train.py"), f"--data={data}", "--vocab_size=300"]
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(base_dir))
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("Overriding: ")]
    assert r.returncode == 2, r.stderr
    assert len(err) == 1 and err[0].startswith(f"error: --data={data}: "), r.stderr
    assert "Traceback" not in r.stderr
    assert tokenizer_bytes() == before
