"""
Mid-training: teach the base model the chat format on a mixture of conversations (nanochat's mid_train).

    python scripts/mid_train.py --tasks="arith:1,spell:1,identity:4"
    torchrun --standalone --nproc_per_node=8 scripts/mid_train.py

Starts from the newest base checkpoint (--base_run_name picks a run). The conversations are rendered in the chat
format (nanotrain.tokenizer.render_conversation), concatenated and cut into rows of max_seq_len + 1 tokens exactly
like pretraining, and every token is trained, the user's included (nanochat's choice: mid-training is still
language modelling, now on chat-formatted text; only chat_sft masks the loss to the assistant's tokens).
Conversations run across row boundaries with plain causal attention, as documents do in base_train.
--osft_rank_ratio=r > 0 keeps each block matrix's top singular directions (a fraction r of them) out of every update,
so the base model's knowledge is overwritten less (orthogonal subspace fine-tuning, nanotrain.osft).
Outputs go to <base_dir>/mid/<run>/ (config.json, metrics.jsonl, checkpoints/), read by scripts/chat_sft.py.
"""

import nanotrain.stop  # first, before torch: from here on SIGINT/SIGTERM ask the run to stop

# isort: split
import os
import time

import torch
import torch.distributed as dist

from nanotrain import run, training
from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.search import discover_device_batch_size
from nanotrain.auto_batch_size.stepdown import OOMStepDown
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
    get_peak_flops,
    print0,
    rng_state,
    run_script,
    seed_everything,
    set_rng_state,
)
from nanotrain.configurator import configure
from nanotrain.engine import Engine
from nanotrain.errors import UserError
from nanotrain.gpt import GPTConfig, build_model, policy_name
from nanotrain.loss_eval import evaluate_bpb
from nanotrain.optim import adamw_lr_scale, setup_optimizers
from nanotrain.osft import setup_osft
from nanotrain.report.card import write_section_or_warn
from nanotrain.sft_data import ConversationTokenStream
from nanotrain.tasks.registry import load_task_mixture
from nanotrain.tokenizer import get_token_bytes, get_tokenizer

# ----------------------------------------------------------------------------- settings
run_name = ""  # outputs go to <base_dir>/mid/<run_name>; "" means the base run's name
base_run_name = ""  # the base run to start from; "" picks the base run with the newest checkpoint
tasks = "arith:1,spell:1,identity:4"  # task mixture: NAME[:WEIGHT] of arith, spell, identity, gsm8k, arc, mmlu_aux, smoltalk (NAME:PATH: a local copy), jsonl:PATH, hf:NAME
device_type = ""  # cuda | mps | cpu; "" autodetects
seed = 42  # int: seed of the task generation and of the data order
# batch (None: the base checkpoint's value)
max_seq_len = None  # >= 2: tokens per row (context length)
device_batch_size = None  # >= 1: rows per micro-batch per device (None with --auto_batch_size=True: discovered)
total_batch_size = None  # >= 1: tokens per optimizer step, all ranks and micro-batches together
auto_batch_size = False  # discover the largest device_batch_size that fits (only grad_accum_steps changes)
batch_size_margin = 0.85  # (0, 1]: fraction of device memory the training step may use (bytes, not batch units)
batch_size_cache = True  # reuse discoveries from <base_dir>/auto_batch_cache
device_memory_gb = None  # > 0: device memory budget in GiB; None: the GPU's memory, or half the available RAM on CPU
max_batch_size = None  # >= 1: upper bound for discovered device_batch_size (None: no bound)
num_iterations = None  # >= 0: optimizer steps; None is one epoch of the training mixture
# optimizer: base_train's learning rates times init_lr_frac (nanochat mid_train: 1.0)
init_lr_frac = 1.0  # > 0: multiplier of all the lrs below
matrix_lr = 0.02  # >= 0: Muon lr of the transformer blocks' matrices
embedding_lr = 0.2  # >= 0: AdamW lr of the token embedding (scaled by (model_dim/768)**-0.5)
unembedding_lr = 0.004  # >= 0: AdamW lr of the lm_head (scaled by (model_dim/768)**-0.5)
scalar_lr = 0.5  # >= 0: AdamW lr of the model's learned scalars (x0_lambdas; resid_lambdas 1/100 of it, smear/backout 0.4)
weight_decay = 0.0  # >= 0: AdamW weight decay
ns_dtype = ""  # Muon's Newton-Schulz dtype: float32 | bfloat16; "" means bf16 on CUDA and on CPUs with fast bf16 matmuls
grad_clip = 0.0  # >= 0: clip the global gradient norm to this (on the device, no sync); 0: off, as nanochat
warmup_ratio = 0.0  # [0, 1]: fraction of the steps with a linear lr warmup
warmdown_ratio = 0.2  # [0, 1]: fraction of the steps at the end with a linear lr decay to final_lr_frac
final_lr_frac = 0.0  # [0, 1]: lr multiplier at the last step
# evaluation, sampling, checkpoints (-1 turns each off, except at the end of the run)
eval_every = 150  # -1 or >= 1: steps between validation bpb evaluations (on the val split of the mixture)
eval_tokens = 1048576  # >= 1: validation tokens per evaluation, at most one pass over the val split
sample_every = -1  # -1 or >= 1: steps between greedy chat answers to a few fixed questions (rank 0)
save_every = 500  # -1 or >= 1: steps between checkpoints
keep_last = 2  # >= 0: checkpoints kept on disk (0 keeps all)
wandb_project = ""  # log metrics.jsonl's rows to this Weights & Biases project too (rank 0); "" is off
resume = False  # continue from the newest complete checkpoint of this run
# precision and speed
dtype = ""  # bfloat16 | float32; "" means bfloat16 autocast on CUDA and on CPUs with fast bf16 matmuls, else float32
compile = None  # torch.compile the model; None means on for CUDA, off elsewhere
activation_checkpointing = "none"  # none|selective|full, as base_train's; nanotrain/gpt.py
# continual fine-tuning
osft_rank_ratio = 0.0  # [0, 1): orthogonal subspace fine-tuning: fraction of each matrix's top singular directions frozen
osft_matrices = "attn,mlp"  # the matrices OSFT constrains, comma-separated: attn, mlp, lm_head
config = configure(globals(), none_types={"num_iterations": (int,), "max_seq_len": (int,),
                                          "device_batch_size": (int,), "total_batch_size": (int,),
                                          "device_memory_gb": (float,), "max_batch_size": (int,), "compile": (bool,)})
