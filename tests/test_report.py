"""The report card (nanotrain.report.card) on a real tiny base_train run directory."""

import json
import os
import shutil

import pytest
from helpers import TINY_TRAIN, run_script

from nanotrain.report.card import STAGES, SUBSECTIONS, main, report_dir, write_section
from nanotrain.report.plots import read_metrics

pytestmark = pytest.mark.smoke
PNG = b"\x89PNG\r\n\x1a\n"
CHAT_EVAL = {"checkpoint": "x/checkpoints/step_000004", "step": 4, "source": "sft", "config": {"tasks": "arith"},
             "results": {"arith": {"correct": 3, "total": 8, "accuracy": 0.375},
                         "spell": {"correct": 0, "total": 8, "accuracy": 0.0}}}


@pytest.fixture(scope="module")
def base_run(shared_base_dir, tmp_path_factory):
    """A 4-step tiny base_train run (run name r); returns its run directory (read-only for the tests)."""
    base = tmp_path_factory.mktemp("report_run")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=4", "--run_name=r", base_dir=base)
    assert r.returncode == 0, r.stderr
    return str(base / "base" / "r")


def headings(text):
    return [ln for ln in text.splitlines() if ln.startswith("## ") or ln.startswith("### ")]


def test_training_script_writes_its_own_section(base_run, monkeypatch):
    """
    base_train itself appends its section (with its wall time) to the report card of its run at the end; the
    CLI regeneration keeps that wall time. Catches: a script that forgets the report, or a regeneration that loses
    what only the script knew.
    """
    base = os.path.dirname(os.path.dirname(base_run))
    path = os.path.join(base, "report", "r", "report.md")
    text = open(path).read()
    assert "## base: " in text and "wall time of the stage: " in text
    for name in ("base_loss.png", "base_tokens_per_sec.png"):
        assert open(os.path.join(base, "report", "r", name), "rb").read().startswith(PNG)
    recorded = json.load(open(os.path.join(base, "report", "r", "base.json")))["extra"]["wall_time_s"]
    assert recorded > 0
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", base)
    main(["r"])
    assert json.load(open(os.path.join(base, "report", "r", "base.json")))["extra"]["wall_time_s"] == recorded


# a base run's metrics.jsonl written by hand: an evaluation at steps 0 and 4, four steps whose first one is slow (the
# compilation / warm-up step the speed summary leaves out)
LITERAL_METRICS = [{"step": 0, "val_bpb": 3.25},
                   {"step": 1, "loss": 6.5, "lrm": 1.0, "dt": 2.0, "tok_per_sec": 10.0, "mfu": 0.5},
                   {"step": 2, "loss": 5.25, "lrm": 1.0, "dt": 0.5, "tok_per_sec": 400.0, "mfu": 0.04},
                   {"step": 3, "loss": 4.5, "lrm": 1.0, "dt": 0.25, "tok_per_sec": 200.0, "mfu": 0.02},
                   {"step": 4, "loss": 4.125, "lrm": 0.5, "dt": 0.25, "tok_per_sec": 240.0, "mfu": 0.024},
                   {"step": 4, "val_bpb": 2.75}]


def test_section_has_every_heading_and_plots(base_run, base_dir, tmp_path):
    """
    A base section of the real run has every subsection, the run's config and valid non-empty PNGs that it links.
    Its numbers are checked on a run directory whose metrics.jsonl is LITERAL_METRICS, against lines worked out by
    hand (not read back through report_plots.read_metrics, which the section is built from): 4 steps, training time
    2 + 0.5 + 0.25 + 0.25 = 3 s = 0.05 min; the median of the tokens/s of steps 2-4 (400, 200, 240) is 240 and of their
    MFU (4%, 2%, 2.4%) 2.4%; train loss first 6.5, last 4.125; val bpb 3.25 at step 0, 2.75 at step 4; the summary
    table repeats them. Fails on: the first step not left out (median 220 tokens/s, MFU 3.2%), a mean instead of the
    median (280, 2.8%), the training time from the last step's dt only, first/last taken from the wrong rows, and a
    reader that drops the last line although it is complete (the step-4 evaluation). Catches as well a plot written
    as an empty or non-PNG file and a missing subsection.
    """
    path = write_section("r", "base", base_run)
    assert path == os.path.join(report_dir("r"), "report.md")
    text = open(path).read()
    assert "## base: " in text
    for sub in SUBSECTIONS:
        assert f"### {sub}" in text
    for name in ("base_loss.png", "base_tokens_per_sec.png"):
        data = open(os.path.join(report_dir("r"), name), "rb").read()
        assert len(data) > 1000 and data.startswith(PNG)
        assert f"]({name})" in text
    assert "| `depth` | 2 |" in text and "torch " in text and "git " in text

    literal = tmp_path / "literal_run"
    literal.mkdir()
    (literal / "config.json").write_text(json.dumps({"depth": 2}))
    (literal / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in LITERAL_METRICS))
    text = open(write_section("lit", "base", str(literal))).read()
    for line in ("- steps: 4, training time (sum of step times): 0.05 min",
                 "- median tokens/s 240, MFU 2.4% (first step left out)",
                 "- train loss: first 6.5000, last 4.1250",
                 "- val bpb: 3.2500 at step 0, 2.7500 at step 4",
                 "| base | 0.05 | 240 | 2.4% | val_bpb 2.7500 |"):
        assert any(ln.startswith(line) for ln in text.splitlines()), (line, text)


