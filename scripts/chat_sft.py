"""
Chat SFT: fine-tune on conversations, training only on the assistant's tokens (the render mask).

    python scripts/chat_sft.py
    python scripts/chat_sft.py --jsonl=/data/chat.jsonl --skip_bad_rows=True
    torchrun --standalone --nproc_per_node=8 scripts/chat_sft.py --max_tokens_per_device=16384

Starts from the newest mid checkpoint (or base, with --source=base or when there is no mid run).
Each optimizer step takes the next examples_per_step conversations of the shuffled mixture (ConversationSampler) and
spreads them over ranks and micro-batches longest-first (nanotrain.sft_data.lpt_pack) under max_tokens_per_device
tokens per micro-batch, so every rank runs the same number of micro-batches (a rank with nothing left runs a
zero-weight one). With packing, a micro-batch is one padding-free row (attention kept inside each conversation);
with --packing=False it is one padded row per conversation. The step's loss is the sum of the per-token losses over
all trained tokens on all ranks divided by their global count, counted before the backward passes, so the gradient
does not depend on max_tokens_per_device, device_batch_size or the number of ranks (nanotrain.sft_data).
Defaults: examples_per_step 32 as nanochat v0 (target_examples_per_step), one epoch, lr decaying linearly to 0,
init_lr_frac 0.8 as nanochat HEAD; on the CPU recipe's depth-4 model after mid-training, 100 steps gave val loss
0.522 / 0.507 / 0.486 / 0.472 at init_lr_frac 0.02 / 0.1 / 0.3 / 1.0 (from 0.535), so small models want the high end.
Outputs go to <base_dir>/sft/<run>/ (config.json, metrics.jsonl, checkpoints/), read by chat_cli.py and chat_eval.py.
"""

import json
import os
import time

import torch

from nanotrain.auto_batch_size import discover_device_batch_size
from nanotrain.checkpoint import find_run_dir, get_run_dir, load_latest, rng_state, save_checkpoint, set_rng_state
from nanotrain.common import (
    UserError,
    atomic_write_json,
    check_compile_toolchain,
    compute_cleanup,
    compute_init,
    die,
    exit_process,
    get_base_dir,
    get_peak_flops,
    print0,
    seed_everything,
    synchronize,
)
from nanotrain.configurator import configure
from nanotrain.report import write_section
from nanotrain.training import (
    MetricsLog,
    StopSignals,
    check_finite,
    check_replicas,
    global_mean_and_flag,
    lr_multiplier,
    optimizer_step,
    precision,
    step_log_line,
)

# ----------------------------------------------------------------------------- settings
run_name = ""  # outputs go to <base_dir>/sft/<run_name>; "" means the source run's name
source = "mid"  # the stage to start from: mid | base (mid falls back to base when there is no mid checkpoint)
source_run_name = ""  # the run of that stage; "" picks the one with the newest checkpoint
tasks = "arith:1,spell:1,identity:2"  # task mixture: NAME[:WEIGHT] of arith, spell, identity, jsonl:PATH, hf:NAME
jsonl = ""  # an extra JSONL file of conversations ({"messages": [...]} per line; every 20th line is held out for val)
skip_bad_rows = False  # skip (and count) malformed JSONL lines instead of stopping at the first one
device_type = ""  # cuda | mps | cpu; "" autodetects
seed = 42  # seed of the task generation and of the data order
# batch
examples_per_step = 32  # conversations per optimizer step, all ranks together
max_tokens_per_device = None  # token budget of one micro-batch on one rank (packed: its row length at most); None: 2048 or discovered
auto_batch_size = False  # discover the largest max_tokens_per_device (a multiple of max_seq_len) that fits
batch_size_margin = 0.85  # fraction of device memory the training step may use (bytes, not batch units)
batch_size_cache = True  # reuse discoveries from <base_dir>/auto_batch_cache
device_memory_gb = None  # device memory budget in GiB; None: the GPU's memory, or half the available RAM on CPU
max_batch_size = None  # upper bound for the discovered rows of max_seq_len tokens per micro-batch (None: 64)
device_batch_size = 32  # at most this many conversations per micro-batch per rank
packing = True  # padding-free packed rows; False: one padded row per conversation
max_seq_len = -1  # longest conversation in tokens; -1: the source checkpoint's max_seq_len
long_conversations = "truncate"  # conversations longer than min(max_seq_len, max_tokens_per_device): truncate | drop
num_iterations = -1  # optimizer steps; -1 is one epoch (conversations // examples_per_step)
# optimizer: base_train's learning rates times init_lr_frac, linear decay to 0 over the run (nanochat chat_sft)
init_lr_frac = 0.8  # multiplier of all the lrs below (nanochat HEAD: 0.8; v0: 0.02 for d20 after mid-training)
matrix_lr = 0.02  # Muon lr of the transformer blocks' matrices
embedding_lr = 0.2  # AdamW lr of the token embedding (scaled by (model_dim/768)**-0.5)
unembedding_lr = 0.004  # AdamW lr of the lm_head (scaled by (model_dim/768)**-0.5)
weight_decay = 0.0  # AdamW weight decay
ns_dtype = ""  # Muon's Newton-Schulz dtype: float32 | bfloat16; "" means bf16 on CUDA and on CPUs with fast bf16 matmuls
grad_clip = 1.0  # clip the global gradient norm to this; 0 turns clipping off
warmdown_ratio = 1.0  # fraction of the steps at the end with a linear lr decay to 0 (1.0: the whole run)
# evaluation, checkpoints (-1 turns each off, except at the end of the run)
eval_every = 100  # steps between validation losses on held-out conversations
eval_examples = 400  # validation conversations per evaluation (the first ones of the val mixture)
sample_every = -1  # steps between greedy answers to a few validation questions (rank 0)
save_every = 500  # steps between checkpoints
keep_last = 2  # checkpoints kept on disk (0 keeps all)
resume = False  # continue from the newest complete checkpoint of this run
# precision and speed
dtype = ""  # bfloat16 | float32; "" means bfloat16 autocast on CUDA, float32 elsewhere
compile = False  # torch.compile the model (packed rows vary in length, so it recompiles often: off by default)
activation_checkpointing = False  # recompute each block in backward: far less activation memory, ~1/3 more compute
config = configure(globals(), none_types={"max_tokens_per_device": (int,), "device_memory_gb": (float,),
                                          "max_batch_size": (int,)})
