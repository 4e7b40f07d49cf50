"""
Trains the BPE tokenizer (rustbpe merges, GPT-4-style split with 1-2 digit numbers) on the train split's documents and
saves it to <base_dir>/tokenizer/ (tokenizer.json, token_bytes.npy), and reports the compression ratio (characters
per token) on the first documents of the val split. Refuses (one error line, exit 2, the old tokenizer left as it
was) a split with no text or train text too small to learn any merge; the files are replaced only once all is done.

    python scripts/tok_train.py                                         # builtin corpus (offline), 4096 tokens
    python scripts/tok_train.py --data=fineweb-edu --vocab_size=32768   # as in nanochat
"""

import nanotrain.interrupt  # noqa: F401 (first, before torch: from here on a Ctrl-C is one line and exit 130)

# isort: split
import os
import time

from nanotrain.common import run_script
from nanotrain.dataset import iter_documents, resolve_data_files
from nanotrain.errors import UserError, os_errors_name
from nanotrain.tokenizer import MIN_VOCAB_SIZE, Tokenizer, get_tokenizer_dir

vocab_size = 4096  # tokens in the vocabulary, the 9 special tokens included (so 256 bytes + 3831 merges)
max_chars = 2_000_000_000  # train on at most this many characters (the capped documents, in order)
doc_cap = 10_000  # characters kept per document (its beginning)
data = "builtin"  # data source: builtin (offline), fineweb-edu, or a directory / glob of .parquet/.jsonl/.txt files

from nanotrain.configurator import configure, ints  # noqa: E402

config = configure(globals(), rules={  # vocab_size: stricter than other scripts' (any int >= 1)
    "vocab_size": ints(MIN_VOCAB_SIZE, note=f"256 bytes + {MIN_VOCAB_SIZE - 256} special tokens")})

EVAL_DOCS = 1000  # the compression ratio is measured on the first EVAL_DOCS val documents ...
EVAL_CHARS = 10_000_000  # ... or fewer, if they reach EVAL_CHARS characters


def capped_texts(files, stats):
    """The train documents cut to doc_cap characters, until max_chars characters; counts them into stats."""
    for _, text in iter_documents(files):
        text = text[:doc_cap]
        stats["docs"] += 1
        stats["chars"] += len(text)
        yield text
        if stats["chars"] >= max_chars:
            return


def main():
    train_files = resolve_data_files(data, "train")
    val_files = resolve_data_files(data, "val")
    print(f"training a {vocab_size}-token BPE tokenizer on --data={data} ({len(train_files)} train files), "
          f"at most {max_chars:,} chars, {doc_cap:,} chars per document")
    stats = {"docs": 0, "chars": 0}
    t0 = time.time()
    tokenizer = Tokenizer.train_from_iterator(capped_texts(train_files, stats), vocab_size)
    train_seconds = time.time() - t0
    if tokenizer.get_vocab_size() == MIN_VOCAB_SIZE < vocab_size:
        raise UserError(f"--data={data}: the train text ({stats['docs']:,} documents, {stats['chars']:,} chars) is "
                        f"too small to learn any BPE merge; expected more text (no tokenizer was written)")

    val_texts, val_chars = [], 0
    for _, text in iter_documents(val_files):
        val_texts.append(text)
        val_chars += len(text)
        if len(val_texts) >= EVAL_DOCS or val_chars >= EVAL_CHARS:
            break
    val_tokens = sum(len(ids) for ids in tokenizer.encode(val_texts))
    out_dir = get_tokenizer_dir()
    with os_errors_name(out_dir):  # its errors name the tokenizer files (or the directory), not their temp files
        tokenizer.save(out_dir)

    print(f"trained on {stats['docs']:,} documents, {stats['chars']:,} chars")
    if tokenizer.get_vocab_size() < vocab_size:
        print(f"warning: the text ran out of pairs to merge: vocab size {tokenizer.get_vocab_size()} < {vocab_size}")
    print(f"vocab size: {tokenizer.get_vocab_size()}")
    print(f"training time: {train_seconds:.2f} s")
    print(f"compression: {val_chars / max(val_tokens, 1):.3f} chars/token on {len(val_texts)} val documents "
          f"({val_chars:,} chars, {val_tokens:,} tokens)")
    print(f"saved to {os.path.join(out_dir, 'tokenizer.json')}")


if __name__ == "__main__":
    run_script(main)
