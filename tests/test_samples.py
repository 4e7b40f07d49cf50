"""
Per-problem sample records (nanotrain/evaluation/samples.py, chat_metrics.score_task, core_eval.evaluate_core), the comparison of
two sample files (nanotrain/evaluation/compare_samples.py), and HumanEval test code from outside the verified pinned set running
sandboxed (nanotrain/sandbox/humaneval_check.py).
"""

import json
import os

import pytest
import torch
from helpers import REPO, write_benchmark_copy

from nanotrain.evaluation import core_eval
from nanotrain.evaluation.chat_metrics import score_task
from nanotrain.evaluation.compare_samples import compare, main, mcnemar_exact, paired_interval
from nanotrain.evaluation.samples import read_samples, write_samples
from nanotrain.gpt import GPT, GPTConfig
from nanotrain.report.card import samples_comparison
from nanotrain.sandbox.execution import ExecutionResult
from nanotrain.sandbox.humaneval_check import _first_error_line, _outcome, check_humaneval
from nanotrain.tasks.humaneval import grade_humaneval_detail, humaneval_conversation
from nanotrain.tasks.registry import TASKS

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def chat_model():
    """A real 1-layer GPT over the byte tokenizer's 265 ids, seeded, 256 positions."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(max_seq_len=256, vocab_size=265, n_layer=1, n_head=2, n_kv_head=2, model_dim=16))
    model.init_weights()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0)
    return model


class Scripted:
    """An engine that answers each prompt with the next of `replies` (str), so that right and wrong replies are known:
    what is under test is the grading and the records, not the decoding."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies = tokenizer, list(replies)

    def generate(self, prompts, **kwargs):
        return [self.tokenizer.encode(self.replies.pop(0)) for _ in prompts]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """The five benchmarks' conversations from a local copy (3 rows each, tests/helpers.write_benchmark_copy)."""
    folder = write_benchmark_copy(str(tmp_path_factory.mktemp("bench")))
    return {name: TASKS[name].load("test", folder)[0] for name in ("arc_easy", "mmlu", "gsm8k", "humaneval")}


def test_multiple_choice_records_sum_to_the_total(byte_tokenizer, bench):
    """
    On a real tiny model, the MC records' correct count equals the total's, each record's extracted letter is the
    argmax of its letter scores and the gold letter is its target. Catches totals counted apart from the records
    (a record's letter not the one scored), letter scores of another row (sorted-by-length batches), and logs on by
    default.
    """
    model = chat_model()
    convs = bench["arc_easy"] + bench["mmlu"]
    for name in ("arc_easy", "mmlu"):
        convs = bench[name]
        assert "samples" not in score_task(model, byte_tokenizer, None, name, convs, batch_size=2)
        r = score_task(model, byte_tokenizer, None, name, convs, batch_size=2, log_samples=True)
        rows = r["samples"]
        assert [x["doc_id"] for x in rows] == list(range(len(convs)))
        assert sum(x["correct"] for x in rows) == r["correct"] and len(rows) == r["total"]
        for x, c in zip(rows, convs):
            assert set(x["letter_scores"]) == set(c["letters"])
            assert x["extracted"] == max(x["letter_scores"], key=x["letter_scores"].get)
            assert x["target"] == c["answer"] and x["correct"] == (x["extracted"] == c["answer"])
            assert x["prompt"].endswith("<|assistant_start|>") and x["resps"] == [[x["reply"]]]
            assert x["task"] == name and x["split"] == "test" and x["acc"] in (0.0, 1.0)


