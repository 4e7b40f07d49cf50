"""
Scoring a chat model on the benchmarks of nanotrain.tasks (and on the built-in tasks), as nanochat's
scripts/chat_eval.py scores them, so that the numbers compare:
- multiple choice (ARC, MMLU): one forward of the prompt (the conversation without its reply, then
  <|assistant_start|>); the prediction is the argmax of the logits at that last position restricted to the problem's
  choice letters (each one token); right for the gold letter;
- generative (GSM8K, HumanEval, the built-in tasks): the reply decoded by nanotrain.engine (greedy by default, the
  calculator tool as asked), graded by the conversation's task (nanotrain.tasks): GSM8K's "#### N" exact match,
  HumanEval's tests in a trusted process that calls the reply's code in nanotrain.sandbox.execution's sandbox, the
  built-ins' own graders; with num_samples > 1 a problem's accuracy is its unbiased pass@1 (the share of correct
  samples) and pass@k is reported too (Chen et al. 2021);
- ChatCORE (nanochat): the mean over the five benchmarks of the centred accuracy (acc - chance) / (1 - chance),
  chance 0.25 for ARC-Easy, ARC-Challenge and MMLU, 0 for GSM8K and HumanEval; only when all five were scored.
Problems are strided over ranks and the counts all-reduced, so every rank returns the same numbers.
"""

from contextlib import nullcontext

import torch
import torch.distributed as dist

from nanotrain.common import eval_mode, rank_world
from nanotrain.conversation import text_of
from nanotrain.errors import UserError
from nanotrain.evaluation.samples import calculator_calls, sample_row, totals
from nanotrain.rl import pass_at_k
from nanotrain.tasks.common import wilson_interval
from nanotrain.tasks.gsm8k import extract_answer as gsm8k_answer
from nanotrain.tasks.humaneval import extract_program
from nanotrain.tasks.registry import BENCHMARKS, TASKS, grade

# ----------------------------------------------------------------------------- grading

def grade_replies(conversations, replies):
    """Each reply (str) graded against its conversation by the conversation's task (its Task's grade_batch, one call
    per task, so HumanEval's programs run in parallel; a conversation of no known task is graded on the last line):
    a list of {"passed": bool, ...}; HumanEval's (its task's grade_detail) also carry the sandbox "outcome" and the
    error's line ("error")."""
    out = [None] * len(replies)
    by_task = {}
    for i, c in enumerate(conversations):
        by_task.setdefault(c.get("task"), []).append(i)
    for name, rows in by_task.items():
        convs, reps = [conversations[i] for i in rows], [replies[i] for i in rows]
        if name in TASKS and hasattr(TASKS[name], "grade_detail"):
            details = TASKS[name].grade_detail(convs, reps)
        elif name in TASKS:
            details = [{"passed": bool(ok)} for ok in TASKS[name].grade_batch(convs, reps)]
        else:
            details = [{"passed": bool(grade(c, r))} for c, r in zip(convs, reps)]
        for i, d in zip(rows, details):
            out[i] = d
    return out


