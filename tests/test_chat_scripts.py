"""
scripts/chat_eval.py, scripts/chat_cli.py and scripts/sample.py through the command line, on a tiny base model trained
for 3 steps.
"""

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, TINY_TRAIN, run_script

pytestmark = pytest.mark.smoke


@pytest.fixture(scope="module")
def trained(shared_base_dir, tmp_path_factory):
    """A base dir (linking the shared corpus and tokenizer) with a 3-step base run named 'tiny'."""
    base = tmp_path_factory.mktemp("chat_scripts")
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=3", "--run_name=tiny", base_dir=base)
    assert r.returncode == 0, r.stderr[-3000:]
    return base


def test_chat_eval_on_base_model(trained, tmp_path):
    """Exits 0, prints the accuracy table for every task (the JSONL set included) and saves chat_eval.json; with
    --log_samples=True, chat_eval_samples.jsonl holds one record per problem whose correct count is each task's
    total (catches records that disagree with the totals, or a task left out of the file)."""
    qa = tmp_path / "qa.jsonl"
    qa.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                                     {"role": "assistant", "content": f"Answer: {i + 1}"}]})
                            for i in range(3)) + "\n")
    r = run_script("chat_eval.py", "--source=base", "--max_problems=4", "--max_tokens=12", f"--jsonl={qa}",
                   "--log_samples=True", base_dir=trained)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:4] == ["task", "correct", "total", "accuracy"])
    rows = [line.split() for line in lines[header + 1:header + 5]]
    assert [row[0] for row in rows] == ["arith", "spell", "identity", "jsonl:qa.jsonl"]
    assert [row[2] for row in rows] == ["4", "4", "4", "3"] and all(row[3].endswith("%") for row in rows)
    saved = json.load(open(os.path.join(trained, "base", "tiny", "chat_eval.json")))
    assert saved["source"] == "base" and saved["step"] == 3
    assert set(saved["results"]) == {"arith", "spell", "identity", "jsonl:qa.jsonl"}
    assert saved["results"]["arith"]["total"] == 4
    samples = [json.loads(x) for x in open(os.path.join(trained, "base", "tiny", "chat_eval_samples.jsonl"))]
    for task, res in saved["results"].items():
        mine = [x for x in samples if x["task"] == task]
        assert len(mine) == res["total"] and sum(x["correct"] for x in mine) == res["correct"]
        assert all({"doc_id", "prompt", "reply", "extracted", "target", "calculator_calls"} <= set(x) for x in mine)


def test_chat_cli_one_shot_and_interactive(trained):
    """-p prints an answer and exits 0; the interactive loop reads turns from stdin, 'clear' and 'quit' work."""
    r = run_script("chat_cli.py", "--source=base", "-p", "hi", "--max_tokens=8", "--temperature=0",
                   base_dir=trained)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "checkpoint:" in r.stderr and "step_000003" in r.stderr
    assert "Overriding: prompt = 'hi'" in r.stderr  # settings go to stderr: stdout holds only the answer
    assert r.stdout.endswith("\n") and "Overriding" not in r.stdout
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(trained), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "chat_cli.py"), "--source=base",
                        "--max_tokens=6"], input="hello\nhow are you?\nclear\nhi\nquit\nnever read\n",
                       capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("Assistant: ") == 3


def test_missing_checkpoint_is_a_clean_error(trained):
    """No sft run yet / an unknown task: one `error:` line saying what to do, exit code 2 (not a traceback)."""
    r = run_script("chat_cli.py", "--source=sft", "--prompt=hi", base_dir=trained)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "error: no sft checkpoint found; train one first " \
                                                "(python scripts/chat_sft.py)"
    r = run_script("chat_eval.py", "--source=base", "--tasks=arith,chess", base_dir=trained)
    assert r.returncode == 2 and "--tasks: unknown task 'chess'" in r.stderr
    r = run_script("chat_cli.py", "--prompt=hi", base_dir=trained)  # no --source: the latest chat stage, none here
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: no rl, sft or mid checkpoint")