# -----------------------------------------------------------------------------

RESUME_KEYS = ("tasks", "jsonl", "skip_bad_rows", "seed", "examples_per_step", "max_seq_len", "long_conversations")
MUON_MOMENTUM = 0.95  # constant in SFT (nanochat chat_sft keeps Muon's default)


def find_source_dir():
    """The run directory to start from and its stage ("mid" or "base"). Raises UserError if there is none."""
    if source not in ("mid", "base"):
        raise UserError(f"--source={source!r}: expected 'mid' or 'base'")
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


def render_all(tokenizer, convs, max_len):
    """Renders conversations and applies the long-conversation policy. Returns ([(ids, mask)], truncated, dropped)."""
    from nanotrain.sft_data import fit_conversation
    out, counts = [], {"ok": 0, "truncated": 0, "dropped": 0}
    for c in convs:
        ids, mask = tokenizer.render_conversation(c, max_tokens=2**62)
        ids, mask, status = fit_conversation(ids, mask, max_len, long_conversations)
        counts[status] += 1
        if ids is not None:
            out.append((ids, mask))
    return out, counts["truncated"], counts["dropped"]


class PackedRows(torch.nn.Module):
    """
    The memory shape chat_sft trains for the batch-size probes: B rows of T tokens run as one packed row of B*T
    tokens with B segments (block-diagonal attention), or as B padded rows with packing=False.
    """

    def __init__(self, model, packing):
        super().__init__()
        self.model, self.packing = model, packing

    def forward(self, x, y):
        if not self.packing:
            return self.model(x, y)
        B, T = x.shape
        doc_ids = torch.arange(B, device=x.device).repeat_interleave(T).view(1, B * T)
        return self.model(x.reshape(1, B * T), y.reshape(1, B * T), doc_ids=doc_ids)


def sft_builder(model_config, packing, activation_checkpointing=False, **optimizer_kwargs):
    """build_model(device) -> (PackedRows(GPT), [adamw, muon]) for nanotrain.auto_batch_size (see gpt_builder)."""
    from nanotrain.gpt import GPT

    def build_model(device):
        with torch.device(device):
            model = GPT(model_config)
        model.init_weights()
        model.activation_checkpointing = bool(activation_checkpointing)
        return PackedRows(model, packing), model.setup_optimizers(**optimizer_kwargs)
    build_model.key_fields = {"gpt_config": dict(vars(model_config)), "packing": packing,
                              "activation_checkpointing": bool(activation_checkpointing),
                              "optimizer_kwargs": dict(optimizer_kwargs)}
    return build_model


