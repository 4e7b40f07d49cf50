"""
Chat data a careless user may feed chat_sft / mid_train: rows left with no target token after truncation, a JSONL
line nested 100,000 deep, and a NaN metric (nanotrain/sft_data.py, nanotrain/tasks/jsonl.py, nanotrain/run.py).
"""
import json
import math

import pytest

from nanotrain.errors import UserError
from nanotrain.run import MetricsLog
from nanotrain.sft_data import evaluate_loss, fit_conversation, micro_batch
from nanotrain.tasks.jsonl import load_jsonl

pytestmark = pytest.mark.unit


def test_a_row_truncated_to_no_target_is_skipped_not_kept():
    """
    A prompt of 8 tokens and a reply of 4 (mask 0 then 1), cut at 6: no target is left, so the row is "no_target"
    (None), under truncate; at 10 it keeps its 2 reply tokens' targets. A row with no reply at all is "no_target"
    whatever its length. Catches keeping such a row (its val loss is 0 / 0 = NaN, as evaluate_loss shows below).
    """
    ids, mask = list(range(12)), [0] * 8 + [1] * 4
    assert fit_conversation(ids, mask, 6, "truncate") == (None, None, "no_target")
    assert fit_conversation(ids, mask, 10, "truncate") == (ids[:10], mask[:10], "truncated")
    assert fit_conversation(ids, mask, 12, "drop") == (ids, mask, "ok")
    assert fit_conversation([1, 2, 3], [0, 0, 0], 6) == (None, None, "no_target")
    assert fit_conversation([1, 2, 3], [1, 0, 0], 6) == (None, None, "no_target")  # the first token is never a target


def test_the_kept_rows_never_give_a_nan_val_loss():
    """What fit_conversation keeps always has a target: evaluate_loss on it is finite, on the row it refuses NaN."""
    from nanotrain.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(max_seq_len=16, vocab_size=16, n_layer=1, n_head=1, n_kv_head=1, model_dim=8))
    model.init_weights()
    ids, mask = list(range(12)), [0] * 8 + [1] * 4
    kept = fit_conversation(ids, mask, 10)[:2]
    assert math.isfinite(evaluate_loss(model, [micro_batch([kept], True, 0)]))
    assert math.isnan(evaluate_loss(model, [micro_batch([(ids[:6], mask[:6])], True, 0)]))


def test_a_nan_metric_is_never_written_silently(tmp_path, capsys):
    """
    A NaN val_loss row: written (the row stays a record), with one warning line on stderr naming the field, the step
    and the file; a finite row warns nothing. Catches json.dumps writing NaN with no word.
    """
    log = MetricsLog(str(tmp_path))
    log.log(step=3, val_loss=float("nan"))
    log.log(step=4, val_loss=1.5, loss=2.0)
    log.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "val_loss=nan at step 3" in err[0] and "metrics.jsonl" in err[0]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("skip", [False, True])
def test_a_json_line_nested_100000_deep_is_one_line_naming_file_and_line(tmp_path, skip):
    """
    Line 2 is [[[[...]]]] 100,000 deep: without --skip_bad_rows one UserError naming file:2; with it the row is
    skipped and named. Catches json.loads' RecursionError escaping as a traceback (it is not a ValueError).
    """
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    path = tmp_path / "deep.jsonl"
    path.write_text(good + "\n" + "[" * 100_000 + "]" * 100_000 + "\n" + good + "\n")
    if not skip:
        with pytest.raises(UserError) as e:
            load_jsonl(str(path), skip_bad_rows=False)
        assert str(e.value).startswith(f"{path}:2: not a valid UTF-8 JSON line") and "\n" not in str(e.value)
    else:
        rows, skipped = load_jsonl(str(path), skip_bad_rows=True)
        assert len(rows) == 2 and [n for n, _ in skipped] == [2]
