"""
spell: spell a word letter by letter, or count a letter in it (nanochat's SpellingBee idea; the count calls the tool:
'word'.count('r')), generated offline and deterministically. The words come from the builtin corpus (Python's
documentation, nanotrain.dataset), so they match what the base model read. Train and val never share a word.
"""

import re
from collections import Counter
from functools import lru_cache

from nanotrain.conversation import assistant, output_part, python_part, text_part, user
from nanotrain.dataset import iter_documents, resolve_data_files
from nanotrain.tasks.common import Task, final_int, final_spelling, generated, held_out

SPELL_MIN_COUNT = 5  # a word joins the spelling vocabulary if it occurs this often in the builtin training corpus
SPELL_WORD_LEN = (3, 10)  # word lengths (letters) of the spelling task

SPELL_QUESTIONS = ['Spell the word "{w}".', "How do you spell {w}?", "Spell {w} letter by letter.",
                   "Can you spell '{w}' for me?"]
COUNT_QUESTIONS = ['How many times does the letter "{c}" appear in "{w}"?', "How many {c}'s are in {w}?",
                   "Count the letter '{c}' in the word {w}.", "In the word {w}, how many times does {c} occur?"]


@lru_cache(maxsize=1)
def spell_vocabulary():
    """
    The words of the spelling task: lowercase a-z words of 3-10 letters that occur >= SPELL_MIN_COUNT times in the
    builtin training corpus (built on first use), most frequent first (ties alphabetical).
    Deterministic for a given Python installation (the corpus is its documentation).
    """
    lo, hi = SPELL_WORD_LEN
    pattern = re.compile(rf"\b[a-z]{{{lo},{hi}}}\b")
    counts = Counter()
    for _, text in iter_documents(resolve_data_files("builtin", "train")):
        counts.update(pattern.findall(text))
    return tuple(sorted((w for w, c in counts.items() if c >= SPELL_MIN_COUNT), key=lambda w: (-counts[w], w)))


def _make(split, n, rng):
    words = [w for w in spell_vocabulary() if held_out(w, 10) == (split == "val")]
    out = []
    for _ in range(n):
        w = rng.choice(words)
        spelled = "-".join(w)
        if rng.random() < 0.5:
            question = rng.choice(SPELL_QUESTIONS).format(w=w)
            answer_text = f"{w} is spelled {spelled}.\nAnswer: {spelled}"
            answer = spelled
        else:
            c = rng.choice(w) if rng.random() < 0.7 else rng.choice("abcdefghijklmnopqrstuvwxyz")
            question = rng.choice(COUNT_QUESTIONS).format(w=w, c=c)
            n = w.count(c)
            answer_text = [text_part(f"Spelling {w}: {spelled}\nCounting {c}: "), python_part(f"'{w}'.count('{c}')"),
                           output_part(str(n)), text_part(f"\nAnswer: {n}")]
            answer = str(n)
        out.append({"messages": [user(question), assistant(answer_text)], "task": "spell", "answer": answer})
    return out


class Spell(Task):
    """The spell task (see the module docstring): rows {"messages", "task": "spell", "answer": "s-p-e-l-l" or a
    count}. Graded on the reply's final segment (after the last "answer", else the last line): a count must be
    exactly one integer equal to the answer; a spelling exactly one run of single letters separated by '-' or ','
    ("s-t-r-i-n-g", "S, T, R, I, N, G") that spells the word."""
    name = "spell"
    rows = {"train": 3000, "val": 200}

    def load(self, split, source=None, seed=0):
        return generated(self, split, seed, _make)

    def grade(self, conversation, reply):
        if conversation["answer"].isdigit():
            return final_int(reply) == int(conversation["answer"])
        return final_spelling(reply) == conversation["answer"].replace("-", "")
