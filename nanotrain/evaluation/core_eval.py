"""
CORE: the base-model metric of DCLM (Li et al. 2024, "DataComp-LM", its 22 "low variance" in-context-learning tasks),
computed as nanochat computes it (karpathy/nanochat `nanochat/core_eval.py`, `scripts/base_eval.py`), so that the
numbers compare with nanochat's and GPT-2's published ones. The task rendering follows llm-foundry's ICL tasks.

The protocol:
- The eval bundle (nanotrain.evaluation.core_bundle: how it is had and checked) gives the tasks, their random baselines and
  rows.
- Each task's rows are shuffled with random.Random(1337) and cut to max_per_task. Row i's few-shot examples are
  random.Random(1234 + i).sample of the other rows' indices (i in the shuffled, cut list); a task with fewer rows than
  its few-shot count uses all the other rows.
- Prompts: each few-shot example followed by a blank line, then the item. Multiple choice: query + delimiter + choice,
  one prompt per choice; schema: context option + delimiter + continuation, one prompt per option; language
  modelling: context (whitespace-stripped) + delimiter + continuation, the prompt without the continuation stripped.
  Every prompt is tokenized with BOS first; the scored tokens are found in token space: after the choices' common
  prefix (multiple choice), the options' common suffix (schema), or after the prompt without the continuation
  (language modelling). A sequence longer than the model's context is cropped from the left.
- Multiple choice and schema: the option with the lowest mean loss over its scored tokens is the answer (the first
  one on a tie); language modelling: correct when every scored token is the model's argmax.
- Centred accuracy (acc - b/100) / (1 - b/100), b the random baseline; CORE is the mean over the tasks.
Rows are strided over ranks and the 0/1 outcomes all-reduced once per task. Each example is one forward (batch: the
number of options) with the chunked head: no (B, T, vocab) logits; language modelling takes the logits of its scored
positions only.
"""

import os
import random
import time

import torch
import torch.distributed as dist

from nanotrain.common import atomic_write_json, atomic_write_text, eval_mode, print0, rank_world
from nanotrain.errors import UserError
from nanotrain.evaluation.core_bundle import load_rows, read_bundle, verify_bundle
from nanotrain.evaluation.samples import sample_row, write_samples

SHUFFLE_SEED = 1337
FEWSHOT_SEED = 1234
STOP_CHECK_EVERY = 16  # rounds of examples between two (collective) checks for a stop request


# ----------------------------------------------------------------------------- the protocol

def task_rows(rows, max_per_task=-1):
    """`rows` shuffled with random.Random(1337) (a copy), then cut to the first max_per_task (all when <= 0)."""
    rows = list(rows)
    random.Random(SHUFFLE_SEED).shuffle(rows)
    return rows if max_per_task <= 0 else rows[:max_per_task]


def fewshot_indices(idx, num_rows, num_fewshot):
    """
    The few-shot example indices of row `idx` among `num_rows` rows: random.Random(1234 + idx).sample of the other
    indices, min(num_fewshot, num_rows - 1) of them (all the others when there are too few).
    """
    others = [i for i in range(num_rows) if i != idx]
    return random.Random(FEWSHOT_SEED + idx).sample(others, min(num_fewshot, len(others)))


