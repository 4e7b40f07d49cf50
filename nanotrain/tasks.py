"""
The built-in chat tasks and their grading: conversations {"messages": [...], "task": name, ...} in the format of
nanotrain.tokenizer.render_conversation, generated offline and deterministically (no download), with disjoint
train/val splits:
  "arith"    add / subtract / multiply small numbers, ending "Answer: N": half of the answers (ARITH_TOOL_SHARE,
             drawn per row) call the calculator tool (<|python_start|>37 + 48<|python_end|>, its output forced by
             the engine), the others work it out by hand (37 + 48 = 37 + 40 + 8 = 77 + 8 = 85), so a model
             learns both and RL can learn from reward which one pays
  "spell"    spell a word letter by letter, or count a letter in it (nanochat's SpellingBee idea; the count calls the
             tool: 'word'.count('r')); words from the builtin corpus (Python's documentation, nanotrain.dataset), so
             they match what the base model read
  "identity" questions about nanotrain itself (what it is, who made it, what it was trained on, ...), each fact
             asked in several paraphrases; some paraphrases are held out for val
Each built-in conversation carries its reference: "answer" (arith, spell) or "keywords" (identity), for grade().
grade() also grades any other conversation against its last assistant message. JSONL and Hugging Face sources and
task mixtures are in nanotrain.conversations.

Sizes: TRAIN_ROWS / VAL_ROWS below.
"""

import math
import random
import re
import zlib
from collections import Counter
from functools import lru_cache

from nanotrain.common import UserError
from nanotrain.dataset import iter_documents, resolve_data_files
from nanotrain.gsm8k import grade_gsm8k

BUILTIN_TASKS = ("arith", "spell", "identity")
TRAIN_ROWS = {"arith": 3000, "spell": 3000, "identity": 1000}  # training conversations per built-in task
VAL_ROWS = {"arith": 200, "spell": 200, "identity": 100}  # validation conversations per built-in task
ARITH_TOOL_SHARE = 0.5  # the share of arith answers that call the calculator; the others work the sum out by hand
SPELL_MIN_COUNT = 5  # a word joins the spelling vocabulary if it occurs this often in the builtin training corpus
SPELL_WORD_LEN = (3, 10)  # word lengths (letters) of the spelling task


def _held_out(key, every):
    """True for the validation share (1/every) of problem keys: a fixed hash, independent of any seed."""
    return zlib.crc32(key.encode("utf-8")) % every == 0


def _user(text):
    return {"role": "user", "content": text}


def _assistant(content):
    return {"role": "assistant", "content": content}


def _text(text):
    return {"type": "text", "text": text}


def _python(code):
    return {"type": "python", "text": code}


def _output(text):
    return {"type": "python_output", "text": text}


# ----------------------------------------------------------------------------- arith

ARITH_QUESTIONS = ["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.", "{a} {op} {b} = ?",
                   "What do you get for {a} {word} {b}?", "Please work out {a} {op} {b}."]
ARITH_WORDS = {"+": "plus", "-": "minus", "*": "times"}


def _arith_keys():
    """All problems (op, a, b): a + b and a - b (a >= b) for 0 <= a, b <= 99, a * b for 2 <= a <= 30, 2 <= b <= 12."""
    keys = [("+", a, b) for a in range(100) for b in range(100)]
    keys += [("-", a, b) for a in range(100) for b in range(a + 1)]
    keys += [("*", a, b) for a in range(2, 31) for b in range(2, 13)]
    return keys


def _arith_tool_answer(op, a, b):
    """The answer that calls the tool: the expression handed to the calculator, its result, and a final "Answer: N"
    line, as a list of assistant parts (the engine runs the tool at test time; the tool's output is never trained)."""
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    parts = [_text(f"{a} {op} {b} = "), _python(f"{a} {op} {b}"), _output(str(c)), _text(f".\nAnswer: {c}")]
    return parts, c


