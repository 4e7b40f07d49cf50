"""
GSM8K as tool-calling conversations (nanotrain/tasks/gsm8k.py): the <<expr=result>> annotations become calculator calls,
the final "#### N" is graded, the loader reads the hub's file layout (a local parquet copy written here, so the
online code path runs offline), and offline without a copy it is one line within seconds.
"""

import time

import pytest

from nanotrain.calculator import calculate
from nanotrain.errors import UserError
from nanotrain.tasks.gsm8k import grade_gsm8k, gsm8k_conversation
from nanotrain.tasks.registry import TASKS, grade, load_task_mixture

pytestmark = pytest.mark.unit

# written for the test, in GSM8K's format
QUESTION = "Ann has 3 boxes of 12 pens and gives away 1,000 / 100 pens. How many pens are left?"
ANSWER = "She has 3 * 12 = <<3*12=36>>36 pens.\nShe gives away 1000/100 = <<1000/100=10>>10.\n" \
         "36 - 10 = <<36-10=26>>26\n#### 26"


def test_annotations_become_tool_calls():
    """The parts, literally: text, python, python_output, with GSM8K's own copy of each result kept in the text.
    Catches dropping the text after an annotation, splitting at the first '=' of the expression, and a lost final
    line. Each expression, run through the real calculator, gives the annotated result."""
    conv = gsm8k_conversation(QUESTION, ANSWER)
    assert conv["answer"] == "26" and conv["task"] == "gsm8k"
    assert conv["messages"][0] == {"role": "user", "content": QUESTION}
    assert conv["messages"][1]["content"] == [
        {"type": "text", "text": "She has 3 * 12 = "}, {"type": "python", "text": "3*12"},
        {"type": "python_output", "text": "36"}, {"type": "text", "text": "36 pens.\nShe gives away 1000/100 = "},
        {"type": "python", "text": "1000/100"}, {"type": "python_output", "text": "10"},
        {"type": "text", "text": "10.\n36 - 10 = "}, {"type": "python", "text": "36-10"},
        {"type": "python_output", "text": "26"}, {"type": "text", "text": "26\n#### 26"}]
    parts = conv["messages"][1]["content"]
    for call, out in zip(parts[1::3], parts[2::3]):
        assert calculate(call["text"]) == out["text"]
    with pytest.raises(ValueError, match="####"):
        gsm8k_conversation(QUESTION, "36 pens")


def test_grader_on_near_misses():
    """Hand verdicts of OpenAI's grade-school-math extraction (regex '#### (-?[0-9.,]+)', its first match, commas
    removed, then exact string match): commas removed, the first '####' wins, a trailing '.' or no space after '####'
    is wrong, signs and trailing text. Catches taking the last '####', stripping the '.', and a lenient '####\\s*'."""
    conv = {"task": "gsm8k", "answer": "1200", "messages": []}
    verdicts = {"#### 1200": True, "#### 1,200": True, "so #### 1200 pens": True, "#### 1200.": False,
                "#### 12 then #### 1200": False, "#### 1200 then #### 12": True, "#### -1200": False,
                "1200": False, "#### 120": False, "####1200": False, "# 1200": False, "": False}
    for text, want in verdicts.items():
        assert grade(conv, text) is want, text
    assert grade_gsm8k("#### -5", "-5") and not grade_gsm8k("#### 5", "-5")


def test_loader_reads_the_hub_layout_from_a_local_copy(tmp_path):
    """A directory with main/train-00000-of-00001.parquet and main/test-... (the hub's files) loads through the
    mixture spec gsm8k:PATH, rows in order; a row that cannot be rendered is one line naming split and row."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    (tmp_path / "main").mkdir()
    rows = [(QUESTION, ANSWER), ("What is 2 + 2?", "2 + 2 = <<2+2=4>>4\n#### 4")]
    pq.write_table(pa.table({"question": [q for q, _ in rows], "answer": [a for _, a in rows]}),
                   tmp_path / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"question": ["Q?"], "answer": ["no final line"]}),
                   tmp_path / "main" / "test-00000-of-00001.parquet")
    train = load_task_mixture(f"gsm8k:{tmp_path}", "train", seed=0)
    assert sorted(c["answer"] for c in train) == ["26", "4"]
    assert TASKS["gsm8k"].load("train", str(tmp_path))[0][1]["messages"][0]["content"] == "What is 2 + 2?"
    with pytest.raises(UserError, match="GSM8K test row 0: cannot be rendered"):
        TASKS["gsm8k"].load("val", str(tmp_path))


def test_offline_is_one_line_within_seconds(tmp_path, monkeypatch):
    """With the hub unreachable (HF_ENDPOINT at a closed local port) and no copy: UserError saying what is needed,
    in under 10 s."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(tmp_path))
    for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        monkeypatch.delenv(k, raising=False)
    t0 = time.time()
    with pytest.raises(UserError, match="GSM8K needs the Hugging Face data set openai/gsm8k") as e:
        load_task_mixture("gsm8k", "train")
    assert time.time() - t0 < 10 and "\n" not in str(e.value)
    with pytest.raises(UserError, match="no such directory"):
        TASKS["gsm8k"].load("train", str(tmp_path / "missing"))