# -----------------------------------------------------------------------------

RESUME_KEYS = ("tasks", "seed", "max_seq_len", "total_batch_size",  # device_batch_size may change: same tokens
               "osft_rank_ratio", "osft_matrices")
SAMPLE_QUESTIONS = ["What is 23 + 19?", 'Spell the word "return".', "Who are you?"]


def main():
    t_start = time.time()  # wall time of the stage, for the report card
    is_ddp, rank, local_rank, world_size, device = compute_init(device_type)
    master = rank == 0
    compute_dtype, autocast_ctx = training.precision(dtype, device)  # fp32 master weights; bf16 autocast where fast
    use_compile = training.resolve_compile(compile, device)  # None: on for CUDA, off elsewhere
    ac_policy = policy_name(activation_checkpointing)  # none | selective | full, checked before anything is written
    tokenizer = get_tokenizer()
    tokenizer_sha256 = tokenizer.fingerprint()  # stored in every checkpoint, checked on every load
    token_bytes = get_token_bytes(device)

    # ------------------------------------------------------------------------- the starting point
    # this run's checkpoint (resume) or the newest base checkpoint (model config and weights)
    source_dir = find_run_dir("base", base_run_name)
    if source_dir is None:
        where = f" for --base_run_name={base_run_name}" if base_run_name else ""
        raise UserError(f"no base checkpoint found{where}; train one first (python scripts/base_train.py)")
    run_dir = run.get_run_dir("mid", run_name or os.path.basename(source_dir))
    run.lock_run_dir(run_dir, device, rank)  # one writer per run: a second run of this name refuses
    ckpt = resume_checkpoint(run_dir, device, rank) if resume else None
    base = None
    if ckpt is None:
        base = load_latest(source_dir, device, rank, load_optimizer=False,
                           meta_keys=("model_config", "max_seq_len", "total_batch_size", "device_batch_size"))
        if base is None:
            raise UserError(f"{source_dir} has no readable checkpoint; train one first (python scripts/base_train.py)")
    start = ckpt if ckpt is not None else base
    max_seq_len = config["max_seq_len"] or start["meta"]["max_seq_len"]
    total_batch_size = config["total_batch_size"] or start["meta"]["total_batch_size"]
    model_config = GPTConfig(**dict(start["meta"]["model_config"], max_seq_len=max_seq_len))
    opt_kwargs = dict(matrix_lr=matrix_lr * init_lr_frac, embedding_lr=embedding_lr * init_lr_frac,
                      unembedding_lr=unembedding_lr * init_lr_frac, scalar_lr=scalar_lr * init_lr_frac,
                      weight_decay=weight_decay, ns_dtype=ns_dtype)

    # ------------------------------------------------------------------------- device batch size
    # given, discovered (before the model is built, so CUDA probes have the memory), or base's
    device_batch_size = config["device_batch_size"]
    step_down = None  # with a discovered size: steps every rank down to a smaller size on out-of-memory
    if device_batch_size is not None:
        if auto_batch_size:
            print0(f"--device_batch_size={device_batch_size} given: skipping the automatic discovery")
    elif auto_batch_size:
        record_path = os.path.join(run_dir, "auto_batch_size.json")
        device_batch_size, ab_record = discover_device_batch_size(
            gpt_builder(model_config, activation_checkpointing=ac_policy,
                        osft_rank_ratio=osft_rank_ratio, osft_matrices=osft_matrices, **opt_kwargs),
            max_seq_len=max_seq_len, vocab_size=model_config.vocab_size, total_batch_size=total_batch_size,
            world_size=world_size, device=device, amp_dtype=compute_dtype, compile=use_compile,
            margin=batch_size_margin, device_memory_gb=device_memory_gb, max_batch_size=max_batch_size,
            use_cache=batch_size_cache, key_fields={}, record_path=record_path)
        step_down = OOMStepDown(ab_record, record_path, device_batch_size)
    else:
        device_batch_size = start["meta"]["device_batch_size"]
    settings = dict(config, max_seq_len=max_seq_len, device_batch_size=device_batch_size,
                    total_batch_size=total_batch_size)
    if ckpt is not None:
        check_resume(ckpt, run_dir, settings, RESUME_KEYS, world_size)
    grad_accum_steps = training.grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, world_size)
    rows_per_step = device_batch_size * grad_accum_steps  # per rank, all micro-batches: fixed by total_batch_size

    # ------------------------------------------------------------------------- model
    # the base weights (or this run's checkpoint) in fp32, max_seq_len possibly changed (rotary only)
    seed_everything(seed)
    model = build_model(model_config, device, start, tokenizer.get_vocab_size(), tokenizer_sha256=tokenizer_sha256)
    source_path = start["path"] if ckpt is None else ckpt["meta"]["source"]
    del base, start
    model.activation_checkpointing = ac_policy  # before DDP / compile wrap it
    orig_model = model
    num_params = model.num_params()
    flops_per_token = model.estimate_flops()
    optimizers = setup_optimizers(model, **opt_kwargs,  # under DDP Muon shares its work across the ranks
                                  process_group=dist.group.WORLD if world_size > 1 else None)
    if ckpt is not None:
        for change in load_optimizers(model, optimizers, ckpt["optim"]):  # lrs and weight decay: this run's flags
            print0(f"--resume=True: optimizer setting from this run's flags: {change}")
    # orthogonal subspace fine-tuning: the bases from the start of the stage, kept across resumes (or None)
    osft = setup_osft(orig_model, optimizers, osft_rank_ratio, osft_matrices, ckpt)
    if use_compile:
        model = torch.compile(model, dynamic=False)
    model = training.wrap_ddp(model, device, world_size)  # DDP for more than one process, else the model itself

    # ------------------------------------------------------------------------- data
    # rank r renders and trains on conversations r, r + world_size, ... of the shuffled mixture
    def rendered(split):
        convs = load_task_mixture(tasks, split, seed=seed)[rank::world_size]
        if not convs:
            raise UserError(f"--tasks={tasks!r}: the {split} split has no conversation for rank {rank} of "
                            f"{world_size}")
        return [tokenizer.render_conversation(c, max_tokens=2**62)[0] for c in convs]
    t0 = time.time()
    train_tokens, val_tokens = rendered("train"), rendered("val")
    train_stream = ConversationTokenStream(train_tokens, device_batch_size, max_seq_len, device, seed=seed)
    if ckpt is not None:
        train_stream.load_state_dict(ckpt["rank_state"]["loader"])
    row_tokens = max_seq_len + 1  # inputs and the shifted targets
    epoch_steps = max(1, all_reduce_scalar(train_stream.tokens_per_epoch // (rows_per_step * row_tokens), "min",
                                           device))
    total_steps = num_iterations if num_iterations is not None else epoch_steps
    val_tokens_min = all_reduce_scalar(sum(len(t) for t in val_tokens), "min", device)

    def batch_sizes(device_batch_size):  # everything that depends on the device batch size, here and after a step-down
        grad_accum_steps = training.grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, world_size)
        eval_steps = max(1, min(eval_tokens // (device_batch_size * max_seq_len * world_size),  # always eval_tokens,
                                val_tokens_min // (device_batch_size * row_tokens)))  # at most one pass
        return device_batch_size, grad_accum_steps, eval_steps
    device_batch_size, grad_accum_steps, eval_steps = batch_sizes(device_batch_size)

    def val_batches():
        return ConversationTokenStream(val_tokens, device_batch_size, max_seq_len, device, shuffle=False)

    # ------------------------------------------------------------------------- logging
    peak_flops, peak_source = get_peak_flops(device, compute_dtype)
    print0(f"Device: {device} x {world_size} | dtype {str(compute_dtype).removeprefix('torch.')} | "
           f"compile {use_compile}")
    print0(f"Source: {ckpt['path'] if ckpt is not None else source_path}")
    print0(f"Model: n_layer {model_config.n_layer}, model_dim {model_config.model_dim}, n_head {model_config.n_head}, "
           f"vocab {model_config.vocab_size:,}, params {num_params:,}, FLOPs/token {flops_per_token:.3e}")
    print0(f"AdamW lrs scaled by (model_dim/768)**-0.5 = {adamw_lr_scale(model_config.model_dim):.6f}")
    print0(f"Data: {tasks} | {len(train_tokens):,} train conversations, {train_stream.tokens_per_epoch:,} tokens on "
           f"rank 0 ({time.time() - t0:.1f}s to render); one epoch = {epoch_steps} steps; val {eval_steps} batches")
    print0(f"Tokens / micro-batch / rank: {device_batch_size} x {max_seq_len} = {device_batch_size * max_seq_len:,}")
    print0(f"Total batch size {total_batch_size:,} tokens => gradient accumulation steps: {grad_accum_steps}")
    print0(f"Steps: {total_steps:,} ({total_steps * total_batch_size:,} tokens, {total_steps / epoch_steps:.2f} "
           f"epochs)")
    print0(f"MFU peak: {'n/a' if peak_flops is None else f'{peak_flops:.3e} FLOP/s per device'} ({peak_source})")
    metrics = run.open_run_log(run_dir, settings, ckpt["meta"]["step"] if ckpt is not None else None, master, device)

    def checkpoint(step, tokens_seen, train_time):
        meta = {"config": settings, "model_config": vars(model_config), "tokens_seen": tokens_seen,
                "tokenizer_sha256": tokenizer_sha256,
                "train_time": train_time, "device_batch_size": device_batch_size, "max_seq_len": max_seq_len,
                "total_batch_size": total_batch_size, "source": source_path}
        rank_state = {"rng": rng_state(device), "loader": train_stream.state_dict()}
        path = save_checkpoint(run_dir, step, orig_model, optimizers, meta, rank_state, rank, world_size, keep_last,
                               osft_state=osft.state_dict() if osft is not None else None)
        print0(f"Saved checkpoint {path}")

    # ------------------------------------------------------------------------- training loop
    if ckpt is not None:  # last: the set-up above seeds and draws from the RNGs (model init, the CPU MFU probe)
        set_rng_state(ckpt["rank_state"]["rng"], device)
    step = ckpt["meta"]["step"] if ckpt is not None else 0
    tokens_seen = ckpt["meta"]["tokens_seen"] if ckpt is not None else 0
    train_time = ckpt["meta"]["train_time"] if ckpt is not None else 0.0
    val_bpb = None
    stop = False
    pending = None  # the last step's loss, gradient norm and stop flag, still on the device (training.step_stats)
    eta = run.ETA(total_steps)  # the time left from the mean step time, not the last step's
    while True:
        if pending is not None:  # the step's one host read, once it is queued whole: checks, stop flag, log line
            stats, t0, lrm, epoch = pending
            train_loss, grad_norm, stop = training.read_step_stats(stats, step - 1, run_dir)  # NaN: UserError
            pending = None
            dt = time.time() - t0  # the read waited for the step's last kernel
            if step > 1 or ckpt is not None:  # the first step includes warm-up / compilation
                train_time += dt
            line, row = run.step_log_line(step, total_steps, loss=train_loss, grad_norm=grad_norm, lrm=lrm, dt=dt,
                                          tokens=total_batch_size, flops_per_token=flops_per_token,
                                          peak_flops=peak_flops, world_size=world_size, eta_s=eta.update(step, dt))
            print0(line)
            metrics.log(**row, tokens=tokens_seen, epoch=epoch)
        last_step = step == total_steps or stop
        # checkpoint first, so that an eval or sampling crash never loses the training (a resumed run has its own)
        if run.save_due(step, last_step, save_every, ckpt["meta"]["step"] if ckpt is not None else None):
            checkpoint(step, tokens_seen, train_time)
        if stop:
            print0(f"Stopped at step {step} on request; resume with --resume=True "
                   f"--run_name={os.path.basename(run_dir)}")
            break
        # validation bpb on the val split of the mixture (also at the resume step: see MetricsLog)
        if last_step or (eval_every > 0 and step % eval_every == 0):
            t0 = time.time()
            val_bpb = evaluate_bpb(model, val_batches(), eval_steps, token_bytes, autocast_ctx,
                                   stop=lambda: any_rank(nanotrain.stop.requested, device))
            if val_bpb is None:  # a stop request during the evaluation: save this step and stop
                stop = True  # (a resumed run evaluates at its first step)
                continue
            print0(f"step {step:05d}/{total_steps:05d} | val bpb {val_bpb:.4f} | eval {time.time() - t0:.1f}s")
            metrics.log(step=step, val_bpb=val_bpb)
        # greedy chat answers to a few fixed questions: shown, never able to fail the run (it is saved above)
        if master and (last_step or (sample_every > 0 and step % sample_every == 0 and step > 0)):
            engine = Engine(orig_model, tokenizer)
            for q in SAMPLE_QUESTIONS:
                prompt = tokenizer.render_for_completion({"messages": [{"role": "user", "content": q}]})
                try:
                    with autocast_ctx:
                        out = engine.generate([prompt], max_tokens=32, temperature=0.0, tool=True)[0]
                except Exception as e:  # the sample is a glance at the model, not part of the run's result
                    print0(f"warning: a sample failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                           f"the run goes on")
                    continue
                print0(f"sample: {q!r} -> {tokenizer.decode(out)!r}")
        if last_step:
            break

        # one optimizer step, queued without a host read: grad_accum_steps micro-batches of device_batch_size rows,
        # every token trained (so the mean of the micro-batch means is the token mean), gradients synced on the last
        # one; a non-finite gradient norm leaves the weights as they are (on the device)
        t0 = time.time()
        x, y = train_stream.next_batch(rows_per_step)
        epoch = train_stream.epoch  # the epoch of this step's rows, logged with it
        if step_down is not None:  # an out-of-memory steps every rank down to a smaller size and redoes the step
            loss = step_down.forward_backward(model, x, y, autocast_ctx, step)
            if step_down.device_batch_size != device_batch_size:
                device_batch_size, grad_accum_steps, eval_steps = batch_sizes(step_down.device_batch_size)
        else:
            loss = training.forward_backward(model, training.micro_batches(x, y, device_batch_size), autocast_ctx)
        # clip, set the scheduled lr and momentum, update, zero the gradients
        lrm = training.lr_multiplier(step, total_steps, warmup_ratio, warmdown_ratio, final_lr_frac)
        grad_norm = training.optimizer_step(orig_model, optimizers, lrm, training.muon_momentum(step), grad_clip)
        stats = training.step_stats(loss, grad_norm, nanotrain.stop.requested, device)  # every rank the same
        pending = (stats, t0, lrm, epoch)  # read at the top of the loop
        step += 1
        tokens_seen += total_batch_size

    # ------------------------------------------------------------------------- the end
    # replicas agree, the summary, the report card section
    summary = (f"Done: {step} steps, {tokens_seen:,} tokens, training time {train_time / 60:.2f} min, "
               f"final val bpb {val_bpb if val_bpb is None else round(val_bpb, 4)}")
    run.finish_run(orig_model, run_dir, metrics, summary)
    # the training and its checkpoint are done: a report card that cannot be written is a warning, not a failure
    write_section_or_warn(os.path.basename(run_dir), "mid", run_dir, {"wall_time_s": time.time() - t_start})


if __name__ == "__main__":
    run_script(main, trains=True)