def test_generative_records_carry_calculator_calls_and_sandbox_outcomes(byte_tokenizer, bench):
    """
    GSM8K and HumanEval with known replies: the records' correct count equals the total, GSM8K's records list the
    calculator calls and the extracted "#### N", HumanEval's the sandbox outcome with the error's line; a program that
    prints 10 MB leaves a record under 2 kB. Catches a record graded apart from the total, the full output kept, and
    an outcome that says passed for a failed program.
    """
    gsm = bench["gsm8k"]
    replies = ["<|python_start|>1+1<|python_end|><|output_start|>2<|output_end|>#### " + gsm[0]["answer"],
               "#### 999", "no answer"]
    r = score_task(None, byte_tokenizer, Scripted(byte_tokenizer, replies), "gsm8k", gsm, log_samples=True)
    rows = r["samples"]
    assert r["correct"] == sum(x["correct"] for x in rows) == 1
    assert rows[0]["calculator_calls"] == [{"expr": "1+1", "result": "2"}] and rows[1]["calculator_calls"] == []
    assert [x["extracted"] for x in rows] == [gsm[0]["answer"], "999", None]
    assert [x["target"] for x in rows] == [c["answer"] for c in gsm]

    he = bench["humaneval"]
    prompt = he[2]["messages"][0]["content"]
    replies = [he[0]["messages"][1]["content"], he[1]["messages"][0]["content"] + "    return -1\n",
               prompt + "    print('x' * 10_000_000)\n    return x\n"]
    r = score_task(None, byte_tokenizer, Scripted(byte_tokenizer, replies), "humaneval", he, log_samples=True)
    rows = r["samples"]
    assert r["correct"] == sum(x["correct"] for x in rows) == 1
    assert [x["outcome"] for x in rows] == ["passed", "failed", "failed"]
    assert rows[0]["error"] == "" and "AssertionError" in rows[1]["error"]
    assert rows[2]["error"] and len(rows[2]["error"]) <= 200
    assert len(json.dumps({k: v for k, v in rows[2].items() if k not in ("reply", "resps")})) < 2000


def test_core_records_sum_to_each_task_accuracy(byte_tokenizer, tmp_path):
    """
    CORE on the hand-scored fixture bundle (tests/test_core_eval.py's bigram model): per task the records' correct
    count is accuracy * rows, each record carries one score per option (the chosen one the lowest mean loss for
    multiple choice), and write_results puts them in core_samples.jsonl, not in core.json. Catches records of another
    row order, a score list of the wrong option count, and logs on by default.
    """
    from test_core_eval import BUNDLE, hand_model
    assert "samples" not in core_eval.evaluate_core(hand_model(), byte_tokenizer, BUNDLE, CPU)
    res = core_eval.evaluate_core(hand_model(), byte_tokenizer, BUNDLE, CPU, log_samples=True)
    for label, t in res["tasks"].items():
        rows = [x for x in res["samples"] if x["task"] == label]
        assert len(rows) == t["rows"] and sum(x["correct"] for x in rows) == pytest.approx(t["accuracy"] * t["rows"])
        for x in rows:
            if t["task_type"] == "language_modeling":  # one score: the continuation's tokens that are the argmax
                assert x["continuation_scores"] == [len(byte_tokenizer.encode(x["target"]))] or not x["correct"]
            else:
                assert len(x["continuation_scores"]) == len(x["prompts"])
                assert x["extracted"] == x["continuation_scores"].index(min(x["continuation_scores"]))
    core_eval.write_results(str(tmp_path), res, step=1)
    assert "samples" not in json.loads((tmp_path / "core.json").read_text())
    assert len(read_samples(str(tmp_path / "core_samples.jsonl"))) == sum(t["rows"] for t in res["tasks"].values())


def test_a_test_field_from_a_local_copy_cannot_write_a_file(bench, tmp_path):
    """
    A HumanEval `test` field from a local copy (not the verified pinned set) that writes a file runs sandboxed: the
    file is not written, while the canonical solution of a clean copy still passes there. Catches the checker run
    with the grader's rights for any data (the file appears) and a sandboxed checker that cannot reach the candidate.
    """
    target = tmp_path / "written"
    os.chmod(tmp_path, 0o755)
    row = {"task_id": "x/0", "prompt": "def add(a, b):\n    \"\"\"a + b\"\"\"\n", "canonical_solution": "    return a + b\n",
           "entry_point": "add",
           "test": f"open({str(target)!r}, 'w').write('x')\ndef check(candidate):\n    assert candidate(2, 3) == 5\n"}
    c = humaneval_conversation(row)
    assert not any("trusted_test" in x for x in bench["humaneval"])  # a local copy is never trusted
    got = grade_humaneval_detail([(c, c["messages"][1]["content"]), (bench["humaneval"][0],
                                                                     bench["humaneval"][0]["messages"][1]["content"])])
    assert not target.exists()
    assert got[0]["passed"] is False and got[1]["passed"] is True
    # a direct call that does not say the test is trusted gets the sandbox as well
    assert check_humaneval(c["messages"][1]["content"], row["prompt"], row["test"], "add")["passed"] is False
    assert not target.exists()