def extracted_answer(conversation, reply):
    """The part of a reply its task's grader reads, for the sample records: GSM8K's "#### N" number (None when
    absent), HumanEval's program, else the reply's last non-empty line."""
    task = conversation.get("task")
    if task == "gsm8k":
        return gsm8k_answer(reply)
    if task == "humaneval":
        return extract_program(reply)
    lines = [x for x in reply.strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def _target(conversation):
    """The reference of a conversation for its sample record: the gold letter, GSM8K's number, else the last
    assistant message's text."""
    if "answer" in conversation:
        return conversation["answer"]
    return next((text_of(m["content"]) for m in reversed(conversation["messages"]) if m["role"] == "assistant"), None)


# ----------------------------------------------------------------------------- scoring

@torch.no_grad()
def score_multiple_choice(model, tokenizer, conversations, batch_size=8, autocast_ctx=None, with_scores=False):
    """
    The letter each conversation's prompt predicts, list[str] in input order: one forward per batch (prompts sorted
    by length, right-padded with <|bos|>, which causal attention never lets an earlier position see), the logits
    at each prompt's last position restricted to its "letters". A prompt longer than the model's rotary table is
    cropped from the left. with_scores: return (letters, scores) instead, scores a list of {letter: logit (float)}.
    Raises UserError when a letter is not one token of the tokenizer.
    """
    device = model.wte.weight.device
    bos = tokenizer.get_bos_token_id()
    ctx = autocast_ctx if autocast_ctx is not None else torch.autocast(device.type, enabled=False)
    letter_ids = {}
    for c in conversations:
        for letter in c["letters"]:
            if letter not in letter_ids:
                ids = tokenizer.encode(letter)
                if len(ids) != 1:
                    raise UserError(f"the choice letter {letter!r} is {len(ids)} tokens in this tokenizer, expected 1")
                letter_ids[letter] = ids[0]
    prompts = [tokenizer.render_for_completion(c)[-model.rotary_len:] for c in conversations]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out, scores = [None] * len(prompts), [None] * len(prompts)
    with eval_mode(model):
        for lo in range(0, len(order), batch_size):
            rows = order[lo:lo + batch_size]
            lengths = [len(prompts[i]) for i in rows]
            x = torch.full((len(rows), max(lengths)), bos, dtype=torch.long)
            for r, i in enumerate(rows):
                x[r, :lengths[r]] = torch.tensor(prompts[i])
            start = min(lengths) - 1  # logits only from the shortest prompt's last position on
            with ctx:
                logits = model(x.to(device), logits_from=start)  # (B, max - start, vocab) fp32
            for r, i in enumerate(rows):
                letters = conversations[i]["letters"]
                focus = logits[r, lengths[r] - 1 - start, [letter_ids[k] for k in letters]]
                out[i] = letters[int(focus.argmax())]
                scores[i] = dict(zip(letters, focus.float().tolist()))
    return (out, scores) if with_scores else out


def score_task(model, tokenizer, engine, name, conversations, max_tokens=512, num_samples=1, temperature=0.0,
               top_k=50, tool=True, batch_size=8, max_batch=64, seed=42, autocast_ctx=None, device=None,
               log_samples=False, split="test"):
    """
    Scores `conversations` (all of one task `name`): categorical for ARC/MMLU, generative otherwise (see the module
    docstring). The problems are strided over ranks; the counts are summed over ranks. Returns {"correct": number of
    problems right (generative with num_samples > 1: the sum of the problems' shares of correct samples), "total",
    "accuracy" (pass@1), "ci95" (Wilson, on problems), "chance", plus "pass@k" for k = num_samples > 1, and "example"
    (the first problem's prompt and reply on rank 0)}, and with log_samples "samples": every problem's record
    (nanotrain.evaluation.samples.sample_row, doc_id its index in `conversations`, split `split`), gathered on rank 0; multiple
    choice adds "letter_scores" ({letter: logit}), generative "calculator_calls", HumanEval "outcome" and "error".
    The counts are the sums of these records (computed whether or not they are returned). Raises UserError for
    num_samples < 1 or num_samples > 1 with temperature 0.
    """
    if num_samples < 1 or (num_samples > 1 and temperature == 0):
        raise UserError(f"num_samples={num_samples} with temperature={temperature}: expected num_samples >= 1, and "
                        f"temperature > 0 when num_samples > 1 (greedy samples are all the same)")
    rank, world = rank_world()
    mine = conversations[rank::world]
    ids = list(range(len(conversations)))[rank::world]
    rows, passk = [], 0.0
    categorical = name in TASKS and TASKS[name].kind == "categorical"
    if categorical:
        letters, scores = score_multiple_choice(model, tokenizer, mine, batch_size, autocast_ctx, with_scores=True)
        for i, c, letter, sc in zip(ids, mine, letters, scores):
            rows.append(sample_row(name, split, i, tokenizer.decode(tokenizer.render_for_completion(c)),
                                   c["answer"], letter, letter, letter == c["answer"], letter_scores=sc))
    else:
        prompts = [tokenizer.render_for_completion(c) for c in mine for _ in range(num_samples)]
        with autocast_ctx if autocast_ctx is not None else nullcontext():
            outs = engine.generate(prompts, max_tokens=max_tokens, temperature=temperature, top_k=top_k, seed=seed,
                                   max_batch=max_batch, tool=tool)
        replies = [tokenizer.decode(o) for o in outs]
        details = grade_replies([c for c in mine for _ in range(num_samples)], replies)
        for p, (i, c) in enumerate(zip(ids, mine)):
            span = slice(p * num_samples, (p + 1) * num_samples)
            mine_replies, mine_details = replies[span], details[span]
            n_ok = sum(d["passed"] for d in mine_details)
            if num_samples > 1:
                passk += pass_at_k(num_samples, n_ok, num_samples)
            extra = {"calculator_calls": calculator_calls(mine_replies[0])}
            if "outcome" in mine_details[0]:
                extra.update(outcome=mine_details[0]["outcome"], error=mine_details[0]["error"])
            row = sample_row(name, split, i, tokenizer.decode(prompts[p * num_samples]), _target(c),
                             mine_replies[0], extracted_answer(c, mine_replies[0]), n_ok / num_samples, **extra)
            if num_samples > 1:
                row.update(resps=[mine_replies], filtered_resps=[extracted_answer(c, r) for r in mine_replies],
                           passed=[d["passed"] for d in mine_details])
            rows.append(row)
    correct, total = totals(rows)
    sums = torch.tensor([correct, total, passk], dtype=torch.float64)
    if world > 1:
        sums = sums.to(device if device is not None else model.wte.weight.device)
        dist.all_reduce(sums)
        sums = sums.cpu()
        if log_samples:
            gathered = [None] * world
            dist.all_gather_object(gathered, rows)
            rows = [r for part in gathered for r in part]
    correct, total, passk = sums.tolist()
    total = int(total)
    out = {"correct": correct if num_samples > 1 else int(correct), "total": total,
           "accuracy": correct / total if total else 0.0, "ci95": list(wilson_interval(correct, total)),
           "chance": TASKS[name].chance if name in TASKS else 0.0}
    if num_samples > 1 and not categorical:
        out[f"pass@{num_samples}"] = passk / total if total else 0.0
    if rank == 0 and rows:
        content = mine[0]["messages"][0 if categorical else -2]["content"]
        out["example"] = {"prompt": (content if isinstance(content, str) else str(content))[:500],
                          "reply": rows[0]["reply"][:500]}
    if log_samples and rank == 0:
        out["samples"] = sorted(rows, key=lambda r: r["doc_id"])
    return out


def centred(accuracy, chance):
    """(accuracy - chance) / (1 - chance): 0 at chance, 1 at perfect."""
    return (accuracy - chance) / (1.0 - chance)


def chatcore(results):
    """ChatCORE of {task: {"accuracy", ...}} (see the module docstring): the mean centred accuracy of the five
    benchmarks, or None unless all five are in `results`."""
    if not all(name in results for name in BENCHMARKS):
        return None
    return sum(centred(results[n]["accuracy"], TASKS[n].chance) for n in BENCHMARKS) / len(BENCHMARKS)