def render_prompts(task_type, item, delimiter, shots):
    """
    The prompt texts of one row `item` after the few-shot rows `shots` (list of dicts), each shot followed by a blank
    line. multiple_choice: one per choice (query + delimiter + choice); schema: one per context option (option +
    delimiter + continuation); language_modeling: [prompt without the continuation, stripped; prompt with it], the
    contexts whitespace-stripped. Raises KeyError for a row without the task type's fields.
    """
    if task_type == "multiple_choice":
        head = "".join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{item['query']}{delimiter}{c}" for c in item["choices"]]
    if task_type == "schema":
        head = "".join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n" for s in shots)
        return [f"{head}{o}{delimiter}{item['continuation']}" for o in item["context_options"]]
    head = "".join(f"{s['context'].strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
    prompt = f"{head}{item['context'].strip()}{delimiter}"
    return [prompt.strip(), prompt + item["continuation"]]


def common_length(seqs, from_end=False):
    """The length of the common prefix (or suffix, from_end=True) of the lists `seqs`."""
    n = min(len(s) for s in seqs)
    for i in range(n):
        j = -1 - i if from_end else i
        if any(s[j] != seqs[0][j] for s in seqs):
            return i
    return n


def example_tokens(tokenizer, task_type, prompts, max_len):
    """
    Token lists (BOS first) of `prompts` (render_prompts) with the [start, end) span of each one's scored tokens,
    cropped from the left to the last `max_len` tokens (the span shifted; at least one token stays before it).
    Returns (tokens: list of lists of int, starts, ends). language_modeling gives one sequence: the prompt with the
    continuation, scored after the tokens it shares with the prompt without it.
    """
    bos = tokenizer.get_bos_token_id()
    toks = [tokenizer.encode(p, prepend=bos) for p in prompts]
    if task_type == "multiple_choice":
        start = common_length(toks)
        starts, ends = [start] * len(toks), [len(t) for t in toks]
    elif task_type == "schema":
        suffix = common_length(toks, from_end=True)
        starts, ends = [len(t) - suffix for t in toks], [len(t) for t in toks]
    else:
        without, with_ = toks
        toks, starts, ends = [with_], [common_length([without, with_])], [len(with_)]
    out = []
    for t, s, e in zip(toks, starts, ends):
        crop = max(0, len(t) - max_len)
        out.append((t[crop:], max(1, s - crop), e - crop))
    return [o[0] for o in out], [o[1] for o in out], [o[2] for o in out]


def span_batch(tokens, starts, ends):
    """The rows `tokens` (lists of int) right-padded into int64 (n, longest) inputs x (padded with 0) and targets y:
    -1 (not scored) except each row's span tokens[i][starts[i]:ends[i]], each the target of the position before it."""
    x = torch.zeros(len(tokens), max(len(t) for t in tokens), dtype=torch.long)
    y = torch.full_like(x, -1)
    for i, (t, s, e) in enumerate(zip(tokens, starts, ends)):
        x[i, :len(t)] = torch.tensor(t)
        y[i, s - 1:e - 1] = torch.tensor(t[s:e])
    return x, y


@torch.no_grad()
def score_example(model, task_type, tokens, starts, ends, gold, device, autocast_ctx=None, with_scores=False):
    """
    Whether `model` (a nanotrain GPT, not wrapped) answers one example right (bool), from example_tokens' output.
    multiple_choice / schema: the option with the lowest mean per-token loss over its span is compared with `gold`
    (int; the first option wins a tie); language_modeling: every span token is the argmax of the logits before it.
    with_scores: return (right, scores) instead, scores one float per option as the protocol compares them: the mean
    per-token loss in nats over the option's span (multiple choice, schema), or the number of span tokens that are
    the argmax (language modelling: right when it equals the span's length).
    """
    ctx = autocast_ctx if autocast_ctx is not None else torch.autocast(device.type, enabled=False)
    if task_type == "language_modeling":
        s, e = starts[0], ends[0]
        x = torch.tensor([tokens[0][:e - 1]], dtype=torch.long, device=device)
        with ctx:
            logits = model(x, logits_from=s - 1)  # (1, e - s, vocab): the span's predictions only
        hits = logits[0].argmax(-1).cpu() == torch.tensor(tokens[0][s:e])
        right = bool(hits.all())
        return (right, [float(hits.sum())]) if with_scores else right
    x, y = span_batch(tokens, starts, ends)
    with ctx:
        loss = model(x.to(device), y.to(device), loss_reduction="none").view_as(y).float().cpu()
    means = [loss[i, s - 1:e - 1].mean().item() for i, (s, e) in enumerate(zip(starts, ends))]
    right = means.index(min(means)) == gold
    return (right, means) if with_scores else right


def evaluate_task(model, tokenizer, rows, task, device, autocast_ctx=None, stop=None, samples=None):
    """
    The 0/1 outcomes (list of float, one per row of `rows`, in their order) of `task` (parse_task_list) on `rows`
    (already shuffled and cut: task_rows). Rows are strided over ranks (row i on rank i % world_size) and the
    outcomes summed in one all-reduce, so every rank returns the same list. The context is the model's
    config.max_seq_len. stop: optional callable, asked (collectively) every STOP_CHECK_EVERY rounds; when it returns
    True the evaluation is abandoned and None returned. samples: a list that gets every row's record
    (nanotrain.evaluation.samples.sample_row: the rendered prompts, the options' scores as "continuation_scores") on rank 0,
    gathered from all ranks.
    """
    rank, world = rank_world()
    max_len = model.config.max_seq_len
    outcomes = torch.zeros(len(rows), dtype=torch.float32, device=device)
    mine = []  # this rank's sample records
    rounds = (len(rows) + world - 1) // world
    with eval_mode(model):
        for r in range(rounds):
            if stop is not None and r % STOP_CHECK_EVERY == 0 and stop():
                return None
            i = r * world + rank
            if i >= len(rows):
                continue
            shots = [rows[j] for j in fewshot_indices(i, len(rows), task["num_fewshot"])]
            prompts = render_prompts(task["task_type"], rows[i], task["delimiter"], shots)
            tokens, starts, ends = example_tokens(tokenizer, task["task_type"], prompts, max_len)
            gold = rows[i].get("gold", 0)
            right, scores = score_example(model, task["task_type"], tokens, starts, ends, gold, device,
                                          autocast_ctx, with_scores=True)
            outcomes[i] = float(right)
            if samples is not None:
                mine.append(core_sample(task, i, prompts, tokens, starts, ends, gold, right, scores, tokenizer))
    if world > 1:
        dist.all_reduce(outcomes, op=dist.ReduceOp.SUM)
        if samples is not None:
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            mine = sorted((r for part in gathered for r in part), key=lambda r: r["doc_id"])
    if samples is not None and rank == 0:
        samples += mine
    return outcomes.cpu().tolist()


def core_sample(task, i, prompts, tokens, starts, ends, gold, right, scores, tokenizer):
    """The sample record (nanotrain.evaluation.samples.sample_row) of CORE row i: prompt (the gold option's rendered text),
    prompts (every option's), target (gold index; language modelling: the continuation), resps (each option's
    score, continuation_scores too), reply (the chosen option's scored text), extracted (its index)."""
    chosen = 0 if task["task_type"] == "language_modeling" else scores.index(min(scores))
    spans = [tokenizer.decode(t[s:e]) for t, s, e in zip(tokens, starts, ends)]
    return dict(sample_row(task["label"], "core", i, prompts[min(gold, len(prompts) - 1)],
                           spans[0] if task["task_type"] == "language_modeling" else gold, spans[chosen], chosen,
                           right, continuation_scores=scores, prompts=prompts, task_type=task["task_type"]),
                resps=[[x] for x in scores])


def centered(accuracy, baseline_percent):
    """Centred accuracy: (accuracy - b) / (1 - b) with b = baseline_percent / 100 (the bundle's csv is in percent)."""
    b = 0.01 * baseline_percent
    return (accuracy - b) / (1.0 - b)


def evaluate_core(model, tokenizer, bundle_dir, device, autocast_ctx=None, max_per_task=-1, stop=None,
                  log_samples=False):
    """
    CORE of `model` (a nanotrain GPT, not wrapped by DDP or torch.compile) on the extracted bundle in `bundle_dir`:
    {"core": float, "max_per_task": int, "order": [labels in core.yaml's order], "tasks": {label: {"accuracy",
    "centered", "baseline" (percent), "rows", "num_fewshot", "task_type", "seconds"}}}, the same on every rank
    (collective under DDP); with log_samples also "samples" (rank 0: every row's record, core_sample). A task's
    accuracy is the mean of its rows' outcomes, the same numbers as the records' "acc".
    Returns None when `stop` (see evaluate_task) asked to stop. Raises UserError (one line, never a score) for a
    bundle whose files changed since nanotrain.evaluation.core_bundle.ensure_bundle accepted them (verify_bundle, on every call)
    or that is not well formed (core_bundle.check_bundle's checks).
    """
    verify_bundle(bundle_dir)
    tasks, baselines = read_bundle(bundle_dir)
    out, samples = {}, ([] if log_samples else None)
    for task in tasks:
        t0 = time.time()
        rows = task_rows(load_rows(bundle_dir, task), max_per_task)
        try:
            outcomes = evaluate_task(model, tokenizer, rows, task, device, autocast_ctx, stop, samples)
        except (KeyError, IndexError, TypeError) as e:
            raise UserError(f"{task['label']} ({task['dataset_uri']}): a row lacks a {task['task_type']} field "
                            f"({type(e).__name__}: {e})") from None
        if outcomes is None:
            return None
        acc = sum(outcomes) / len(outcomes) if outcomes else 0.0
        out[task["label"]] = {"accuracy": acc, "centered": centered(acc, baselines[task["label"]]),
                              "baseline": baselines[task["label"]], "rows": len(rows),
                              "num_fewshot": task["num_fewshot"], "task_type": task["task_type"],
                              "seconds": time.time() - t0}
        r = out[task["label"]]
        print0(f"{task['label']:<34} {task['task_type']:<18} {task['num_fewshot']:>2}-shot {len(rows):>6} rows | "
               f"accuracy {acc:.4f} | centred {r['centered']:+.4f} | {r['seconds']:.1f}s")
    core = sum(r["centered"] for r in out.values()) / len(out)
    result = {"core": core, "max_per_task": max_per_task, "order": list(out), "tasks": out}
    if samples is not None:
        result["samples"] = samples
    return result


def write_results(run_dir, result, step):
    """
    Writes result (evaluate_core's dict, with "step") to <run_dir>/core.json (its "samples", when there are, to
    <run_dir>/core_samples.jsonl instead) and the per-task table to
    <run_dir>/core.csv (task, type, shots, rows, accuracy, centered, baseline), atomically. Returns the JSON path.
    """
    result = dict(result, step=step)
    if "samples" in result:
        write_samples(os.path.join(run_dir, "core_samples.jsonl"), result.pop("samples"))
    json_path = os.path.join(run_dir, "core.json")
    atomic_write_json(json_path, result)
    lines = ["task,type,shots,rows,accuracy,centered,baseline_percent"]
    for label in result.get("order", result["tasks"]):
        r = result["tasks"][label]
        lines.append(f"{label},{r['task_type']},{r['num_fewshot']},{r['rows']},{r['accuracy']:.6f},"
                     f"{r['centered']:.6f},{r['baseline']}")
    lines.append(f"CORE,,,,,{result['core']:.6f},")
    atomic_write_text(os.path.join(run_dir, "core.csv"), "\n".join(lines) + "\n")
    return json_path