def test_outcome_labels_and_error_lines():
    """The record's outcome of a failed program (a SIGKILL, as the cgroup's memory limit sends, is "killed for
    memory"; another signal is "failed") and its error line (the last non-blank line, never the truncation marker
    nor a blank line). Catches a sign or signal number slip, and a blank or marker line taken for the error."""
    def result(returncode, stderr="", timed_out=False):
        return ExecutionResult(passed=False, timed_out=timed_out, returncode=returncode, stdout="", stderr=stderr)
    assert _outcome(result(-9)) == "killed for memory" and _outcome(result(9)) == "failed"
    assert _outcome(result(-10)) == "failed" and _outcome(result(None, timed_out=True)) == "timed out"
    assert _outcome(result(1, "Traceback\nMemoryError\n")) == "killed for memory"
    assert _first_error_line("Traceback\nValueError: x\n   \n") == "ValueError: x"
    assert _first_error_line("ValueError: y\n... [12 bytes cut] ...\n") == "ValueError: y"
    assert _first_error_line("E: " + "z" * 1000) == "E: " + "z" * 197 and _first_error_line("") == ""


def _rows(task, outcomes):
    return [{"task": task, "doc_id": i, "correct": bool(o)} for i, o in enumerate(outcomes)]


def test_comparison_counts_flips_and_gives_mcnemar_by_hand(tmp_path, capsys):
    """
    Hand-made files: A right on 0..5, B right on 0, 6..10 of 12 problems: 5 flips to wrong (1..5), 5 to right
    (6..10)... plus a task where A alone is right once and B alone five times. McNemar exact, by hand: b = 1, c = 5,
    P(X <= 1) for X ~ Bin(6, 1/2) = (1 + 6) / 64, two-sided 14/64 = 0.21875; b = c = 5 gives 1. Identical files
    give p = 1 and no flips. Catches a one-sided p (0.109), the chi-square approximation (p 0.10 with b=1, c=5),
    flips counted the wrong way, and unpaired problems counted as pairs.
    """
    a = _rows("arith", [1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]) + _rows("spell", [1, 0, 0, 0, 0, 0, 1, 1])
    b = _rows("arith", [1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0]) + _rows("spell", [0, 1, 1, 1, 1, 1, 1, 1, 1])
    res = compare(a, b)
    assert res["arith"]["flipped_to_wrong"] == [1, 2, 3, 4, 5] and res["arith"]["flipped_to_right"] == [6, 7, 8, 9, 10]
    assert res["arith"]["p_value"] == 1.0 and res["arith"]["diff"] == 0.0
    sp = res["spell"]
    assert (sp["a_only"], sp["b_only"], sp["problems"], sp["only_in_one"]) == (1, 5, 8, 1)
    assert sp["p_value"] == pytest.approx(14 / 64) and mcnemar_exact(1, 5) == pytest.approx(0.21875)
    assert sp["diff"] == pytest.approx(4 / 8)
    lo, hi = sp["ci95"]
    assert lo < sp["diff"] < hi and -1 <= lo and hi <= 1
    lo, hi = paired_interval(10, 0, 0, 10)
    assert lo == pytest.approx(-hi)  # no discordant pair: symmetric around 0
    write_samples(str(tmp_path / "a.jsonl"), a)
    write_samples(str(tmp_path / "b.jsonl"), b)
    same = compare(read_samples(str(tmp_path / "a.jsonl")), read_samples(str(tmp_path / "a.jsonl")))
    assert all(r["p_value"] == 1.0 and not r["flipped_to_right"] and not r["flipped_to_wrong"] for r in same.values())
    main([str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")])
    out = capsys.readouterr().out
    assert "spell" in out and "0.2188" in out and "Agresti & Min" in out
    card = samples_comparison([("sft", str(tmp_path / "a.jsonl")), ("rl", str(tmp_path / "none.jsonl")),
                               ("rl2", str(tmp_path / "b.jsonl"))])  # a stage without samples is passed over
    assert "sft -> rl2" in card and "0.2188" in card and card.count("Paired comparison") == 1
    write_samples(str(tmp_path / "other.jsonl"), _rows("identity", [1, 0]))
    assert samples_comparison([("a", str(tmp_path / "a.jsonl")), ("b", str(tmp_path / "other.jsonl"))]) == ""


def test_logs_are_off_by_default():
    """--log_samples and --core_log_samples default to False in the scripts (a default flipped on would write a file
    per problem on every run)."""
    if not os.path.isdir(os.path.join(REPO, "scripts")):
        pytest.skip("no scripts/ in this copy (mutation testing copies the package and the tests only)")
    for script, flag in (("chat_eval.py", "log_samples"), ("base_eval.py", "log_samples"),
                         ("base_train.py", "core_log_samples")):
        text = open(os.path.join(REPO, "scripts", script)).read()
        assert f"\n{flag} = False  #" in text, script
