"""
Chat data for mid-training, SFT and chat eval: conversations {"messages": [...], "task": name, ...} in the format of
nanotrain.tokenizer.render_conversation.

Sources:
- built-in tasks, generated offline and deterministically (no download), with disjoint train/val splits:
  "arith"    add / subtract / multiply small numbers, a short worked answer and a final "Answer: N" line
  "spell"    spell a word letter by letter, or count a letter in it (nanochat's SpellingBee idea); words from the
             builtin corpus (Python's documentation, nanotrain.dataset), so they match what the base model read
  "identity" questions about nanotrain itself (what it is, who made it, what it was trained on, ...), each fact
             asked in several paraphrases; some paraphrases are held out for val
  Each built-in conversation carries its reference: "answer" (arith, spell) or "keywords" (identity), for grade().
- JSONL files (load_jsonl) and Hugging Face data sets (load_hf): rows with a "messages" list; every row is validated.
- a weighted mixture of all of these (load_task_mixture), e.g. "arith:1,spell:1,identity:2,jsonl:/data/chat.jsonl".

Sizes: TRAIN_ROWS / VAL_ROWS below. The CPU recipe (depth 4, max_seq_len 256, ~5-8 minutes of mid-training + SFT on
2 cores, ~1-2 M tokens) sees each built-in training row a few times; conversations are 30-90 tokens long.
"""

import json
import math
import os
import random
import re
import urllib.parse
import urllib.request
import zlib
from functools import lru_cache

from nanotrain.common import UserError, get_base_dir, print0
from nanotrain.tokenizer import chat_messages

BUILTIN_TASKS = ("arith", "spell", "identity")
TRAIN_ROWS = {"arith": 3000, "spell": 3000, "identity": 1000}  # training conversations per built-in task
VAL_ROWS = {"arith": 200, "spell": 200, "identity": 100}  # validation conversations per built-in task
HOLDOUT_EVERY = 20  # JSONL / HF sources without their own validation split: every 20th row (0, 20, 40, ...) is val
SPELL_MIN_COUNT = 5  # a word joins the spelling vocabulary if it occurs this often in the builtin training corpus
SPELL_WORD_LEN = (3, 10)  # word lengths (letters) of the spelling task
DATA_HINT = "use the built-in tasks (arith, spell, identity) or a local JSONL file (jsonl:/path/file.jsonl)"


def _held_out(key, every):
    """True for the validation share (1/every) of problem keys: a fixed hash, independent of any seed."""
    return zlib.crc32(key.encode("utf-8")) % every == 0


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


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


def _arith_answer(op, a, b):
    """The worked answer: tens then ones of the second number (add/sub), of the first number (mul)."""
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
        answer, c = _arith_answer(op, a, b)
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
    builtin training corpus (built on first use), most frequent first (ties alphabetical). About 3,000 words.
    Deterministic for a given Python installation (the corpus is its documentation).
    """
    from collections import Counter

    from nanotrain.dataset import iter_documents, resolve_data_files
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
            positions = [str(i + 1) for i, ch in enumerate(w) if ch == c]
            if not positions:
                found = f"The letter {c} does not appear."
            elif len(positions) == 1:
                found = f"The letter {c} is at position {positions[0]}."
            else:
                found = f"The letter {c} is at positions {', '.join(positions)}."
            answer_text = f"Spelling {w}: {spelled}\n{found}\nAnswer: {len(positions)}"
            answer = str(len(positions))
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
    - any other conversation (JSONL/HF): the last non-empty line, without an "Answer:" prefix, case, extra spaces and
      a trailing '.'/'!', equals the reference (the conversation's last assistant message) treated the same way.
    """
    task = conversation.get("task")
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


# ----------------------------------------------------------------------------- JSONL and Hugging Face data

def validate_conversation(obj):
    """
    None if `obj` is a valid training conversation, else a short description of what is wrong: not an object with a
    "messages" list, malformed or misordered messages (see nanotrain.tokenizer.chat_messages: an optional system
    message first, then user and assistant alternating from the user), empty content (a blank string, an empty list
    of parts or a blank text/python part), or a last message that is not the assistant's (nothing to train on).
    """
    if not isinstance(obj, dict) or "messages" not in obj:
        return 'expected a JSON object with a "messages" list'
    try:
        chat_messages(obj)
    except ValueError as e:
        return str(e)
    for i, m in enumerate(obj["messages"]):
        c = m["content"]
        if isinstance(c, str) and not c.strip():
            return f"message {i} ({m['role']}) has empty content"
        if isinstance(c, list):
            if not c:
                return f"message {i} (assistant) has an empty list of parts"
            for j, p in enumerate(c):
                if p["type"] != "python_output" and not p["text"].strip():
                    return f"message {i} (assistant) part {j} ({p['type']}) is empty"
    if obj["messages"][-1]["role"] != "assistant":
        return "the last message must be the assistant's (a training conversation ends with a reply)"
    return None