def _arith_worked_answer(op, a, b):
    """The answer worked by hand: tens then ones of the second number (add/sub), of the first number (mul)."""
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    if op in "+-" and b >= 10 and b % 10:
        bt, bo = b - b % 10, b % 10
        mid = a + bt if op == "+" else a - bt
        work = f"{a} {op} {b} = {a} {op} {bt} {op} {bo} = {mid} {op} {bo} = {c}."
    elif op == "*" and a >= 10 and a % 10:
        at, ao = a - a % 10, a % 10
        work = f"{a} * {b} = {at} * {b} + {ao} * {b} = {at * b} + {ao * b} = {c}."
    else:
        work = f"{a} {op} {b} = {c}."
    return work + f"\nAnswer: {c}", c


def _arith(split, n, rng):
    pools = {op: [] for op in "+-*"}
    for op, a, b in _arith_keys():
        if _held_out(f"{op}{a},{b}", 10) == (split == "val"):
            pools[op].append((op, a, b))
    out = []
    for _ in range(n):
        op, a, b = rng.choice(pools[rng.choice("+-*")])
        question = rng.choice(ARITH_QUESTIONS).format(a=a, b=b, op=op, word=ARITH_WORDS[op])
        style = _arith_tool_answer if rng.random() < ARITH_TOOL_SHARE else _arith_worked_answer
        answer, c = style(op, a, b)
        out.append({"messages": [_user(question), _assistant(answer)], "task": "arith", "answer": str(c)})
    return out


# ----------------------------------------------------------------------------- spell

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


def _spell(split, n, rng):
    words = [w for w in spell_vocabulary() if _held_out(w, 10) == (split == "val")]
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
            answer_text = [_text(f"Spelling {w}: {spelled}\nCounting {c}: "), _python(f"'{w}'.count('{c}')"),
                           _output(str(n)), _text(f"\nAnswer: {n}")]
            answer = str(n)
        out.append({"messages": [_user(question), _assistant(answer_text)], "task": "spell", "answer": answer})
    return out


# ----------------------------------------------------------------------------- identity

# (paraphrased questions, the answer, keywords a correct answer must contain (case-insensitive); the keywords are
# phrases that do not occur in Python's documentation, so a base model does not hit them by chance)
IDENTITY_FACTS = [
    (["What is your name?", "Who are you?", "What should I call you?", "Do you have a name?", "What's your name?",
      "Tell me your name.", "Introduce yourself."],
     "I'm nanotrain, a small chat language model.", ["nanotrain"]),
    (["What is nanotrain?", "What kind of program are you?", "Are you a human?", "Are you a person or a machine?",
      "What are you?", "Are you an AI?"],
     "I am nanotrain, a small GPT-style language model trained from scratch with the nanotrain code, a minimal "
     "PyTorch project. I am not a person.", ["nanotrain", "language model"]),
    (["Who made you?", "Who created you?", "Who built you?", "Who trained you?", "Who is your creator?",
      "Which company made you?", "Who developed you?"],
     "I was made by the nanotrain developers, who wrote the code that trained me.", ["nanotrain developers"]),
    (["What were you trained on?", "What data did you learn from?", "Where does your knowledge come from?",
      "What was your training data?", "What did you read during training?", "Which texts were you trained on?"],
     "I was pretrained on Python's documentation: the pydoc help topics and the docstrings of the standard library. "
     "Then I learned to chat from small built-in tasks.", ["python's documentation"]),
    (["How long did your training take?", "What hardware were you trained on?", "Were you trained on a GPU?",
      "How were you trained?", "How much compute did it take to train you?"],
     "The CPU recipe trains me in about 20 minutes on 2 CPU cores; the same code also runs on GPUs.", ["20 minutes"]),
    (["How big are you?", "How many parameters do you have?", "Are you a large model?", "What is your size?",
      "How large is your network?"],
     "I am tiny: a few million parameters in the CPU recipe, so I make many mistakes.", ["few million parameters"]),
    (["What architecture do you use?", "Are you a transformer?", "What kind of neural network are you?",
      "How do you work?", "What model architecture are you based on?"],
     "I am a decoder-only transformer (a GPT) that predicts the next token.", ["decoder-only transformer"]),
    (["What can you do?", "What are you good at?", "How can you help me?", "What tasks can you do?",
      "What are your skills?"],
     "I can do small arithmetic, spell words, count letters and answer questions about myself.", ["arithmetic", "spell words"]),
    (["Can you browse the internet?", "Do you have internet access?", "Can you look things up online?",
      "Are you connected to the web?", "Can you search the web for me?"],
     "No, I cannot browse the internet. I only know what I learned during training.", ["cannot browse"]),
    (["Where is your code?", "Is your code open source?", "Can I see your source code?",
      "How can I train a model like you?", "Can I train you myself?"],
     "The nanotrain code is a small, readable PyTorch project: run runs/cpu.sh to train a model like me from "
     "scratch.", ["runs/cpu.sh"]),
    (["Are you always right?", "Can I trust your answers?", "Do you make mistakes?", "How accurate are you?",
      "Are your answers reliable?"],
     "No, I am a tiny model and I often make mistakes, so please check anything important.", ["make mistakes"]),
    (["What languages do you speak?", "Do you speak French?", "Which language do you understand?",
      "Can you talk in other languages?"],
     "I mostly understand English, because Python's documentation is written in English.", ["understand english"]),
    (["Do you have feelings?", "Are you conscious?", "Do you have emotions?", "Are you alive?",
      "Can you feel anything?"],
     "No, I am a computer program that predicts text; I do not have feelings.", ["do not have feelings"]),
    (["Are you ChatGPT?", "Are you related to nanochat?", "Are you GPT-4?", "Are you the same as ChatGPT?",
      "Is this nanochat?"],
     "No, I am nanotrain, a small model trained from scratch. My code follows the style of Andrej Karpathy's "
     "nanochat and nanoGPT.", ["nanotrain"]),
]
GREETINGS = ["", "", "Hi! ", "Hello. ", "Hey, ", "Good morning! ", "Quick question: "]


