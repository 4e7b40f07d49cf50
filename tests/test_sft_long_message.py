"""chat_sft on a JSONL whose validation rows hold one huge message (scripts/chat_sft.py, nanotrain/sft_data.py)."""

import json
import os

import pytest
from helpers import run_script
from test_chat_train import GOOD, SFT, chat_base  # noqa: F401 (chat_base: the tiny base model fixture)

pytestmark = pytest.mark.smoke


def test_val_rows_truncated_to_no_target_neither_nan_nor_a_failed_run(chat_base, tmp_path):  # noqa: F811
    """
    Rows 1 and 21 of the JSONL (its validation rows) carry a 400 KB user message: truncated at the tiny model's 64 tokens they keep
    no target. The run finishes rc 0 with one warning line counting them, metrics.jsonl has no NaN, and the
    end-of-run sample does not fail on their untruncated prompt. Catches val_loss NaN written silently and the
    sample's rc 2 after a finished, saved run.
    """
    long = {"messages": [{"role": "user", "content": "word " * 80_000}, {"role": "assistant", "content": "ok"}]}
    rows = [long if i % 20 == 0 else GOOD for i in range(40)]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [a for a in SFT if not a.startswith("--tasks=")]
    r = run_script("chat_sft.py", *args, f"--tasks=jsonl:{path}", "--source=base", "--num_iterations=2",
                   "--run_name=long", base_dir=chat_base, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning: 2 val conversations have no target token within 64 tokens" in r.stdout, r.stdout[-3000:]
    text = open(os.path.join(chat_base, "sft", "long", "metrics.jsonl")).read()
    assert "NaN" not in text and "Infinity" not in text