def load_jsonl(path, skip_bad_rows=False):
    """
    Reads conversations from a JSONL file: one JSON object {"messages": [...]} per line (blank lines are ignored).
    Returns (conversations, n_skipped): a list of {"messages", "task": "jsonl"} in file order and the number of bad
    lines skipped. A bad line (not UTF-8 JSON, or validate_conversation fails) raises
    UserError("{path}:{lineno}: what is wrong"), unless skip_bad_rows, in which case it is counted and skipped.
    Raises UserError if the file does not exist.
    """
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such JSONL file")
    out, skipped = [], 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
                problem = validate_conversation(obj)
            except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
                problem = f"not a valid UTF-8 JSON line ({str(e).splitlines()[0][:80]})"
            if problem is not None:
                if not skip_bad_rows:
                    raise UserError(f"{path}:{lineno}: {problem} (--skip_bad_rows=True skips such lines)")
                skipped += 1
                continue
            out.append({"messages": obj["messages"], "task": "jsonl"})
    return out, skipped


def _hub_unreachable(name):
    """A UserError for loading the hub data set `name` when offline, or None when the hub looks reachable."""
    from nanotrain.dataset import _check_reachable  # the same fail-fast TCP check as the fineweb-edu download

    def fail(why):
        return UserError(f"could not load the Hugging Face data set {name} ({why}); {DATA_HINT}")
    if any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
           for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")):
        return None  # offline mode: datasets uses its cache and fails quickly when the data set is not there
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    if urllib.request.getproxies().get(urllib.parse.urlparse(endpoint).scheme):
        return None  # behind a proxy we cannot test the route ourselves
    try:
        _check_reachable(endpoint)
    except OSError as e:
        return fail(f"offline? cannot reach {endpoint}: {e}; with HF_HUB_OFFLINE=1 a cached copy is used")
    return None


def _split_rows(rows, split):
    """Every HOLDOUT_EVERY-th row (0, 20, ...) is val, the rest train."""
    return [r for i, r in enumerate(rows) if (i % HOLDOUT_EVERY == 0) == (split == "val")]


def load_hf(name_or_path, split, skip_bad_rows=False):
    """
    Conversations of a Hugging Face data set with a "messages" column, through `datasets`: a local .parquet / .json /
    .jsonl file or a directory of them, or a hub name such as HuggingFaceTB/smol-smoltalk (downloaded into
    <base_dir>/hf_datasets). `split` is "train" or "val": val is the data set's "validation", "val" or "test" split
    if it has one, else every HOLDOUT_EVERY-th row of "train" (and train the other rows).
    Returns (conversations, n_skipped) like load_jsonl, each {"messages", "task": "hf"}. A bad row raises
    UserError("{name}[{hf split}] row {i}: what is wrong") unless skip_bad_rows. Raises UserError when the hub is not
    reachable (fails within ~5 s; HF_HUB_OFFLINE=1 uses the cache only) or the data set cannot be loaded.
    """
    import datasets
    if split not in ("train", "val"):
        raise UserError(f"split={split!r}: expected 'train' or 'val'")
    cache_dir = os.path.join(get_base_dir(), "hf_datasets")
    if os.path.isfile(name_or_path):
        builder = "parquet" if name_or_path.endswith(".parquet") else "json"
        args = dict(path=builder, data_files={"train": name_or_path})
    elif os.path.isdir(name_or_path):
        args = dict(path=name_or_path)
    else:
        if name_or_path.startswith((".", "/")) or name_or_path.count("/") != 1:
            raise UserError(f"hf data set {name_or_path!r}: no such local file or directory, and not a hub name "
                            f"like owner/name; {DATA_HINT}")
        error = _hub_unreachable(name_or_path)
        if error is not None:
            raise error
        args = dict(path=name_or_path)
    try:
        ds = datasets.load_dataset(**args, cache_dir=cache_dir)
    except Exception as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"could not load the Hugging Face data set {name_or_path} ({type(e).__name__}: {reason}); "
                        f"{DATA_HINT}") from None
    val_name = next((s for s in ("validation", "val", "test") if s in ds), None)
    hf_split = "train" if split == "train" or val_name is None else val_name
    if hf_split not in ds:
        raise UserError(f"hf data set {name_or_path}: no {hf_split!r} split (splits: {', '.join(ds)})")
    table = ds[hf_split]
    if "messages" not in table.column_names:
        raise UserError(f"hf data set {name_or_path}[{hf_split}]: no 'messages' column "
                        f"(columns: {', '.join(table.column_names)})")
    out, skipped = [], 0
    for i, messages in enumerate(table["messages"]):
        obj = {"messages": messages}
        problem = validate_conversation(obj)
        if problem is not None:
            if not skip_bad_rows:
                raise UserError(f"{name_or_path}[{hf_split}] row {i}: {problem} (--skip_bad_rows=True skips such rows)")
            skipped += 1
            continue
        out.append({"messages": [{"role": m["role"], "content": m["content"]} for m in messages], "task": "hf"})
    if val_name is None:
        out = _split_rows(out, split)
    return out, skipped


