"""
Tests of nanotrain/conversation.py and nanotrain/tasks/{jsonl,registry}.py: conversation validation, JSONL / Hugging Face loading (file:line errors,
skip_bad_rows) and weighted task mixtures.
"""

import json
import re
from collections import Counter

import pytest

from nanotrain.conversation import validate_conversation
from nanotrain.errors import UserError
from nanotrain.tasks.jsonl import load_hf, load_jsonl
from nanotrain.tasks.registry import TASKS, load_task_mixture, parse_task_spec

GOOD = {"messages": [{"role": "user", "content": "What is 1 + 1?"}, {"role": "assistant", "content": "2"}]}


def conv(*turns):
    roles = ["user", "assistant"] * len(turns)
    return {"messages": [{"role": r, "content": t} for r, t in zip(roles, turns)]}


def write_jsonl(path, lines):
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return str(path)


@pytest.mark.unit
@pytest.mark.parametrize("obj, pattern", [
    (GOOD, None),
    ({"messages": [{"role": "system", "content": "s"}] + GOOD["messages"]}, None),
    ([1, 2], "JSON object"),
    ({"text": "hi"}, "messages"),
    (conv("a", "b", "c"), "last message must be the assistant"),
    (conv("a", "  "), "message 1 \\(assistant\\) has empty content"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": []}]}, "empty list of parts"),
    ({"messages": [{"role": "assistant", "content": "a"}]}, "'user' was expected"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "alternate"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "b"}]}, "must be a string"),
])
def test_validate_conversation(obj, pattern):
    """Catches accepting rows that would render wrongly (roles, order, types) or train on nothing (empty, no reply)."""
    problem = validate_conversation(obj)
    if pattern is None:
        assert problem is None
    else:
        assert problem is not None and re.search(pattern, problem), problem


@pytest.mark.unit
def test_load_jsonl_errors_name_file_and_line(tmp_path):
    """
    The error names path:line of the first bad line, counting blank lines. Catches off-by-one line numbers (0-based
    or counting only non-blank lines) and errors that do not say which file.
    """
    path = write_jsonl(tmp_path / "chat.jsonl", [GOOD, "", GOOD, "{not json", conv("a", "b", "c"), GOOD])
    with pytest.raises(UserError, match=re.escape(f"{path}:4: not a valid UTF-8 JSON line")):
        load_jsonl(path)
    path2 = write_jsonl(tmp_path / "chat2.jsonl", [GOOD, conv("q", "a", "q2")])
    with pytest.raises(UserError, match=re.escape(f"{path2}:2: the last message must be the assistant's")):
        load_jsonl(path2)
    with pytest.raises(UserError, match="no such JSONL file"):
        load_jsonl(str(tmp_path / "missing.jsonl"))


@pytest.mark.unit
def test_load_jsonl_skip_bad_rows_counts(tmp_path):
    """skip_bad_rows keeps every good row in order and counts each bad one. Catches counting blank lines as bad."""
    lines = [GOOD, "{not json", conv("x", "y"), "", "[1]", "INVALID_UTF8", conv("a", "b", "c"), conv("p", "q")]
    path = write_jsonl(tmp_path / "chat.jsonl", lines)
    raw = open(path, "rb").read().replace(b"INVALID_UTF8", b'{"messages": "\xff\xfe"}')
    open(path, "wb").write(raw)
    rows, skipped = load_jsonl(path, skip_bad_rows=True)
    assert len(skipped) == 4
    assert [r["messages"] for r in rows] == [GOOD["messages"], conv("x", "y")["messages"], conv("p", "q")["messages"]]
    assert all(r["task"] == "jsonl" for r in rows)