def test_rewriting_replaces_the_section_and_keeps_stage_order(base_run, base_dir, tmp_path):
    """
    Writing a stage again replaces its section (one copy, new content); sections come in the order base, mid, sft,
    eval whatever order they are written in. Catches: appending instead of replacing, or order by write time.
    """
    sft_dir = tmp_path / "sft_run"
    shutil.copytree(base_run, sft_dir)  # a stand-in for an sft run directory, with a chat eval
    (sft_dir / "chat_eval.json").write_text(json.dumps(CHAT_EVAL))
    write_section("r", "eval", str(sft_dir))
    write_section("r", "sft", str(sft_dir))
    write_section("r", "base", base_run, extra={"wall_time_s": 61.0})
    write_section("r", "base", base_run, extra={"wall_time_s": 123.0})
    text = open(os.path.join(report_dir("r"), "report.md")).read()
    stage_heads = [h.split(":")[0] for h in headings(text) if h.startswith("## ")]
    assert stage_heads == ["## base", "## sft", "## eval"]
    assert text.count("## base: ") == 1 and "wall time of the stage: 2.05 min" in text and "1.02 min" not in text
    assert "| arith | 3 | 8 | 37.50% |" in text and "| spell | 0 | 8 | 0.00% |" in text
    assert [s for s in STAGES if os.path.exists(os.path.join(report_dir("r"), f"{s}.md"))] == ["base", "sft", "eval"]
    assert not [f for f in os.listdir(report_dir("r")) if ".tmp" in f]  # atomic writes leave no temp files


def test_cli_regenerates_and_prints_path(base_run, base_dir, capsys):
    """`python -m nanotrain.report <run>` (its main()) finds the run's stages and prints the report path; an unknown
    run exits 2 with one error line."""
    shutil.copytree(base_run, base_dir / "base" / "r")
    main(["r"])
    path = capsys.readouterr().out.strip()
    assert path == str(base_dir / "report" / "r" / "report.md")
    assert "## base: " in open(path).read()
    with pytest.raises(SystemExit) as e:
        main(["nope"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "nope" in err


def test_eval_section_compares_stages(base_run, base_dir):
    """
    The eval section compares the chat eval of every stage of the run (the base model is the baseline). Catches:
    showing only the last evaluation, or mixing up which accuracy belongs to which stage.
    """
    for stage, correct in (("base", 0), ("sft", 3)):
        d = base_dir / stage / "r"
        shutil.copytree(base_run, d)
        e = dict(CHAT_EVAL, source=stage, results={"arith": {"correct": correct, "total": 8,
                                                              "accuracy": correct / 8}})
        (d / "chat_eval.json").write_text(json.dumps(e))
    main(["r"])
    text = open(os.path.join(report_dir("r"), "report.md")).read()
    assert "| task | base | sft |" in text and "| arith | 0.00% | 37.50% |" in text
    assert [h.split(":")[0] for h in headings(text) if h.startswith("## ")] == ["## base", "## sft", "## eval"]


@pytest.mark.unit
def test_torn_last_metrics_line_is_skipped(tmp_path):
    """A run killed mid-write leaves a torn last line: skipped. A corrupt line elsewhere names file:line."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "dt": 1.0}\n{"step": 2, "lo')
    train, val = read_metrics(str(tmp_path))
    assert [r["step"] for r in train] == [1] and val == []
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "lo\n{"step": 2, "loss": 5.0, "dt": 1.0}\n')
    from nanotrain.errors import UserError
    with pytest.raises(UserError, match="metrics.jsonl:1"):
        read_metrics(str(tmp_path))


@pytest.mark.unit
def test_only_rank_zero_writes(base_dir, tmp_path, monkeypatch):
    """Under torchrun, ranks other than 0 write nothing and get None."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0, "dt": 1.0, "tok_per_sec": 10.0}\n')
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert write_section("r", "base", str(tmp_path)) is None
    assert not os.path.exists(base_dir / "report")