# ----------------------------------------------------------------------------- mixtures

def parse_task_spec(spec):
    """
    Parses a task mixture spec into [(kind, arg, weight)]: comma-separated parts "arith", "spell", "identity",
    "jsonl:PATH" or "hf:NAME_OR_PATH", each optionally followed by ":WEIGHT" (a number > 0, default 1), e.g.
    "arith:1,spell:1,identity:2,jsonl:/data/chat.jsonl:1,hf:HuggingFaceTB/smol-smoltalk:0.5". kind is the task name,
    "jsonl" or "hf"; arg is the path/name (None for built-ins). Paths may not contain ','.
    Raises UserError naming the bad part.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"task mixture {spec!r}: expected comma-separated parts like 'arith:1,spell:1,identity:2'")
    out = []
    for part in (p.strip() for p in spec.split(",")):
        expected = (f"expected NAME[:WEIGHT] with NAME one of {', '.join(BUILTIN_TASKS)}, "
                    f"or jsonl:PATH[:WEIGHT] or hf:NAME_OR_PATH[:WEIGHT], and WEIGHT a number > 0")
        if part.startswith(("jsonl:", "hf:")):
            kind, rest = part.split(":", 1)
            head, sep, tail = rest.rpartition(":")
            arg, raw = (head, tail) if sep and re.fullmatch(r"[0-9.eE+-]+", tail) else (rest, "1")
            if not arg:
                raise UserError(f"task mixture part {part!r}: missing the {kind} path or name; {expected}")
        else:
            kind, _, raw = part.partition(":")
            raw, arg = raw or "1", None
            if kind not in BUILTIN_TASKS:
                raise UserError(f"task mixture part {part!r}: unknown task {kind!r}; {expected}")
        try:
            weight = float(raw)
        except ValueError:
            raise UserError(f"task mixture part {part!r}: weight {raw!r} is not a number; {expected}") from None
        if not (math.isfinite(weight) and weight > 0):
            raise UserError(f"task mixture part {part!r}: weight must be a number > 0; {expected}")
        out.append((kind, arg, weight))
    return out


def load_task_mixture(spec, split, seed=0, skip_bad_rows=False):
    """
    The conversations of a task mixture (see parse_task_spec) for `split` ("train" or "val"), shuffled with
    random.Random(seed). For train, a weight is a multiplicity: 2 puts every row of that source in twice, 0.5 a
    seeded random half of its rows, 1.5 all once plus a seeded half. For val every source's validation rows are
    taken once (weights do not apply). Built-ins come from load_task(name, split, seed); JSONL files and hf sources
    without a validation split give every HOLDOUT_EVERY-th row to val. Rows repeated by a weight are the same dict
    objects (do not mutate them). Skipped bad rows (skip_bad_rows=True) are reported with print0.
    Returns list[dict]. Raises UserError for a bad spec, a bad row (file:line) or an unloadable source.
    """
    if split not in ("train", "val"):
        raise UserError(f"split={split!r}: expected 'train' or 'val'")
    out = []
    for index, (kind, arg, weight) in enumerate(parse_task_spec(spec)):
        if kind == "jsonl":
            rows, skipped = load_jsonl(arg, skip_bad_rows)
            rows = _split_rows(rows, split)
        elif kind == "hf":
            rows, skipped = load_hf(arg, split, skip_bad_rows)
        else:
            rows, skipped = load_task(kind, split, seed), 0
        if skipped:
            print0(f"warning: skipped {skipped} bad rows of {kind}:{arg}")
        if split == "val":
            out += rows
            continue
        whole, frac = int(weight), weight - int(weight)
        out += rows * whole
        if frac > 0:
            out += random.Random(f"{seed}:{index}").sample(rows, round(frac * len(rows)))
    random.Random(seed).shuffle(out)
    return out
