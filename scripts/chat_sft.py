"""
Chat SFT: fine-tune on conversations, training only on the assistant's tokens (the render mask).

    python scripts/chat_sft.py
    python scripts/chat_sft.py --jsonl=/data/chat.jsonl --skip_bad_rows=True
    torchrun --standalone --nproc_per_node=8 scripts/chat_sft.py --max_tokens_per_device=16384

Starts from the newest mid checkpoint (or base, with --source=base or when there is no mid run; or an SFT run, with
--source=sft, for a second SFT on new skills). --osft_rank_ratio=r > 0 keeps each block matrix's top singular
directions (a fraction r of them) out of every update, so a fine-tuning stage forgets less (nanotrain.osft).
Each optimizer step takes the next examples_per_step conversations of the shuffled mixture (ConversationSampler) and
spreads them over ranks and micro-batches longest-first (nanotrain.sft_data.lpt_pack) under max_tokens_per_device
tokens per micro-batch, so every rank runs the same number of micro-batches (a rank with nothing left runs a
zero-weight one). With packing, a micro-batch is one padding-free row (attention kept inside each conversation);
with --packing=False it is one padded row per conversation. The step's loss is the sum of the per-token losses over
all trained tokens on all ranks divided by their global count, counted before the backward passes, so the gradient
does not depend on max_tokens_per_device, max_conversations_per_device or the number of ranks (nanotrain.sft_data).
Defaults: examples_per_step 32 as nanochat v0 (target_examples_per_step), one epoch, lr decaying linearly to 0,
init_lr_frac 0.8 as nanochat HEAD.
Outputs go to <base_dir>/sft/<run>/ (config.json, metrics.jsonl, checkpoints/), read by chat_cli.py and chat_eval.py.
"""

import nanotrain.stop  # first, before torch: from here on SIGINT/SIGTERM ask the run to stop

# isort: split
import os
import time

import torch
import torch.distributed as dist