def test_chat_cli_shows_tool_calls_as_text_and_keeps_them_as_parts():
    """A reply with a calculator call is shown as "[calculator: 37 + 48 -> 85]" and kept as python / python_output
    parts for the next turn. Catches the raw special tokens printed, or the call kept as plain text (which the next
    turn would render as ordinary text tokens, not as a tool call)."""
    raw = "37 + 48 = <|python_start|>37 + 48<|python_end|><|output_start|>85<|output_end|>.\nAnswer: 85"
    code = ("import json, sys; sys.argv = ['chat_cli.py']; sys.path.insert(0, 'scripts'); import chat_cli as c; "
            f"print(json.dumps([c.readable({raw!r}), c.assistant_parts({raw!r})]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stderr[-2000:]
    shown, parts = json.loads(p.stdout.splitlines()[-1])
    assert shown == "37 + 48 = [calculator: 37 + 48 -> 85].\nAnswer: 85"
    assert parts == [{"type": "text", "text": "37 + 48 = "}, {"type": "python", "text": "37 + 48"},
                     {"type": "python_output", "text": "85"}, {"type": "text", "text": ".\nAnswer: 85"}]


def assert_one_error_line(r, flag):
    """r exited 2 with exactly one stderr line besides the settings echo: `error: <flag>=...`, and no traceback."""
    err = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("Overriding: ")]
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-2000:])
    assert len(err) == 1 and err[0].startswith(f"error: {flag}="), r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [["-p", ""], ["--prompt="], ["-p", "  \n "]], ids=["p", "prompt", "whitespace"])
def test_chat_cli_empty_prompt_is_an_error(trained, args):
    """
    Catches an explicitly empty prompt read as "no prompt" (on the old code: -p "" and --prompt= started the
    interactive mode, which read EOF from stdin and exited 0; a whitespace-only prompt was answered, exit 0).
    Expects one `error: --prompt=...` line and exit 2.
    """
    env = dict(os.environ, NANOTRAIN_BASE_DIR=str(trained), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "chat_cli.py"), "--source=base", *args],
                       input="", capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert_one_error_line(r, "--prompt")


@pytest.mark.parametrize("script, arg, flag", [
    ("sample.py", "--max_tokens=-5", "--max_tokens"),  # old: printed the prompt, exit 0
    ("sample.py", "--max_tokens=0", "--max_tokens"),  # old: printed the prompt, exit 0
    ("sample.py", "--top_k=-3", "--top_k"),  # old: a torch.topk traceback
    ("sample.py", "--temperature=-1", "--temperature"),  # old: an error line naming no flag
    ("chat_cli.py", "--max_tokens=0", "--max_tokens"),  # old: an empty answer, exit 0
    ("chat_cli.py", "--top_k=-1", "--top_k"),  # old: a torch.topk traceback
    ("chat_cli.py", "--temperature=-0.5", "--temperature"),  # old: an error line naming no flag
])
def test_sampling_settings_out_of_range_are_errors(trained, script, arg, flag):
    """
    Catches sampling settings out of range going through (on the old code: sample.py --max_tokens=-5 printed the
    prompt and exited 0; a negative top_k died in torch.topk with a traceback; a negative temperature failed inside
    generate without naming the flag). max_tokens must be >= 1, top_k >= 1 or 0 (all), temperature >= 0.
    Expects one `error: <flag>=...` line and exit 2.
    """
    extra = ["--source=base", "-p", "hi"] if script == "chat_cli.py" else []
    r = run_script(script, *extra, arg, base_dir=trained, timeout=120)
    assert_one_error_line(r, flag)


@pytest.mark.parametrize("arg, flag", [
    ("--run_name=../../x", "--run_name"),  # old: trained and wrote <tmp>/x, two levels above <base>/base/
    ("--run_name=ABS", "--run_name"),  # old: trained and wrote the absolute directory
    ("--matrix_lr=-0.01", "--matrix_lr"),  # old: Muon's ValueError traceback
    ("--embedding_lr=-1", "--embedding_lr"),  # old: accepted silently, trained
], ids=["parent", "absolute", "matrix_lr", "embedding_lr"])
def test_base_train_out_of_range_settings_are_one_line(base_dir, tmp_path, arg, flag):
    """
    Catches a run name that leaves <base>/base/ and negative learning rates reaching the training (on the old code
    --run_name=../../x and an absolute --run_name trained and wrote the run outside <base>/base/, --matrix_lr=-0.01
    died in Muon with a traceback, --embedding_lr=-1 trained silently). Expects one `error: <flag>=...` line, exit 2,
    and nothing written: no stage directory in <base>, none of the directories the old code created outside it.
    """
    outside = tmp_path / "abs_run"
    arg = arg.replace("ABS", str(outside))
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=1", arg, base_dir=base_dir, timeout=120)
    assert_one_error_line(r, flag)
    assert not (base_dir / "base").exists()
    assert not (tmp_path / "x").exists() and not outside.exists()


def test_chat_eval_batch_size_zero_is_one_line(trained):
    """
    Catches an evaluation batch size of 0 reaching the decoding (on the old code: a ValueError traceback from
    range() with step 0 in Engine.generate, after loading the model). Expects one `error: --batch_size=...` line.
    """
    r = run_script("chat_eval.py", "--source=base", "--max_problems=2", "--batch_size=0", base_dir=trained,
                   timeout=120)
    assert_one_error_line(r, "--batch_size")