@pytest.mark.unit
def test_load_hf_local_files_and_offline_error(base_dir, tmp_path, monkeypatch):
    """
    A local JSONL through `datasets` gives the same conversations as load_jsonl, split 1 in 20 into val: of 45 rows,
    rows 0, 20 and 40 (the documented "0, 20, 40, ...", written out here rather than recomputed from the module's
    HOLDOUT_EVERY) are val and the other 42 train, in order; a bad row names the row; a hub name with no network fails
    fast with a UserError naming the data set. Fails on a holdout rate other than 1 in 20, on val rows 19, 39 (a
    split off by one), and on train and val rows that overlap or are reordered.
    """
    rows = [conv(f"question {i}", f"answer {i}") for i in range(45)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    train, skipped = load_hf(path, "train")
    val, _ = load_hf(path, "val")
    assert skipped == []
    assert [r["messages"] for r in val] == [rows[i]["messages"] for i in (0, 20, 40)]
    assert [r["messages"] for r in train] == [rows[i]["messages"] for i in range(45) if i not in (0, 20, 40)]
    assert len(train) == 42 and all(r["task"] == "hf" for r in train)
    bad = write_jsonl(tmp_path / "bad.jsonl", rows[:3] + [conv("q", "a", "q")])
    with pytest.raises(UserError, match=re.escape(f"{bad}[train] row 3: the last message")):
        load_hf(bad, "train")
    assert len(load_hf(bad, "train", skip_bad_rows=True)[1]) == 1
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: connection refused at once
    with pytest.raises(UserError, match="could not load the Hugging Face data set someone/chat.*offline"):
        load_hf("someone/chat", "train")


@pytest.mark.unit
def test_mixture_weights_and_determinism(base_dir, tmp_path):
    """
    Weight 2 puts every row in twice, 0.5 a half, 1.5 all once plus half; the same seed gives the same order, another
    seed another order; val ignores weights. Catches weights read as probabilities or applied to val.
    """
    arith = TASKS["arith"].load("train", seed=0)[0]
    ident = TASKS["identity"].load("train", seed=0)[0]
    key = lambda r: json.dumps(r, sort_keys=True)
    counts = Counter(key(r) for r in load_task_mixture("arith:2,identity:0.5", "train", seed=0))
    assert sum(counts.values()) == 2 * len(arith) + len(ident) // 2
    base_counts = Counter(map(key, arith))
    assert all(counts[k] == 2 * n for k, n in base_counts.items())
    mixed = load_task_mixture("arith:1.5", "train", seed=3)
    assert len(mixed) == len(arith) + len(arith) // 2
    first = load_task_mixture("arith,spell:1,identity:2", "train", seed=0)
    assert first == load_task_mixture("arith,spell:1,identity:2", "train", seed=0)
    assert first != load_task_mixture("arith,spell:1,identity:2", "train", seed=1)
    assert len(load_task_mixture("arith:3,identity:0.1", "val")) == TASKS["arith"].rows["val"] + TASKS["identity"].rows["val"]
    # a JSONL source: every 20th row is val (rows 0 and 20 of 40), the rest train
    rows = [conv(f"q{i}", f"a{i}") for i in range(40)]
    path = write_jsonl(tmp_path / "c.jsonl", rows)
    assert len(load_task_mixture(f"jsonl:{path}:2", "train")) == 2 * 38
    assert len(load_task_mixture(f"jsonl:{path}", "val")) == 2


@pytest.mark.unit
@pytest.mark.parametrize("spec, pattern", [
    ("arith,chess:1", "part 'chess:1': unknown task 'chess'"),
    ("arith:x", "part 'arith:x': weight 'x' is not a number"),
    ("arith:0", "part 'arith:0': weight must be a number > 0"),
    ("arith:-1", "weight must be"),
    ("jsonl:", "part 'jsonl:': missing the jsonl path"),
    ("", "expected comma-separated parts"),
    ("arith,,spell", "part '': unknown task"),
])
def test_bad_mixture_spec_names_the_part(spec, pattern):
    """Catches a spec typo silently dropping a task or training with a weight of 0."""
    with pytest.raises(UserError, match=re.escape(pattern)):
        parse_task_spec(spec)


@pytest.mark.unit
def test_spec_parsing_paths_and_weights():
    """A path keeps its own colons unless the last part is a number. Catches splitting 'hf:owner/name' wrongly."""
    assert parse_task_spec("arith,spell:2,jsonl:/a/b.jsonl:0.5,hf:HuggingFaceTB/smol-smoltalk,jsonl:c:d.jsonl") == [
        ("arith", None, 1.0), ("spell", None, 2.0), ("jsonl", "/a/b.jsonl", 0.5),
        ("hf", "HuggingFaceTB/smol-smoltalk", 1.0), ("jsonl", "c:d.jsonl", 1.0)]