from nanotrain import run, training
from nanotrain.auto_batch_size.builders import sft_builder
from nanotrain.auto_batch_size.search import discover_device_batch_size
from nanotrain.checkpoint import (
    check_resume,
    find_run_dir,
    load_latest,
    load_optimizers,
    resume_checkpoint,
    save_checkpoint,
)
from nanotrain.common import (
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
from nanotrain.downloads import rank0_first
from nanotrain.engine import Engine
from nanotrain.errors import UserError
from nanotrain.evaluation.chat_metrics import chatcore, score_task
from nanotrain.gpt import GPTConfig, build_model, policy_name
from nanotrain.optim import adamw_lr_scale, setup_optimizers
from nanotrain.osft import setup_osft
from nanotrain.report.card import write_section_or_warn
from nanotrain.sandbox.execution import require_isolation
from nanotrain.sft_data import (
    LONG_POLICIES,
    ConversationSampler,
    evaluate_loss,
    fit_conversation,
    global_target_count,
    lpt_pack,
    micro_batch,
    token_loss_scale,
)
from nanotrain.tasks.common import resolve_source
from nanotrain.tasks.registry import BENCHMARKS, TASKS, load_task_mixture
from nanotrain.tokenizer import get_tokenizer

# ----------------------------------------------------------------------------- settings
run_name = ""  # outputs go to <base_dir>/sft/<run_name>; "" means the source run's name
source = "mid"  # the stage to start from: mid | base | sft (mid falls back to base when there is no mid checkpoint;
# sft: a second SFT on new skills from an SFT run, which needs its own --run_name)
source_run_name = ""  # the run of that stage; "" picks the one with the newest checkpoint
tasks = "arith:1,spell:1,identity:2"  # task mixture: NAME[:WEIGHT] of arith, spell, identity, gsm8k, arc, mmlu_aux, smoltalk (NAME:PATH: a local copy), jsonl:PATH, hf:NAME
jsonl = ""  # an extra JSONL file of conversations ({"messages": [...]} per line; every 20th line is held out for val)
skip_bad_rows = False  # skip (and count) malformed JSONL lines instead of stopping at the first one
device_type = ""  # cuda | mps | cpu; "" autodetects
seed = 42  # int: seed of the task generation and of the data order
# batch
examples_per_step = 32  # >= 1: conversations per optimizer step, all ranks together
max_tokens_per_device = None  # >= 2: token budget of one micro-batch on one rank (packed: its row length at most); None: 2048 or discovered
auto_batch_size = False  # discover the largest max_tokens_per_device (a multiple of max_seq_len) that fits
batch_size_margin = 0.85  # (0, 1]: fraction of device memory the training step may use (bytes, not batch units)
batch_size_cache = True  # reuse discoveries from <base_dir>/auto_batch_cache
device_memory_gb = None  # > 0: device memory budget in GiB; None: the GPU's memory, or half the available RAM on CPU
max_batch_size = None  # >= 1: upper bound for the discovered rows of max_seq_len tokens per micro-batch (None: 64)
max_conversations_per_device = 32  # >= 1: at most this many conversations per micro-batch per rank
packing = True  # padding-free packed rows; False: one padded row per conversation
max_seq_len = None  # >= 2: longest conversation in tokens; None: the source checkpoint's max_seq_len
long_conversations = "truncate"  # conversations longer than min(max_seq_len, max_tokens_per_device): truncate | drop
num_iterations = None  # >= 0: optimizer steps; None is one epoch (conversations // examples_per_step)
# optimizer: base_train's learning rates times init_lr_frac, linear decay to 0 over the run (nanochat chat_sft)
init_lr_frac = 0.8  # > 0: multiplier of all the lrs below (nanochat HEAD: 0.8; v0: 0.02 for d20 after mid-training)
matrix_lr = 0.02  # >= 0: Muon lr of the transformer blocks' matrices
embedding_lr = 0.2  # >= 0: AdamW lr of the token embedding (scaled by (model_dim/768)**-0.5)
unembedding_lr = 0.004  # >= 0: AdamW lr of the lm_head (scaled by (model_dim/768)**-0.5)
scalar_lr = 0.5  # >= 0: AdamW lr of the model's learned scalars (x0_lambdas; resid_lambdas 1/100 of it, smear/backout 0.4)
weight_decay = 0.0  # >= 0: AdamW weight decay
ns_dtype = ""  # Muon's Newton-Schulz dtype: float32 | bfloat16; "" means bf16 on CUDA and on CPUs with fast bf16 matmuls
grad_clip = 0.0  # >= 0: clip the global gradient norm to this (on the device, no sync); 0: off, as nanochat
warmdown_ratio = 1.0  # [0, 1]: fraction of the steps at the end with a linear lr decay to 0 (1.0: the whole run)
# evaluation, checkpoints (-1 turns each off, except at the end of the run)
eval_every = 100  # -1 or >= 1: steps between validation losses on held-out conversations
eval_examples = 400  # >= 0: validation conversations per evaluation (the first ones of the val mixture)
sample_every = -1  # -1 or >= 1: steps between greedy answers to a few validation questions (rank 0)
chatcore_every = -1  # -1 or >= 1: steps between a small ChatCORE (the five chat benchmarks, all ranks), also at the end
chatcore_max_problems = 24  # problems per benchmark of the in-loop ChatCORE (the first ones, nanochat's order); -1: all
unsafe_code = False  # run the in-loop ChatCORE's HumanEval code even with no isolation (not root and no bubblewrap): it can then read this user's secrets and kill this process
chatcore_data = "auto"  # the benchmarks' test sets: auto (the hub if reachable, else pinned) | hub | pinned | a folder
save_every = 500  # -1 or >= 1: steps between checkpoints
keep_last = 2  # >= 0: checkpoints kept on disk (0 keeps all)
wandb_project = ""  # log metrics.jsonl's rows to this Weights & Biases project too (rank 0); "" is off
resume = False  # continue from the newest complete checkpoint of this run
# precision and speed
dtype = ""  # bfloat16 | float32; "" means bfloat16 autocast on CUDA and on CPUs with fast bf16 matmuls, else float32
compile = False  # torch.compile the model; None means on for CUDA (packed rows vary in length: recompiles, so off)
activation_checkpointing = "none"  # none|selective|full, as base_train's; nanotrain/gpt.py
# continual fine-tuning
osft_rank_ratio = 0.0  # [0, 1): orthogonal subspace fine-tuning: fraction of each matrix's top singular directions frozen
osft_matrices = "attn,mlp"  # the matrices OSFT constrains, comma-separated: attn, mlp, lm_head
config = configure(globals(), none_types={"num_iterations": (int,), "max_tokens_per_device": (int,),
                                          "device_memory_gb": (float,), "max_batch_size": (int,),
                                          "max_seq_len": (int,), "compile": (bool,)})
# -----------------------------------------------------------------------------

RESUME_KEYS = ("tasks", "jsonl", "skip_bad_rows", "seed", "examples_per_step", "max_seq_len", "long_conversations",
               "osft_rank_ratio", "osft_matrices")
MUON_MOMENTUM = 0.95  # constant in SFT (nanochat chat_sft keeps Muon's default)


def find_source_dir():
    """The run directory to start from and its stage ("mid", "base" or "sft"). Raises UserError if there is none, or
    if a second SFT (source "sft") would write into its source run."""
    if source not in ("mid", "base", "sft"):
        raise UserError(f"--source={source!r}: expected 'mid', 'base' or 'sft'")
    if source == "sft" and (not run_name or run_name == source_run_name or not source_run_name):
        raise UserError("--source=sft: name the SFT run to start from (--source_run_name) and a new --run_name for "
                        "this one (a second SFT must not write into its source run)")
    run_dir = find_run_dir(source, source_run_name)
    if run_dir is None and source == "mid" and not source_run_name:
        run_dir = find_run_dir("base")
        if run_dir is not None:
            print0("no mid checkpoint found: starting from the newest base checkpoint")
            return run_dir, "base"
    if run_dir is None:
        where = f" for --source_run_name={source_run_name}" if source_run_name else ""
        raise UserError(f"no {source} checkpoint found{where}; train one first (python scripts/mid_train.py or "
                        f"python scripts/base_train.py)")
    return run_dir, source


def render_all(tokenizer, convs, max_len, split):
    """Renders conversations and applies the long-conversation policy. Returns ([(ids, mask)], truncated, dropped);
    rows left with no target token are skipped, with one warning line giving their count."""
    out, counts = [], {"ok": 0, "truncated": 0, "dropped": 0, "no_target": 0}
    for c in convs:
        ids, mask = tokenizer.render_conversation(c, max_tokens=2**62)
        ids, mask, status = fit_conversation(ids, mask, max_len, long_conversations)
        counts[status] += 1
        if ids is not None:
            out.append((ids, mask))
    if counts["no_target"]:
        print0(f"warning: {counts['no_target']} {split} conversations have no target token within {max_len} tokens "
               f"(the prompt fills them): skipped")
    return out, counts["truncated"], counts["dropped"]


def main():
    t_start = time.time()  # wall time of the stage, for the report card
    is_ddp, rank, local_rank, world_size, device = compute_init(device_type)
    master = rank == 0
    compute_dtype, autocast_ctx = training.precision(dtype, device)  # fp32 master weights; bf16 autocast where fast
    use_compile = training.resolve_compile(compile, device)  # None: on for CUDA, off elsewhere
    ac_policy = policy_name(activation_checkpointing)  # none | selective | full, checked before anything is written
    tokenizer = get_tokenizer()
    tokenizer_sha256 = tokenizer.fingerprint()  # stored in every checkpoint, checked on every load
    if long_conversations not in LONG_POLICIES:
        raise UserError(f"--long_conversations={long_conversations!r}: expected one of {', '.join(LONG_POLICIES)}")
    max_tokens_per_device = config["max_tokens_per_device"]
    if max_tokens_per_device is not None and auto_batch_size:
        print0(f"--max_tokens_per_device={max_tokens_per_device} given: skipping the automatic discovery")
    if max_tokens_per_device is None and not auto_batch_size:
        max_tokens_per_device = 2048

    # ------------------------------------------------------------------------- the starting point
    # this run's checkpoint (resume) or the source checkpoint (fresh run)
    source_dir, stage = (None, None) if (resume and run_name) else find_source_dir()
    run_dir = run.get_run_dir("sft", run_name or os.path.basename(source_dir))
    run.lock_run_dir(run_dir, device, rank)  # one writer per run: a second run of this name refuses
    ckpt = resume_checkpoint(run_dir, device, rank) if resume else None
    src = None
    if ckpt is None:
        if source_dir is None:
            source_dir, stage = find_source_dir()
        src = load_latest(source_dir, device, rank, load_optimizer=False,
                          meta_keys=("model_config", "max_seq_len"))
        if src is None:
            raise UserError(f"{source_dir} has no readable checkpoint; train one first")
    start = ckpt if ckpt is not None else src
    max_seq_len = config["max_seq_len"] or start["meta"]["max_seq_len"]
    settings = dict(config, max_seq_len=max_seq_len)
    if ckpt is not None:
        check_resume(ckpt, run_dir, settings, RESUME_KEYS, world_size)
    model_config = GPTConfig(**dict(start["meta"]["model_config"], max_seq_len=max_seq_len))
    opt_kwargs = dict(matrix_lr=matrix_lr * init_lr_frac, embedding_lr=embedding_lr * init_lr_frac,
                      unembedding_lr=unembedding_lr * init_lr_frac, scalar_lr=scalar_lr * init_lr_frac,
                      weight_decay=weight_decay, ns_dtype=ns_dtype)

    # ------------------------------------------------------------------------- automatic batch size
    # the largest micro-batch of B rows of max_seq_len tokens (one packed row of
    # B*max_seq_len tokens, or B padded rows) whose training step fits; then max_tokens_per_device = B*max_seq_len.
    # Probed before the model is built.
    if max_tokens_per_device is None:
        build = sft_builder(model_config, packing, ac_policy, osft_rank_ratio=osft_rank_ratio,
                            osft_matrices=osft_matrices, **opt_kwargs)
        rows, _ = discover_device_batch_size(
            build, max_seq_len=max_seq_len, vocab_size=model_config.vocab_size,
            total_batch_size=max_seq_len * world_size * 64, world_size=world_size, device=device,
            amp_dtype=compute_dtype, compile=use_compile, margin=batch_size_margin, device_memory_gb=device_memory_gb,
            max_batch_size=max_batch_size, use_cache=batch_size_cache, key_fields={"stage": "sft"},
            record_path=os.path.join(run_dir, "auto_batch_size.json"))
        max_tokens_per_device = rows * max_seq_len
        print0(f"max_tokens_per_device = {rows} x {max_seq_len} = {max_tokens_per_device:,}")

    # ------------------------------------------------------------------------- data
    # every rank renders all conversations (lpt_pack needs every length) and takes its share of each step
    t0 = time.time()
    spec = tasks + (f",jsonl:{jsonl}" if jsonl else "")
    max_len = min(max_seq_len, max_tokens_per_device)
    train, n_trunc, n_drop = render_all(tokenizer, load_task_mixture(spec, "train", seed, skip_bad_rows), max_len,
                                        "train")
    val_convs = load_task_mixture(spec, "val", seed, skip_bad_rows)[:eval_examples]
    val, v_trunc, v_drop = render_all(tokenizer, val_convs, max_len, "val")
    if not train:
        raise UserError(f"--tasks={spec!r}: no training conversation left (after --long_conversations="
                        f"{long_conversations} at {max_len} tokens)")
    chatcore_sets = {}  # the in-loop ChatCORE's problems: the first chatcore_max_problems of each benchmark
    if chatcore_every > 0:
        require_isolation(unsafe_code)  # HumanEval runs model-written code: one line when it cannot be isolated
        data_source = resolve_source(chatcore_data)  # the hub is asked once
        for name in BENCHMARKS:
            convs = rank0_first(lambda name=name: TASKS[name].load("test", data_source), device)[0]
            chatcore_sets[name] = convs[:chatcore_max_problems] if chatcore_max_problems > 0 else convs
    sampler = ConversationSampler(len(train), seed=seed)
    if ckpt is not None:
        sampler.load_state_dict(ckpt["rank_state"]["sampler"])
    epoch_steps = max(1, len(train) // examples_per_step)
    total_steps = num_iterations if num_iterations is not None else epoch_steps
    pad_id = tokenizer.get_bos_token_id()

    def batches_of(examples):
        """This rank's micro-batches of a list of (ids, mask); the plan is the same on every rank."""
        plan = lpt_pack([len(ids) for ids, _ in examples], max_tokens_per_device, world_size,
                        max_conversations_per_device, padded=not packing)
        return [micro_batch([examples[i] for i in mb[rank]], packing, pad_id, device) for mb in plan]

    # ------------------------------------------------------------------------- model
    # the source weights (or this run's checkpoint) in fp32, then its optimizers, compiled and wrapped
    seed_everything(seed)
    model = build_model(model_config, device, start, tokenizer.get_vocab_size(), tokenizer_sha256=tokenizer_sha256)
    source_path = ckpt["meta"]["source"] if ckpt is not None else src["path"]
    del src, start
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
        model = torch.compile(model, dynamic=True)
    model = training.wrap_ddp(model, device, world_size)  # DDP for more than one process, else the model itself

    # ------------------------------------------------------------------------- logging
    peak_flops, peak_source = get_peak_flops(device, compute_dtype)
    mean_len = sum(len(ids) for ids, _ in train) / len(train)
    print0(f"Device: {device} x {world_size} | dtype {str(compute_dtype).removeprefix('torch.')} | "
           f"compile {use_compile}")
    print0(f"Source: {source_path}" + (f" ({stage})" if ckpt is None else f" (resuming from {ckpt['path']})"))
    print0(f"Model: n_layer {model_config.n_layer}, model_dim {model_config.model_dim}, n_head {model_config.n_head}, "
           f"vocab {model_config.vocab_size:,}, params {num_params:,}, FLOPs/token {flops_per_token:.3e}")
    print0(f"AdamW lrs scaled by (model_dim/768)**-0.5 = {adamw_lr_scale(model_config.model_dim):.6f}")
    print0(f"Data: {spec} | {len(train):,} train conversations (mean {mean_len:.0f} tokens), {len(val):,} val "
           f"({time.time() - t0:.1f}s to load and render)")
    print0(f"Long conversations (> {max_len} tokens, --long_conversations={long_conversations}): train "
           f"{n_trunc} truncated, {n_drop} dropped; val {v_trunc} truncated, {v_drop} dropped")
    if n_drop > 0.1 * (len(train) + n_drop):
        print0(f"warning: {100 * n_drop / (len(train) + n_drop):.0f}% of the training conversations were dropped; "
               f"raise --max_seq_len / --max_tokens_per_device or use --long_conversations=truncate")
    print0(f"Batch: {examples_per_step} conversations per step; micro-batches of <= {max_tokens_per_device:,} tokens "
           f"and <= {max_conversations_per_device} conversations per rank; {'packed' if packing else 'padded'} rows")
    print0(f"Steps: {total_steps:,} ({total_steps / epoch_steps:.2f} epochs of {epoch_steps} steps)")
    print0(f"MFU peak: {'n/a' if peak_flops is None else f'{peak_flops:.3e} FLOP/s per device'} ({peak_source})")
    metrics = run.open_run_log(run_dir, settings, ckpt["meta"]["step"] if ckpt is not None else None, master, device)

    def checkpoint(step, tokens_seen, train_time):
        meta = {"config": settings, "model_config": vars(model_config), "tokens_seen": tokens_seen,
                "tokenizer_sha256": tokenizer_sha256,
                "train_time": train_time, "max_seq_len": max_seq_len, "source": source_path,
                "max_conversations_per_device": max_conversations_per_device,
                "examples_per_step": examples_per_step}
        rank_state = {"rng": rng_state(device), "sampler": sampler.state_dict()}
        path = save_checkpoint(run_dir, step, orig_model, optimizers, meta, rank_state, rank, world_size, keep_last,
                               osft_state=osft.state_dict() if osft is not None else None)
        print0(f"Saved checkpoint {path}")

    # ------------------------------------------------------------------------- training loop
    if ckpt is not None:  # last: the set-up above seeds and draws from the RNGs (model init, the CPU MFU probe)
        set_rng_state(ckpt["rank_state"]["rng"], device)
    step = ckpt["meta"]["step"] if ckpt is not None else 0
    tokens_seen = ckpt["meta"]["tokens_seen"] if ckpt is not None else 0
    train_time = ckpt["meta"]["train_time"] if ckpt is not None else 0.0
    val_loss = None
    stop = False
    pending = None  # the last step's loss, gradient norm and stop flag, still on the device (training.step_stats)
    eta = run.ETA(total_steps)  # the time left from the mean step time, not the last step's
    while True:
        if pending is not None:  # the step's one host read, once it is queued whole: checks, stop flag, log line
            stats, t0, lrm, count, n_batches, step_tokens, epoch = pending
            train_loss, grad_norm, stop = training.read_step_stats(stats, step - 1, run_dir)  # NaN: UserError
            pending = None
            dt = time.time() - t0  # the read waited for the step's last kernel
            if step > 1 or ckpt is not None:  # the first step includes warm-up / compilation
                train_time += dt
            line, row = run.step_log_line(step, total_steps, loss=train_loss if count else float("nan"),
                                          grad_norm=grad_norm, lrm=lrm, dt=dt, tokens=step_tokens,
                                          flops_per_token=flops_per_token, peak_flops=peak_flops,
                                          world_size=world_size, eta_s=eta.update(step, dt))
            print0(f"{line} | targets {count} | micro-batches {n_batches}")
            metrics.log(**row, tokens=tokens_seen, targets=count, micro_batches=n_batches, epoch=epoch)
        last_step = step == total_steps or stop
        # checkpoint first, so that an eval or sampling crash never loses the training (a resumed run has its own)
        if run.save_due(step, last_step, save_every, ckpt["meta"]["step"] if ckpt is not None else None):
            checkpoint(step, tokens_seen, train_time)
        if stop:
            print0(f"Stopped at step {step} on request; resume with --resume=True "
                   f"--run_name={os.path.basename(run_dir)}")
            break
        # validation loss on held-out conversations (also at the resume step: see MetricsLog)
        if val and (last_step or (eval_every > 0 and step % eval_every == 0)):
            t0 = time.time()
            val_loss = evaluate_loss(orig_model, batches_of(val), autocast_ctx,
                                     stop=lambda: any_rank(nanotrain.stop.requested, device))
            if val_loss is None:  # a stop request during the evaluation: save this step and stop
                stop = True  # (a resumed run evaluates at its first step)
                continue
            print0(f"step {step:05d}/{total_steps:05d} | val loss {val_loss:.6f} | eval {time.time() - t0:.1f}s")
            metrics.log(step=step, val_loss=val_loss)
        # a small ChatCORE: the five benchmarks, chatcore_max_problems each, problems strided over ranks
        if chatcore_sets and (last_step or step % chatcore_every == 0):
            t0 = time.time()
            engine = Engine(orig_model, tokenizer)
            results = {name: score_task(orig_model, tokenizer, engine, name, convs, max_tokens=512,
                                        autocast_ctx=autocast_ctx, device=device)
                       for name, convs in chatcore_sets.items()}
            score = chatcore(results)
            print0(f"step {step:05d}/{total_steps:05d} | ChatCORE {score:.4f} | "
                   + " ".join(f"{n} {r['accuracy']:.3f}" for n, r in results.items())
                   + f" | {chatcore_max_problems} problems each | {time.time() - t0:.1f}s")
            metrics.log(step=step, chatcore=score, **{f"chatcore_{n}": r["accuracy"] for n, r in results.items()})
        # greedy answers to a few validation questions: shown, never able to fail the run (it is saved above)
        if master and (last_step or (sample_every > 0 and step % sample_every == 0 and step > 0)):
            engine = Engine(orig_model, tokenizer)
            for c in val_convs[:3]:
                prompt = tokenizer.render_for_completion(c)
                if len(prompt) + 48 > orig_model.config.max_seq_len:
                    print0(f"sample: skipped, its prompt of {len(prompt)} tokens leaves no room for an answer")
                    continue
                try:
                    with autocast_ctx:
                        out = engine.generate([prompt], max_tokens=48, temperature=0.0, tool=True)[0]
                except Exception as e:  # the sample is a glance at the model, not part of the run's result
                    print0(f"warning: a sample failed ({type(e).__name__}: {str(e).splitlines()[0][:120]}); "
                           f"the run goes on")
                    continue
                print0(f"sample: {c['messages'][-2]['content'][:200]!r} -> {tokenizer.decode(out)!r}")
        if last_step:
            break

        # one optimizer step, queued without a host read: this rank's micro-batches of the next examples_per_step
        # conversations; the loss is the mean over every trained token of the step on all ranks (forward_backward
        # scales each micro-batch's sum); a non-finite gradient norm leaves the weights as they are (on the device)
        t0 = time.time()
        examples = [train[i] for i in sampler.take(examples_per_step)]
        epoch = sampler.epoch  # the epoch of this step's conversations, logged with it
        batches = batches_of(examples)
        count = global_target_count(sum(b["targets"] for b in batches), device)  # before any backward
        lrm = training.lr_multiplier(step, total_steps, 0.0, warmdown_ratio, 0.0)
        if count > 0:  # each micro-batch's summed loss x world size / count: DDP's mean is the global token mean
            scaled_loss = training.forward_backward(model, batches, autocast_ctx,
                                                    loss_scale=token_loss_scale(count, world_size if is_ddp else 1))
            # clip, set the scheduled lr, update, zero the gradients
            grad_norm = training.optimizer_step(orig_model, optimizers, lrm, MUON_MOMENTUM, grad_clip)
        else:  # no update for a step without a trained token
            print0(f"warning: step {step + 1} has no trained token (all masked); skipping the update")
            orig_model.zero_grad(set_to_none=True)
            scaled_loss, grad_norm = torch.zeros((), device=device), None
        step_tokens = sum(len(ids) for ids, _ in examples)
        stats = training.step_stats(scaled_loss, grad_norm, nanotrain.stop.requested, device)  # every rank the same
        pending = (stats, t0, lrm, count, len(batches), step_tokens, epoch)  # read at the top of the loop
        step += 1
        tokens_seen += step_tokens

    # ------------------------------------------------------------------------- the end
    # replicas agree, the summary, the report card section
    summary = (f"Done: {step} steps, {tokens_seen:,} tokens, training time {train_time / 60:.2f} min, "
               f"final val loss {val_loss if val_loss is None else round(val_loss, 4)}")
    run.finish_run(orig_model, run_dir, metrics, summary)
    # the training and its checkpoint are done: a report card that cannot be written is a warning, not a failure
    write_section_or_warn(os.path.basename(run_dir), "sft", run_dir, {"wall_time_s": time.time() - t_start})


if __name__ == "__main__":
    run_script(main, trains=True)
