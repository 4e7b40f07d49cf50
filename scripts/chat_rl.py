"""
RL: on-policy REINFORCE from an SFT checkpoint on tasks with a grader, the calculator tool live during the rollouts.

    python scripts/chat_rl.py --num_iterations=40                      # CPU: the built-in arith task
    torchrun --standalone --nproc_per_node=8 scripts/chat_rl.py --tasks=gsm8k --max_new_tokens=256

Each optimizer step takes the next examples_per_step prompts of the shuffled training split (ConversationSampler),
strided over ranks. Every prompt gets num_samples samples (temperature, top_k, a seed fixed by (seed, step, prompt
index), so the samples do not depend on the number of ranks or on a resume), each graded by the task's own grader
(nanotrain.tasks.registry.grade): reward 1 or 0. Advantage = reward - the mean reward of that prompt's samples; the loss is
-sum(advantage x log-prob) over every sampled token of the step divided by their global count, so the gradient does
not depend on device_batch_size or the number of ranks (nanotrain.rl has the derivation). Tokens the tool forced are
never trained. lr: the SFT lrs times init_lr_frac, decaying linearly to 0 (nanochat's chat_rl: 0.05, no weight
decay). Every eval_every steps, greedy pass@1 on eval_problems held-out prompts (tool on). Checkpoints hold the
model, the optimizers, the RNG and the prompt cursor: --resume=True continues exactly; SIGTERM / Ctrl-C saves and
stops at the end of the step.
Outputs go to <base_dir>/rl/<run>/ (config.json, metrics.jsonl with reward, pass@k and mean length, checkpoints/),
read by chat_eval.py and chat_cli.py with --source=rl.
"""

import nanotrain.stop  # first, before torch: from here on SIGINT/SIGTERM ask the run to stop

# isort: split
import os
import time

import torch
import torch.distributed as dist

from nanotrain import run, training
from nanotrain.checkpoint import (
    check_resume,
    find_run_dir,
    load_latest,
    load_optimizers,
    resume_checkpoint,
    save_checkpoint,
)
from nanotrain.common import (
    all_reduce_scalar,
    any_rank,
    compute_init,
    print0,
    rng_state,
    run_script,
    seed_everything,
    set_rng_state,
    synchronize,
)
from nanotrain.configurator import configure, reals
from nanotrain.engine import Engine
from nanotrain.errors import UserError
from nanotrain.gpt import GPTConfig, build_model
from nanotrain.optim import setup_optimizers
from nanotrain.report.card import write_section_or_warn
from nanotrain.rl import empty_micro_batch, group_advantages, pass_at_k, rl_micro_batches, rl_rows, rollout_seed
from nanotrain.sft_data import ConversationSampler, token_loss_scale
from nanotrain.tasks.common import wilson_interval
from nanotrain.tasks.registry import grade, load_task_mixture
from nanotrain.tokenizer import get_tokenizer

# ----------------------------------------------------------------------------- settings
run_name = ""  # outputs go to <base_dir>/rl/<run_name>; "" means the source run's name
source_run_name = ""  # the SFT run to start from; "" picks the one with the newest checkpoint
tasks = "arith"  # prompts and graders: NAME[:WEIGHT] of arith, spell, identity, gsm8k (online), jsonl:PATH, hf:NAME
device_type = ""  # cuda | mps | cpu; "" autodetects
seed = 42  # int: seed of the prompt order and of the rollouts
# rollouts
examples_per_step = 8  # >= 1: prompts per optimizer step, all ranks together
num_samples = 8  # >= 1: samples per prompt
max_new_tokens = 64  # >= 1: most tokens per sample (the tool's forced tokens included)
temperature = 1.0  # > 0: sampling temperature of the rollouts
top_k = 50  # >= 0: sample among the k most likely tokens; 0 means all
tool = True  # run the calculator tool during rollouts and evaluation
device_batch_size = 32  # >= 1: samples per forward/backward micro-batch
num_iterations = None  # >= 1: optimizer steps; None is one epoch of the training prompts (prompts // examples_per_step)
# optimizer: base_train's learning rates times init_lr_frac, linear decay to 0 over the run (nanochat chat_rl)
init_lr_frac = 0.05  # > 0: multiplier of all the lrs below
matrix_lr = 0.02  # >= 0: Muon lr of the transformer blocks' matrices
embedding_lr = 0.2  # >= 0: AdamW lr of the token embedding (scaled by (model_dim/768)**-0.5)
unembedding_lr = 0.004  # >= 0: AdamW lr of the lm_head (scaled by (model_dim/768)**-0.5)
scalar_lr = 0.5  # >= 0: AdamW lr of the model's learned scalars
grad_clip = 1.0  # >= 0: clip the global gradient norm to this; 0 turns clipping off
# evaluation, checkpoints (-1 turns each off, except at the end of the run)
eval_every = 20  # -1 or >= 1: steps between greedy pass@1 evaluations on held-out prompts
eval_problems = 100  # >= 1: held-out prompts per evaluation (the first ones of the val split)
save_every = 20  # -1 or >= 1: steps between checkpoints
keep_last = 2  # >= 0: checkpoints kept on disk (0 keeps all)
wandb_project = ""  # log metrics.jsonl's rows to this Weights & Biases project too (rank 0); "" is off
resume = False  # continue from the newest complete checkpoint of this run
dtype = ""  # bfloat16 | float32; "" means bfloat16 autocast on CUDA and on CPUs with fast bf16 matmuls, else float32
config = configure(globals(), none_types={"num_iterations": (int,)},
                   rules={"temperature": reals(0, lo_open=True, note="RL samples: greedy rollouts would all agree")})
