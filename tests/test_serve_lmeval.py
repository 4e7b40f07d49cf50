"""
lm-evaluation-harness's `local-completions` model scoring a local multiple-choice task through scripts/chat_serve.py's
POST /v1/completions (the server in a subprocess on a 3-step tiny base model, as tests/test_serve.py starts it), its
per-request log-likelihoods compared with base_eval's own scoring of the same (context, continuation) pairs on the
same checkpoint (nanotrain.evaluation.core_eval: evaluate_task's continuation_scores, the mean loss over each option's
scored tokens, times their count from example_tokens). Skipped where the optional harness (with its API model's
extras, lm_eval[api]) is not installed; slow: importing the harness and its run take tens of seconds.
"""

import json
import os

import pytest
import torch
from helpers import TINY_TRAIN, run_script

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is optional (pip install lm_eval[api])")
for _extra in ("tenacity", "aiohttp", "requests"):  # what lm_eval's API models import (the [api] extra)
    pytest.importorskip(_extra, reason="lm_eval's local-completions needs lm_eval[api]")
pytest.importorskip("transformers", reason="the harness reads the tokenizer as a transformers tokenizer")

from helpers import LOCAL_MC_TASK, MC_ROWS  # noqa: E402
from test_serve import start_server  # noqa: E402

ROWS = MC_ROWS + [{"question": "The capital of France is", "choices": ["Paris", "a city in Europe", "blue"],
                   "answer": 0}]


def harness_logliks(url, tokenizer_dir, task_dir, add_bos_token):
    """lm_eval.simple_evaluate with local-completions on `url`'s /v1/completions: (results, {doc_id: [(context,
    continuation, log-likelihood) per choice]})."""
    from lm_eval.tasks import TaskManager
    model_args = {"model": "nanotrain", "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
                  "tokenizer": str(tokenizer_dir), "tokenized_requests": True, "add_bos_token": add_bos_token,
                  "max_length": 64, "batch_size": 1, "num_concurrent": 1, "max_retries": 1}
    out = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=["nanotrain_serve_mc"],
                                  task_manager=TaskManager(include_path=str(task_dir)), log_samples=True)
    got = {}
    for s in out["samples"]["nanotrain_serve_mc"]:
        args = [a if isinstance(a, (list, tuple)) else (a["arg_0"], a["arg_1"]) for a in s["arguments"]]
        got[s["doc_id"]] = [(ctx, cont, r[0][0]) for (ctx, cont), r in zip(args, s["resps"])]
    return out["results"]["nanotrain_serve_mc"], got


@pytest.mark.slow  # the harness's import and two runs take ~1 min; test_serve.py's completions test keeps the
# route's log-probabilities against the model's in the default tier
@pytest.mark.smoke
def test_lm_eval_local_completions_scores_base_evals_logliks(shared_base_dir, tmp_path, monkeypatch):
    """
    The harness's `local-completions` model (model_args: the project's tokenizer as a transformers tokenizer
    (nanotrain.export.hf.hf_tokenizer, written alone: no weights), tokenized_requests with add_bos_token, so the
    context / continuation split lands on the project's tokens and every request starts with <|bos|>) runs a local
    multiple-choice task of 5 rows (13 requests) against chat_serve.py: every request's log-likelihood equals
    base_eval's for the same context and continuation on the same checkpoint (core_eval.evaluate_task's
    continuation_scores, the mean loss over the scored span, times the span's length; the spans checked to be the
    harness's continuation tokens) to 1e-4, and acc is the share of rows whose gold choice sums highest. The same run
    with add_bos_token off (the server then scores the ids without <|bos|>) must miss base_eval's by over 1e-3 on
    some request. Catches a server that drops or shifts the echoed log-probabilities by one token (the harness
    slices token_logprobs[ctxlen:-1]: a missing leading None or a missing generated token moves the slice), one that
    prepends <|bos|> to token-id prompts too or scores without it, and a harness configuration whose tokenizer splits
    context and continuation off the project's token boundaries.
    """
    from nanotrain.checkpoint import load_model
    from nanotrain.evaluation.core_eval import evaluate_task, example_tokens, render_prompts
    from nanotrain.export.hf import hf_tokenizer

    base = tmp_path / "base"
    base.mkdir()
    os.symlink(shared_base_dir / "data", base / "data")
    os.symlink(shared_base_dir / "tokenizer", base / "tokenizer")
    r = run_script("base_train.py", *TINY_TRAIN, "--num_iterations=3", "--run_name=tiny", base_dir=base)
    assert r.returncode == 0, r.stderr[-3000:]
    monkeypatch.setenv("NANOTRAIN_BASE_DIR", str(base))
    monkeypatch.setenv("OPENAI_API_KEY", "k")  # local-completions sends it as the bearer token
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model, tok, _, _ = load_model("base", "tiny", -1, torch.device("cpu"))
    hf_tokenizer(tok).save_pretrained(str(tmp_path / "tokenizer"))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "serve_mc.yaml").write_text(LOCAL_MC_TASK.format(name="nanotrain_serve_mc", data=data))

    # base_eval's scoring: CORE's multiple-choice protocol, zero-shot, delimiter " " (the harness's target_delimiter)
    task = {"label": "serve_mc", "task_type": "multiple_choice", "num_fewshot": 0, "delimiter": " "}
    rows = [{"query": row["question"], "choices": row["choices"], "gold": row["answer"]} for row in ROWS]
    samples = []
    evaluate_task(model, tok, rows, task, torch.device("cpu"), samples=samples)
    bos = tok.get_bos_token_id()
    want = {}
    for i, (row, sample) in enumerate(zip(rows, sorted(samples, key=lambda s: s["doc_id"]))):
        prompts = render_prompts("multiple_choice", row, " ", [])
        tokens, starts, ends = example_tokens(tok, "multiple_choice", prompts, model.config.max_seq_len)
        context = tok.encode(row["query"], prepend=bos)
        assert all(t[:s] == context for t, s in zip(tokens, starts))  # CORE scores what follows the question
        want[i] = [(row["query"], " " + c, -m * (e - s))
                   for c, m, s, e in zip(row["choices"], sample["continuation_scores"], starts, ends)]

    p, url = start_server(base, "tiny", "--max_batch=2", "--max_queue=4")
    try:
        results, got = harness_logliks(url, tmp_path / "tokenizer", tmp_path / "tasks", add_bos_token=True)
        _, without_bos = harness_logliks(url, tmp_path / "tokenizer", tmp_path / "tasks", add_bos_token=False)
    finally:
        p.terminate()
        p.wait(timeout=30)

    assert sorted(got) == list(range(len(ROWS))) and sorted(without_bos) == sorted(got)
    diffs, off = [], []
    for i in range(len(ROWS)):
        assert [g[:2] for g in got[i]] == [w[:2] for w in want[i]]  # the same requests, in the same order
        diffs += [abs(g[2] - w[2]) for g, w in zip(got[i], want[i])]
        off += [abs(g[2] - w[2]) for g, w in zip(without_bos[i], want[i])]
    print(f"max |local-completions - base_eval| over {len(diffs)} requests: {max(diffs):.2e}")
    assert max(diffs) <= 1e-4
    assert max(off) > 1e-3  # the wrong setting is seen: 10 x the tolerance (2e-2 on this checkpoint)
    correct = sum(max(range(len(want[i])), key=lambda j: want[i][j][2]) == ROWS[i]["answer"] for i in want)
    assert results["acc,none"] == pytest.approx(correct / len(ROWS))