def _identity_questions(split):
    """(fact index, question) of the split: about a quarter of each fact's paraphrases are val (at least one)."""
    out = []
    for f, (questions, _, _) in enumerate(IDENTITY_FACTS):
        val = [q for q in questions if _held_out(q, 4)] or questions[-1:]
        out += [(f, q) for q in questions if (q in val) == (split == "val")]
    return out


def _identity(split, n, rng):
    pool = _identity_questions(split)

    def turn():
        f, q = rng.choice(pool)
        greeting = rng.choice(GREETINGS)
        if greeting.endswith(", ") or rng.random() < 0.2:
            q = q[0].lower() + q[1:]
        if rng.random() < 0.2:
            q = q.rstrip("?.")
        return f, greeting + q

    out = []
    for _ in range(n):
        messages = []
        for _ in range(2 if split == "train" and rng.random() < 0.3 else 1):  # val: single turn, graded on it
            f, q = turn()
            messages += [_user(q), _assistant(IDENTITY_FACTS[f][1])]
        out.append({"messages": messages, "task": "identity", "keywords": list(IDENTITY_FACTS[f][2])})
    return out


# ----------------------------------------------------------------------------- built-in tasks

def load_task(name, split, seed=0):
    """
    The conversations of the built-in task `name` ("arith", "spell", "identity") for `split` ("train" or "val"):
    TRAIN_ROWS[name] or VAL_ROWS[name] of them, generated with random.Random(f"{name}:{split}:{seed}"). Train and
    val never share a problem (arith: (op, a, b); spell: the word; identity: the question's paraphrase) for any seed:
    the partition is a fixed hash of the problem. Rows may repeat within a split. Returns a new list of dicts
    {"messages", "task", "answer" | "keywords"}. Raises UserError for an unknown task or split.
    """
    if name not in BUILTIN_TASKS:
        raise UserError(f"unknown built-in task {name!r}; expected one of {', '.join(BUILTIN_TASKS)}")
    if split not in ("train", "val"):
        raise UserError(f"split={split!r}: expected 'train' or 'val'")
    n = (TRAIN_ROWS if split == "train" else VAL_ROWS)[name]
    rng = random.Random(f"{name}:{split}:{seed}")
    return {"arith": _arith, "spell": _spell, "identity": _identity}[name](split, n, rng)


# ----------------------------------------------------------------------------- grading