def main():
    t_start = time.time()  # wall time of the stage, for the report card
    from nanotrain.engine import Engine
    from nanotrain.gpt import GPT, GPTConfig
    from nanotrain.sft_data import (
        LONG_POLICIES,
        ConversationSampler,
        backward_step,
        evaluate_loss,
        lpt_pack,
        micro_batch,
    )
    from nanotrain.tasks import load_task_mixture
    from nanotrain.tokenizer import get_tokenizer

    is_ddp, rank, local_rank, world_size, device = compute_init(device_type)
    master = rank == 0
    signals = StopSignals()
    amp, autocast_ctx = precision(dtype, device)
    use_compile = compile
    if use_compile:
        check_compile_toolchain(device)
    tokenizer = get_tokenizer()
    if long_conversations not in LONG_POLICIES:
        raise UserError(f"--long_conversations={long_conversations!r}: expected one of {', '.join(LONG_POLICIES)}")
    global max_tokens_per_device
    if max_tokens_per_device is not None and auto_batch_size:
        print0(f"--max_tokens_per_device={max_tokens_per_device} given: skipping the automatic discovery")
    if max_tokens_per_device is None and not auto_batch_size:
        max_tokens_per_device = 2048
    if min(examples_per_step, max_tokens_per_device or 1, device_batch_size) < 1:
        raise UserError(f"--examples_per_step={examples_per_step}, --max_tokens_per_device={max_tokens_per_device} "
                        f"and --device_batch_size={device_batch_size} must be >= 1")

    # this run's checkpoint (resume) or the source checkpoint (fresh run)
    source_dir, stage = (None, None) if (resume and run_name) else find_source_dir()
    run_name_ = run_name or os.path.basename(source_dir)
    run_dir = get_run_dir("sft", run_name_)
    ckpt = load_latest(run_dir, device, rank) if resume else None
    src = None
    if ckpt is None:
        if resume:
            print0(f"warning: --resume=True but {run_dir} has no complete checkpoint; starting fresh")
        if source_dir is None:
            source_dir, stage = find_source_dir()
        src = load_latest(source_dir, device, rank, load_optimizer=False)
        if src is None:
            raise UserError(f"{source_dir} has no readable checkpoint; train one first")
    start = ckpt if ckpt is not None else src
    T = max_seq_len if max_seq_len > 0 else start["meta"]["max_seq_len"]
    settings = dict(config, max_seq_len=T)
    if ckpt is not None:
        old = ckpt["meta"]["config"]
        for key in RESUME_KEYS:
            if old[key] != settings[key]:
                raise UserError(f"--resume=True: the checkpoint in {run_dir} has {key}={old[key]!r} but this run "
                                f"has --{key}={settings[key]!r}")
        if ckpt["meta"]["world_size"] != world_size or ckpt["rank_state"] is None:
            raise UserError(f"--resume=True: the checkpoint {ckpt['path']} was written with world_size "
                            f"{ckpt['meta']['world_size']}; resume with the same number of processes ({world_size})")
    if tokenizer.get_vocab_size() != start["meta"]["model_config"]["vocab_size"]:
        raise UserError(f"the checkpoint {start['path']} has vocab_size {start['meta']['model_config']['vocab_size']}"
                        f" but the tokenizer has {tokenizer.get_vocab_size()}; was the tokenizer retrained?")

    # automatic batch size: the largest micro-batch of B rows of T tokens (one packed row of B*T tokens, or B padded
    # rows) whose training step fits; then max_tokens_per_device = B*T. Probed before the model is built.
    model_config = GPTConfig(**dict(start["meta"]["model_config"], max_seq_len=T))
    ab_record = None
    if max_tokens_per_device is None:
        build = sft_builder(model_config, packing, activation_checkpointing, matrix_lr=matrix_lr * init_lr_frac,
                            embedding_lr=embedding_lr * init_lr_frac, unembedding_lr=unembedding_lr * init_lr_frac,
                            weight_decay=weight_decay, ns_dtype=ns_dtype)
        rows, ab_record = discover_device_batch_size(
            build, max_seq_len=T, vocab_size=model_config.vocab_size, total_batch_size=T * world_size * 64,
            world_size=world_size, device=device, amp_dtype=torch.bfloat16 if amp == "bfloat16" else None,
            compile=use_compile, margin=batch_size_margin, device_memory_gb=device_memory_gb,
            max_batch_size=max_batch_size, use_cache=batch_size_cache, key_fields={"stage": "sft"})
        max_tokens_per_device = rows * T
        print0(f"max_tokens_per_device = {rows} x {T} = {max_tokens_per_device:,}")
        if master:
            atomic_write_json(os.path.join(run_dir, "auto_batch_size.json"), ab_record)

    # data: every rank renders all conversations (lpt_pack needs every length) and takes its share of each step
    t0 = time.time()
    spec = tasks + (f",jsonl:{jsonl}" if jsonl else "")
    max_len = min(T, max_tokens_per_device)
    train, n_trunc, n_drop = render_all(tokenizer, load_task_mixture(spec, "train", seed, skip_bad_rows), max_len)
    val_convs = load_task_mixture(spec, "val", seed, skip_bad_rows)[:eval_examples]
    val, v_trunc, v_drop = render_all(tokenizer, val_convs, max_len)
    if not train:
        raise UserError(f"--tasks={spec!r}: no training conversation left (after --long_conversations="
                        f"{long_conversations} at {max_len} tokens)")
    sampler = ConversationSampler(len(train), seed=seed)
    if ckpt is not None:
        sampler.load_state_dict(ckpt["rank_state"]["sampler"])
        set_rng_state(ckpt["rank_state"]["rng"], device)
    epoch_steps = max(1, len(train) // examples_per_step)
    total_steps = num_iterations if num_iterations > 0 else epoch_steps
    pad_id = tokenizer.get_bos_token_id()

    def batches_of(examples):
        """This rank's micro-batches of a list of (ids, mask); the plan is the same on every rank."""
        plan = lpt_pack([len(ids) for ids, _ in examples], max_tokens_per_device, world_size, device_batch_size,
                        padded=not packing)
        return [micro_batch([examples[i] for i in mb[rank]], packing, pad_id, device) for mb in plan]

    # model
    seed_everything(seed)
    with torch.device("meta"):
        model = GPT(model_config)
    model.to_empty(device=device)
    model.init_weights()
    model.load_state_dict(start["model"])
    model.activation_checkpointing = activation_checkpointing  # before DDP / compile wrap it
    orig_model = model
    num_params = model.num_params()
    flops_per_token = model.estimate_flops()
    optimizers = model.setup_optimizers(matrix_lr=matrix_lr * init_lr_frac, embedding_lr=embedding_lr * init_lr_frac,
                                        unembedding_lr=unembedding_lr * init_lr_frac, weight_decay=weight_decay,
                                        ns_dtype=ns_dtype)
    if ckpt is not None:
        for opt, state in zip(optimizers, ckpt["optim"]):
            opt.load_state_dict(state)
    if use_compile:
        model = torch.compile(model, dynamic=True)
    if is_ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda"
                                                          else None)
    source_path = ckpt["meta"]["source"] if ckpt is not None else src["path"]
    del src

    # logging
    peak_flops, peak_source = get_peak_flops(device, torch.float32 if amp == "float32" else torch.bfloat16)
    mean_len = sum(len(ids) for ids, _ in train) / len(train)
    print0(f"Device: {device} x {world_size} | dtype {amp} | compile {use_compile}")
    print0(f"Source: {source_path}" + (f" ({stage})" if ckpt is None else f" (resuming from {ckpt['path']})"))
    print0(f"Model: n_layer {model_config.n_layer}, model_dim {model_config.model_dim}, n_head {model_config.n_head}, "
           f"vocab {model_config.vocab_size:,}, params {num_params:,}, FLOPs/token {flops_per_token:.3e}")
    print0(f"Data: {spec} | {len(train):,} train conversations (mean {mean_len:.0f} tokens), {len(val):,} val "
           f"({time.time() - t0:.1f}s to load and render)")
    print0(f"Long conversations (> {max_len} tokens, --long_conversations={long_conversations}): train "
           f"{n_trunc} truncated, {n_drop} dropped; val {v_trunc} truncated, {v_drop} dropped")
    if n_drop > 0.1 * (len(train) + n_drop):
        print0(f"warning: {100 * n_drop / (len(train) + n_drop):.0f}% of the training conversations were dropped; "
               f"raise --max_seq_len / --max_tokens_per_device or use --long_conversations=truncate")
    print0(f"Batch: {examples_per_step} conversations per step; micro-batches of <= {max_tokens_per_device:,} tokens "
           f"and <= {device_batch_size} conversations per rank; {'packed' if packing else 'padded'} rows")
    print0(f"Steps: {total_steps:,} ({total_steps / epoch_steps:.2f} epochs of {epoch_steps} steps)")
    print0(f"MFU peak: {peak_flops:.3e} FLOP/s per device ({peak_source})")
    print0(f"Run directory: {run_dir}")
    if master:
        print0("Config: " + json.dumps(settings, sort_keys=True))
        atomic_write_json(os.path.join(run_dir, "config.json"), settings)
    metrics = MetricsLog(run_dir, ckpt["meta"]["step"] if ckpt is not None else None, master)

    def checkpoint(step, tokens_seen, train_time):
        meta = {"config": settings, "model_config": vars(model_config), "tokens_seen": tokens_seen,
                "train_time": train_time, "max_seq_len": T, "source": source_path,
                "device_batch_size": device_batch_size, "examples_per_step": examples_per_step}
        rank_state = {"rng": rng_state(device), "sampler": sampler.state_dict()}
        path = save_checkpoint(run_dir, step, orig_model, optimizers, meta, rank_state, rank, world_size, keep_last)
        print0(f"Saved checkpoint {path}")

    # ------------------------------------------------------------------------- training loop
    step = ckpt["meta"]["step"] if ckpt is not None else 0
    tokens_seen = ckpt["meta"]["tokens_seen"] if ckpt is not None else 0
    train_time = ckpt["meta"]["train_time"] if ckpt is not None else 0.0
    val_loss = None
    stop = False
    while True:
        last_step = step == total_steps or stop
        resumed_here = ckpt is not None and step == ckpt["meta"]["step"]  # its checkpoint exists already
        if step > 0 and (last_step or (save_every > 0 and step % save_every == 0)) and not (
                resumed_here and not last_step):
            checkpoint(step, tokens_seen, train_time)
        if stop:
            print0(f"Stopped at step {step} on request; resume with --resume=True --run_name={run_name_}")
            break
        if val and (last_step or (eval_every > 0 and step % eval_every == 0)):  # again after a resume
            t0 = time.time()
            val_loss = evaluate_loss(orig_model, batches_of(val), autocast_ctx)
            print0(f"step {step:05d}/{total_steps:05d} | val loss {val_loss:.6f} | eval {time.time() - t0:.1f}s")
            metrics.log(step=step, val_loss=val_loss)
        if master and (last_step or (sample_every > 0 and step % sample_every == 0 and step > 0)):
            engine = Engine(orig_model, tokenizer)
            for c in val_convs[:3]:
                prompt = tokenizer.render_for_completion(c)
                with autocast_ctx:
                    out = engine.generate([prompt], max_tokens=48, temperature=0.0)[0]
                print0(f"sample: {c['messages'][-2]['content']!r} -> {tokenizer.decode(out)!r}")
        if last_step:
            break

        # one optimizer step: this rank's micro-batches of the next examples_per_step conversations
        synchronize(device)
        t0 = time.time()
        examples = [train[i] for i in sampler.take(examples_per_step)]
        batches = batches_of(examples)
        scaled_loss, count = backward_step(model, batches, autocast_ctx)
        train_loss, stop = global_mean_and_flag(scaled_loss, signals.requested, device)
        lrm = lr_multiplier(step, total_steps, 0.0, warmdown_ratio, 0.0)
        if count == 0:
            print0(f"warning: step {step + 1} has no trained token (all masked); skipping the update")
            orig_model.zero_grad(set_to_none=True)
            grad_norm = None
        else:
            check_finite(train_loss, step, run_dir)
            grad_norm = optimizer_step(orig_model, optimizers, lrm, MUON_MOMENTUM, grad_clip)
            check_finite(grad_norm.item(), step, run_dir, "gradient norm")  # a NaN update was not applied
        synchronize(device)
        dt = time.time() - t0
        step += 1
        step_tokens = sum(len(ids) for ids, _ in examples)
        tokens_seen += step_tokens
        if step > 1 or ckpt is not None:
            train_time += dt
        gn = None if grad_norm is None else grad_norm.item()
        line, row = step_log_line(step, total_steps, train_loss if count else float("nan"), gn, lrm, dt, step_tokens,
                                  flops_per_token, peak_flops, world_size)
        print0(f"{line} | targets {count} | micro-batches {len(batches)}")
        metrics.log(**row, tokens=tokens_seen, targets=count, micro_batches=len(batches), epoch=sampler.epoch)

    check_replicas(orig_model)
    print0(f"Done: {step} steps, {tokens_seen:,} tokens, training time {train_time / 60:.2f} min, "
           f"final val loss {val_loss if val_loss is None else round(val_loss, 4)}")
    print0(f"Outputs: {run_dir} (base dir {get_base_dir()})")
    metrics.close()
    report = write_section(os.path.basename(run_dir), "sft", run_dir, {"wall_time_s": time.time() - t_start})
    if report:  # rank 0 only
        print0(f"Report card: {report}")


if __name__ == "__main__":
    try:
        main()
    except UserError as e:
        die(str(e))
    finally:
        compute_cleanup()
    exit_process(0)  # not sys.exit: see nanotrain.common.exit_process