# -----------------------------------------------------------------------------

RESUME_KEYS = ("source_run_name", "tasks", "seed", "examples_per_step", "num_samples", "max_new_tokens", "temperature",
               "top_k", "tool")
MUON_MOMENTUM = 0.95  # constant, as in SFT


def evaluate_pass1(engine, tokenizer, problems, autocast_ctx, rank, world_size, device):
    """Greedy pass@1 (tool as --tool) of the problems, strided over ranks. Returns (correct, total), the same on
    every rank."""
    mine = problems[rank::world_size]
    correct = 0
    if mine:
        prompts = [tokenizer.render_for_completion(c) for c in mine]
        with autocast_ctx:
            outs = engine.generate(prompts, max_tokens=max_new_tokens, temperature=0.0, tool=tool)
        correct = sum(grade(c, tokenizer.decode(o)) for c, o in zip(mine, outs))
    counts = torch.tensor([correct, len(mine)], dtype=torch.long, device=device)
    if dist.is_initialized():
        dist.all_reduce(counts)
    return counts[0].item(), counts[1].item()


def main():
    t_start = time.time()  # wall time of the stage, for the report card
    is_ddp, rank, local_rank, world_size, device = compute_init(device_type)
    master = rank == 0
    compute_dtype, autocast_ctx = training.precision(dtype, device)
    tokenizer = get_tokenizer()
    tokenizer_sha256 = tokenizer.fingerprint()

    # ------------------------------------------------------------------------- the starting point
    # this run's checkpoint (resume) or the SFT checkpoint (fresh run)
    source_dir = find_run_dir("sft", source_run_name)
    if source_dir is None and not (resume and run_name):
        where = f" for --source_run_name={source_run_name}" if source_run_name else ""
        raise UserError(f"no sft checkpoint found{where}; train one first (python scripts/chat_sft.py)")
    run_dir = run.get_run_dir("rl", run_name or os.path.basename(source_dir))
    run.lock_run_dir(run_dir, device, rank)  # one writer per run: a second run of this name refuses
    ckpt = resume_checkpoint(run_dir, device, rank) if resume else None
    src = None
    if ckpt is None:
        src = load_latest(source_dir, device, rank, load_optimizer=False, meta_keys=("model_config", "max_seq_len"))
        if src is None:
            raise UserError(f"{source_dir} has no readable checkpoint; train one first")
    start = ckpt if ckpt is not None else src
    max_seq_len = start["meta"]["max_seq_len"]
    settings = dict(config, max_seq_len=max_seq_len)
    if ckpt is not None:
        check_resume(ckpt, run_dir, settings, RESUME_KEYS, world_size)
    model_config = GPTConfig(**start["meta"]["model_config"])

    # ------------------------------------------------------------------------- data
    # the training prompts in a seeded order, the held-out prompts for pass@1
    train = load_task_mixture(tasks, "train", seed)
    val = load_task_mixture(tasks, "val", seed)[:eval_problems]
    train_prompts = [tokenizer.render_for_completion(c) for c in train]
    sampler = ConversationSampler(len(train), seed=seed)
    if ckpt is not None:
        sampler.load_state_dict(ckpt["rank_state"]["sampler"])
    epoch_steps = max(1, len(train) // examples_per_step)
    total_steps = num_iterations if num_iterations is not None else epoch_steps

    # ------------------------------------------------------------------------- model and optimizers
    # the source weights (or this run's checkpoint) in fp32, the lrs scaled by init_lr_frac
    seed_everything(seed)
    model = build_model(model_config, device, start, tokenizer.get_vocab_size(), tokenizer_sha256=tokenizer_sha256)
    source_path = ckpt["meta"]["source"] if ckpt is not None else src["path"]
    del src, start
    orig_model = model
    optimizers = setup_optimizers(model, matrix_lr=matrix_lr * init_lr_frac, embedding_lr=embedding_lr * init_lr_frac,
                                  unembedding_lr=unembedding_lr * init_lr_frac,
                                  scalar_lr=scalar_lr * init_lr_frac, weight_decay=0.0,
                                  process_group=dist.group.WORLD if world_size > 1 else None)  # Muon shares its work
    if ckpt is not None:
        for change in load_optimizers(model, optimizers, ckpt["optim"]):
            print0(f"--resume=True: optimizer setting from this run's flags: {change}")
    model = training.wrap_ddp(model, device, world_size)  # DDP for more than one process, else the model itself
    engine = Engine(orig_model, tokenizer)
    pad_id = tokenizer.get_bos_token_id()

    print0(f"Device: {device} x {world_size} | dtype {str(compute_dtype).removeprefix('torch.')}")
    print0(f"Source: {source_path}" + (f" (resuming from {ckpt['path']})" if ckpt is not None else ""))
    print0(f"Data: {tasks} | {len(train):,} training prompts, {len(val)} held-out | tool {'on' if tool else 'off'}")
    print0(f"Rollouts: {examples_per_step} prompts x {num_samples} samples per step, temperature {temperature}, "
           f"top_k {top_k}, <= {max_new_tokens} new tokens; micro-batches of {device_batch_size} samples")
    print0(f"Steps: {total_steps:,} ({total_steps / epoch_steps:.2f} epochs of {epoch_steps} steps)")
    metrics = run.open_run_log(run_dir, settings, ckpt["meta"]["step"] if ckpt is not None else None, master, device)

    def checkpoint(step, tokens_seen, train_time):
        meta = {"config": settings, "model_config": vars(model_config), "tokenizer_sha256": tokenizer_sha256,
                "tokens_seen": tokens_seen, "train_time": train_time, "max_seq_len": max_seq_len, "source": source_path}
        rank_state = {"rng": rng_state(device), "sampler": sampler.state_dict()}
        path = save_checkpoint(run_dir, step, orig_model, optimizers, meta, rank_state, rank, world_size, keep_last)
        print0(f"Saved checkpoint {path}")

    # ------------------------------------------------------------------------- training loop
    if ckpt is not None:  # the rollouts have their own seeds; the global RNGs are restored, last, for anything else
        set_rng_state(ckpt["rank_state"]["rng"], device)
    step = ckpt["meta"]["step"] if ckpt is not None else 0
    train_time = ckpt["meta"]["train_time"] if ckpt is not None else 0.0
    tokens_seen = ckpt["meta"]["tokens_seen"] if ckpt is not None else 0  # prompt + sampled tokens, all ranks
    pass1 = None
    stop = False
    while True:
        last_step = step == total_steps or stop
        # checkpoint first, so that an evaluation crash never loses the training
        if run.save_due(step, last_step, save_every, ckpt["meta"]["step"] if ckpt is not None else None):
            checkpoint(step, tokens_seen, train_time)
        if stop:
            print0(f"Stopped at step {step} on request; resume with --resume=True "
                   f"--run_name={os.path.basename(run_dir)}")
            break
        # greedy pass@1 on the held-out prompts (also at the resume step: see MetricsLog)
        if val and (last_step or (eval_every > 0 and step % eval_every == 0)):
            t0 = time.time()
            correct, total = evaluate_pass1(engine, tokenizer, val, autocast_ctx, rank, world_size, device)
            pass1 = correct / total
            lo, hi = wilson_interval(correct, total)
            print0(f"step {step:05d}/{total_steps:05d} | held-out pass@1 {100 * pass1:.1f}% [{100 * lo:.1f}, "
                   f"{100 * hi:.1f}] ({correct}/{total}) | eval {time.time() - t0:.1f}s")
            metrics.log(step=step, eval_pass1=pass1, eval_correct=correct, eval_total=total)
        if last_step:
            break

        # rollouts: this rank's prompts of the step, num_samples samples each, graded
        synchronize(device)
        t0 = time.time()
        indices = sampler.take(examples_per_step)
        rows, rewards, lengths, n_correct_groups, step_tokens = [], [], [], [], 0
        for p in range(rank, examples_per_step, world_size):
            conv, prompt = train[indices[p]], train_prompts[indices[p]]
            with autocast_ctx:
                samples = engine.sample([prompt] * num_samples, max_new_tokens, temperature, top_k or None,
                                        seed=rollout_seed(seed, step, p), max_batch=num_samples, tool=tool)
            stop_ids = engine.stop_ids
            r = [float(grade(conv, tokenizer.decode([t for t in ids if t not in stop_ids]))) for ids, _ in samples]
            rows += rl_rows(prompt, samples, group_advantages(r))
            rewards += r
            lengths += [len(ids) for ids, _ in samples]
            step_tokens += num_samples * len(prompt) + sum(len(ids) for ids, _ in samples)
            n_correct_groups.append(int(sum(r)))
        t_rollout = time.time() - t0

        # the loss: -sum(advantage x log-prob) over all sampled tokens of the step / their global count
        batches = rl_micro_batches(rows, device_batch_size, pad_id, device)
        stats = torch.tensor([sum(r["targets"] for r in rows), sum(rewards), len(rewards), sum(lengths),
                              sum(pass_at_k(num_samples, c, num_samples) for c in n_correct_groups),
                              len(n_correct_groups), step_tokens], dtype=torch.float64, device=device)
        n_batches = torch.tensor(len(batches), device=device)
        if is_ddp:
            dist.all_reduce(stats)
            dist.all_reduce(n_batches, op=dist.ReduceOp.MAX)
        count, reward_sum, n_samples, length_sum, pass_k_sum, n_groups, step_tokens = stats.tolist()
        n_batches = int(n_batches.item())
        batches += [empty_micro_batch(pad_id, device) for _ in range(n_batches - len(batches))]  # same count per rank
        lrm = training.lr_multiplier(step, total_steps, 0.0, 1.0, 0.0)
        grad_norm = None
        if n_batches > 0:  # some prompt's samples disagree: a gradient (else nothing to learn from this step)
            loss = training.forward_backward(model, batches, autocast_ctx,
                                    loss_scale=token_loss_scale(int(count), world_size if is_ddp else 1))
            loss = all_reduce_scalar(loss, "mean", device)  # the step's loss: the sum over ranks / the global count
            training.check_finite(loss, step, run_dir)
            grad_norm = training.optimizer_step(orig_model, optimizers, lrm, MUON_MOMENTUM, grad_clip)
            training.check_finite(grad_norm.item(), step, run_dir, "gradient norm")
        else:
            orig_model.zero_grad(set_to_none=True)
        stop = any_rank(nanotrain.stop.requested, device)  # every rank stops after the same step
        synchronize(device)
        dt = time.time() - t0
        step += 1
        tokens_seen += int(step_tokens)
        if step > 1 or ckpt is not None:
            train_time += dt
        reward = reward_sum / n_samples
        row = {"step": step, "loss": 0.0 if grad_norm is None else loss, "reward": reward,
               f"pass@{num_samples}": pass_k_sum / n_groups, "mean_length": length_sum / n_samples,
               "lrm": lrm, "dt": dt, "rollout_s": t_rollout, "targets": int(count), "tokens": tokens_seen,
               "grad_norm": None if grad_norm is None else grad_norm.item()}
        print0(f"step {step:05d}/{total_steps:05d} | reward {reward:.3f} | pass@{num_samples} "
               f"{row[f'pass@{num_samples}']:.3f} | mean length {row['mean_length']:.1f} | loss {row['loss']:+.5f} | "
               f"lrm {lrm:.3f} | rollouts {t_rollout:.1f}s | dt {dt:.1f}s" +
               ("" if grad_norm is not None else " | no update (every prompt's samples got the same reward)"))
        metrics.log(**row)

    summary = (f"Done: {step} steps, training time {train_time / 60:.2f} min, final held-out pass@1 "
               f"{pass1 if pass1 is None else round(pass1, 4)}")
    run.finish_run(orig_model, run_dir, metrics, summary)
    # the training and its checkpoint are done: a report card that cannot be written is a warning, not a failure
    write_section_or_warn(os.path.basename(run_dir), "rl", run_dir, {"wall_time_s": time.time() - t_start})


if __name__ == "__main__":
    run_script(main, trains=True)