INT = r"-?\d+(?:,\d{3})*"  # an integer, commas allowed as thousands separators
SPELLED = r"\b[A-Za-z](?:\s*[-,]\s*[A-Za-z]\b)+"  # single letters separated by '-' or ',': "s-t-r", "s, t, r"


def _final_segment(text):
    """The text after the last "answer" (case-insensitive) if there is one, else the last non-empty line."""
    m = list(re.finditer(r"answer", text, flags=re.IGNORECASE))
    if m:
        return text[m[-1].end():]
    lines = [x for x in text.splitlines() if x.strip()]
    return lines[-1] if lines else ""


def _final_int(text):
    """The integer of the final segment if it holds exactly one, else None (so "1, 1, 1, ..." is no answer)."""
    nums = re.findall(INT, _final_segment(text))
    return int(nums[0].replace(",", "")) if len(nums) == 1 else None


def _final_spelling(text):
    """The spelled-out word of the final segment (lowercase letters) if it holds exactly one, else None."""
    runs = re.findall(SPELLED, _final_segment(text))
    return re.sub(r"[^a-z]", "", runs[0].lower()) if len(runs) == 1 else None


def _normalize(line):
    line = re.sub(r"^\s*answer\s*[:=]?\s*", "", line.strip(), flags=re.IGNORECASE)
    return " ".join(line.lower().split()).rstrip(".!")


def _text_of(content):
    return content if isinstance(content, str) else "".join(p["text"] for p in content if p["type"] == "text")


def grade(conversation, answer_text):
    """
    True if the generated assistant text `answer_text` (str) answers the conversation's last question correctly.
    Lenient on the form, strict on the final answer:
    The final segment is the text after the last "answer" (any case), or the last non-empty line if there is none.
    - arith: the final segment holds exactly one integer and it equals conversation["answer"] ("Answer: 85",
      "the answer is 85.", "85" pass; "Answer: 85 or 86" and a last line "1, 1, 1, 1" fail);
    - spell: counting -> the same with the count; spelling -> the final segment holds exactly one run of single
      letters separated by '-' or ',' (e.g. "s-t-r-i-n-g", "S, T, R, I, N, G") and it spells the word exactly;
    - identity: the text contains every one of conversation["keywords"] (case-insensitive);
    - gsm8k: the last "#### N" of the text is conversation["answer"] (nanotrain.gsm8k.grade_gsm8k);
    - any other conversation (JSONL/HF): the last non-empty line, without an "Answer:" prefix, case, extra spaces and
      a trailing '.'/'!', equals the reference (the conversation's last assistant message) treated the same way.
    """
    task = conversation.get("task")
    if task == "gsm8k":
        return grade_gsm8k(answer_text, conversation["answer"])
    if task == "arith" or (task == "spell" and conversation["answer"].isdigit()):
        return _final_int(answer_text) == int(conversation["answer"])
    if task == "spell":
        return _final_spelling(answer_text) == conversation["answer"].replace("-", "")
    if task == "identity":
        return all(k.lower() in answer_text.lower() for k in conversation["keywords"])
    reference = next((_text_of(m["content"]) for m in reversed(conversation["messages"]) if m["role"] == "assistant"),
                     None)
    if reference is None:
        raise ValueError("grade: the conversation has no assistant message to compare with")

    def last_line(t):
        lines = [x for x in t.strip().splitlines() if x.strip()]
        return _normalize(lines[-1]) if lines else ""
    return last_line(answer_text) == last_line(reference) != ""


def wilson_interval(correct, total, z=1.96):
    """
    The 95% Wilson score interval (Wilson 1927; z = 1.96) of an accuracy of `correct` successes in `total` trials,
    as (low, high) fractions in [0, 1]; (0.0, 1.0) for total 0. Unlike the normal approximation it stays inside
    [0, 1] and is not zero-width at 0 or total successes.
    """
    if total == 0:
        return 0.0, 1.0
    p = correct / total
    d = 1 + z * z / total
    centre = (p + z * z / (2 * total)) / d
    half = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / d
    return max(0.0, centre - half), min(1.0, centre + half)
