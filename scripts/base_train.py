"""
Pretrain a GPT on plain text: the base model.

    python scripts/base_train.py --depth=4 --max_seq_len=256 --device_batch_size=8 --total_batch_size=4096
    torchrun --standalone --nproc_per_node=8 scripts/base_train.py --depth=20

Outputs go to <base_dir>/base/<run>/ (base_dir: $NANOTRAIN_BASE_DIR or ~/.cache/nanotrain): config.json,
metrics.jsonl and checkpoints/. Needs a tokenizer (python scripts/tok_train.py).
"""

import json
import os
import time

import torch

from nanotrain.auto_batch_size import discover_device_batch_size, drop_cached, gpt_builder
from nanotrain.checkpoint import get_run_dir, load_latest, load_optimizers, rng_state, save_checkpoint, set_rng_state
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
from nanotrain.fsdp import gathered_root, shard_model
from nanotrain.report import write_section
from nanotrain.training import (
    MetricsLog,
    StopSignals,
    check_finite,
    check_replicas,
    forward_backward,
    forward_backward_or_step_down,
    global_mean_and_flag,
    lr_multiplier,
    muon_momentum,
    optimizer_step,
    precision,
    step_log_line,
)

# ----------------------------------------------------------------------------- settings
run_name = ""  # outputs go to <base_dir>/base/<run_name>; "" means d<depth> (not --run: torchrun claims that prefix)
data = "builtin"  # training text: builtin (offline), fineweb-edu, or a local directory/glob of parquet/jsonl/txt
device_type = ""  # cuda | mps | cpu; "" autodetects
seed = 42  # seed of the weight initialisation
# model
depth = 20  # n_layer; model_dim = depth * 64, head dim 128 (fewer heads for small models)
max_seq_len = 2048  # tokens per row (context length)
# batch
device_batch_size = None  # rows per micro-batch per device; None: discovered (auto_batch_size) or 32
total_batch_size = 524288  # tokens per optimizer step, all ranks and micro-batches together
auto_batch_size = False  # discover the largest device_batch_size that fits (only grad_accum_steps changes)
batch_size_margin = 0.85  # fraction of device memory the training step may use (bytes, not batch units)
batch_size_cache = True  # reuse discoveries from <base_dir>/auto_batch_cache
device_memory_gb = None  # device memory budget in GiB; None: the GPU's memory, or half the available RAM on CPU
max_batch_size = None  # upper bound for discovered device_batch_size (None: no bound)
# training horizon: num_iterations if > 0, else target_param_data_ratio * params tokens
num_iterations = -1  # optimizer steps; -1 derives it from target_param_data_ratio
target_param_data_ratio = 20  # tokens per parameter (Chinchilla) when num_iterations is -1
# optimizer
matrix_lr = 0.02  # Muon lr of the transformer blocks' matrices
embedding_lr = 0.2  # AdamW lr of the token embedding (scaled by (model_dim/768)**-0.5)
unembedding_lr = 0.004  # AdamW lr of the lm_head (scaled by (model_dim/768)**-0.5)
weight_decay = 0.0  # AdamW weight decay
ns_dtype = ""  # Muon's Newton-Schulz dtype: float32 | bfloat16; "" means bf16 on CUDA and on CPUs with fast bf16 matmuls
grad_clip = 1.0  # clip the global gradient norm to this; 0 turns clipping off
warmup_ratio = 0.0  # fraction of the steps with a linear lr warmup
warmdown_ratio = 0.2  # fraction of the steps at the end with a linear lr decay to final_lr_frac
final_lr_frac = 0.0  # lr multiplier at the last step
# evaluation, sampling, checkpoints (-1 turns each off, except at the end of the run)
eval_every = 250  # steps between validation bpb evaluations
eval_tokens = 20 * 524288  # validation tokens per evaluation
sample_every = 2000  # steps between greedy samples of a few fixed prompts (rank 0)
save_every = 1000  # steps between checkpoints
keep_last = 2  # checkpoints kept on disk (0 keeps all)
resume = False  # continue from the newest complete checkpoint of this run
# precision and speed
dtype = ""  # bfloat16 | float32; "" means bfloat16 autocast on CUDA, float32 elsewhere
compile = None  # torch.compile the model; None means on for CUDA, off elsewhere
activation_checkpointing = False  # recompute each block in backward: far less activation memory, ~1/3 more compute
fsdp = False  # shard parameters, gradients and optimizer state with FSDP2 (torchrun with >1 rank)
config = configure(globals(), none_types={"device_batch_size": (int,), "device_memory_gb": (float,),
                                          "max_batch_size": (int,), "compile": (bool,)})
# -----------------------------------------------------------------------------

def batch_arithmetic_error(total, B, T, world):
    """One line explaining why total_batch_size is not a multiple of B*T*world, with the nearest valid values."""
    per = B * T * world
    lo, hi = (total // per) * per, (total // per + 1) * per
    valid = f"--total_batch_size={lo} or {hi}" if lo > 0 else f"--total_batch_size={hi}"
    msg = (f"--total_batch_size={total} is not a multiple of device_batch_size * max_seq_len * world_size = "
           f"{B} * {T} * {world} = {per}; nearest valid: {valid}")
    if total % (T * world) == 0:
        n = total // (T * world)
        divisors = [d for d in range(1, n + 1) if n % d == 0]
        near = sorted(divisors, key=lambda d: abs(d - B))[:3]
        msg += f", or --device_batch_size in {sorted(near)} (divisors of {total} / ({T} * {world}) = {n})"
    return msg


def main():
    t_start = time.time()  # wall time of the stage, for the report card
    from nanotrain.dataloader import TokenLoader
    from nanotrain.dataset import resolve_data_files
    from nanotrain.gpt import GPT, config_from_depth
    from nanotrain.loss_eval import evaluate_bpb
    from nanotrain.tokenizer import get_token_bytes, get_tokenizer

    global device_batch_size
    is_ddp, rank, local_rank, world_size, device = compute_init(device_type)
    master = rank == 0
    signals = StopSignals()
    amp, autocast_ctx = precision(dtype, device)  # fp32 master weights; bf16 autocast on CUDA by default
    use_compile = (device.type == "cuda") if compile is None else compile
    if use_compile:
        check_compile_toolchain(device)
    use_fsdp = fsdp and world_size > 1
    if fsdp and not use_fsdp:
        print0("--fsdp=True with one process: nothing to shard, training without FSDP")

    # tokenizer and model config
    tokenizer = get_tokenizer()
    token_bytes = get_token_bytes(device)
    vocab_size = tokenizer.get_vocab_size()
    if depth < 1 or max_seq_len < 1:
        raise UserError(f"--depth={depth} and --max_seq_len={max_seq_len} must be positive")
    model_config = config_from_depth(depth, vocab_size, max_seq_len)

    # batch arithmetic: only grad_accum_steps depends on the device batch size; the optimization does not
    # run directory
    run_dir = get_run_dir("base", run_name or f"d{depth}")

    ab_record = None  # the auto batch size discovery: before the model is built, so CUDA probes have the memory
    if device_batch_size is not None:
        if auto_batch_size:
            print0(f"--device_batch_size={device_batch_size} given: skipping the automatic discovery")
    elif auto_batch_size:
        build = gpt_builder(model_config, activation_checkpointing=activation_checkpointing, matrix_lr=matrix_lr,
                            embedding_lr=embedding_lr, unembedding_lr=unembedding_lr, weight_decay=weight_decay,
                            ns_dtype=ns_dtype)
        device_batch_size, ab_record = discover_device_batch_size(
            build, max_seq_len=max_seq_len, vocab_size=vocab_size, total_batch_size=total_batch_size,
            world_size=world_size, device=device, amp_dtype=torch.bfloat16 if amp == "bfloat16" else None,
            compile=use_compile, margin=batch_size_margin, device_memory_gb=device_memory_gb,
            max_batch_size=max_batch_size, use_cache=batch_size_cache, key_fields={})
        if master:
            atomic_write_json(os.path.join(run_dir, "auto_batch_size.json"), ab_record)
        if use_fsdp:
            print0(f"--fsdp=True: device_batch_size={device_batch_size} was measured for the unsharded (DDP) model, "
                   f"which needs more memory per device than FSDP; no out-of-memory step-down under FSDP")
    else:
        device_batch_size = 32
        print0(f"device_batch_size not set: using the fixed default {device_batch_size}")
    if device_batch_size < 1 or total_batch_size < 1:
        raise UserError(f"--device_batch_size={device_batch_size} and --total_batch_size={total_batch_size} "
                        f"must be positive")
    world_tokens_per_fwdbwd = device_batch_size * max_seq_len * world_size
    if total_batch_size % world_tokens_per_fwdbwd != 0:
        raise UserError(batch_arithmetic_error(total_batch_size, device_batch_size, max_seq_len, world_size))
    grad_accum_steps = total_batch_size // world_tokens_per_fwdbwd

    # resume state
    ckpt = load_latest(run_dir, torch.device("cpu") if use_fsdp else device, rank) if resume else None
    if resume and ckpt is None:
        print0(f"warning: --resume=True but {run_dir} has no complete checkpoint; starting fresh")
    if ckpt is not None:
        old = ckpt["meta"]["config"]
        for key in ("depth", "max_seq_len", "total_batch_size", "data"):
            if old[key] != config[key]:
                raise UserError(f"--resume=True: the checkpoint in {run_dir} has {key}={old[key]!r} but this run "
                                f"has --{key}={config[key]!r}")
        if ckpt["meta"]["world_size"] != world_size or ckpt["rank_state"] is None:
            raise UserError(f"--resume=True: the checkpoint {ckpt['path']} was written with world_size "
                            f"{ckpt['meta']['world_size']}; resume with the same number of processes ({world_size})")

    # model: built on the meta device, materialised on the device, then initialised (or loaded)
    seed_everything(seed)
    with torch.device("meta"):
        model = GPT(model_config)
    model.to_empty(device=torch.device("cpu") if use_fsdp else device)  # FSDP: whole on the host only, sharded below
    model.init_weights()
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
    model.activation_checkpointing = activation_checkpointing  # before DDP / compile wrap it
    if use_fsdp:  # in place, block by block onto the device (the CPU init equals DDP's on CPU, not CUDA's RNG)
        shard_model(model, device, amp)
    orig_model = model
    num_params = model.num_params()
    flops_per_token = model.estimate_flops()
    optimizers = model.setup_optimizers(matrix_lr=matrix_lr, embedding_lr=embedding_lr,
                                        unembedding_lr=unembedding_lr, weight_decay=weight_decay, ns_dtype=ns_dtype)
    if ckpt is not None:
        load_optimizers(model, optimizers, ckpt["optim"])
    if use_compile:
        model = torch.compile(model, dynamic=False)
    if is_ddp and not use_fsdp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda"
                                                          else None)

    # horizon
    if num_iterations > 0:
        total_steps = num_iterations
    elif target_param_data_ratio > 0:
        total_steps = max(1, int(target_param_data_ratio * num_params) // total_batch_size)
    else:
        raise UserError("set --num_iterations > 0 or --target_param_data_ratio > 0")

    # data
    train_files = resolve_data_files(data, "train")
    val_files = resolve_data_files(data, "val")
    train_loader = TokenLoader(tokenizer, train_files, device_batch_size, max_seq_len, device, rank, world_size)
    if ckpt is not None:
        train_loader.load_state_dict(ckpt["rank_state"]["loader"])
        set_rng_state(ckpt["rank_state"]["rng"], device)

    def val_batches():
        return TokenLoader(tokenizer, val_files, device_batch_size, max_seq_len, device, rank, world_size)
    eval_steps = max(1, eval_tokens // (device_batch_size * max_seq_len * world_size))

    # logging
    peak_flops, peak_source = get_peak_flops(device, torch.float32 if amp == "float32" else torch.bfloat16)
    print0(f"Device: {device} x {world_size} | dtype {amp} | compile {use_compile} | fsdp {use_fsdp}")
    print0(f"Model: depth {depth}, model_dim {model_config.model_dim}, n_head {model_config.n_head}, "
           f"vocab {vocab_size:,}, params {num_params:,}, FLOPs/token {flops_per_token:.3e}")
    print0(f"Tokens / micro-batch / rank: {device_batch_size} x {max_seq_len} = {device_batch_size * max_seq_len:,}")
    print0(f"Total batch size {total_batch_size:,} tokens => gradient accumulation steps: {grad_accum_steps}")
    print0(f"Steps: {total_steps:,} ({total_steps * total_batch_size:,} tokens, "
           f"{total_steps * total_batch_size / num_params:.1f} tokens/param)")
    print0(f"MFU peak: {peak_flops:.3e} FLOP/s per device ({peak_source})")
    print0(f"Run directory: {run_dir}")
    if master:
        print0("Config: " + json.dumps(config, sort_keys=True))
        atomic_write_json(os.path.join(run_dir, "config.json"), config)
    metrics = MetricsLog(run_dir, ckpt["meta"]["step"] if ckpt is not None else None, master)

    def checkpoint(step, tokens_seen, train_time):
        meta = {"config": config, "model_config": vars(model_config), "tokens_seen": tokens_seen,
                "train_time": train_time, "device_batch_size": device_batch_size, "max_seq_len": max_seq_len,
                "total_batch_size": total_batch_size}
        rank_state = {"rng": rng_state(device), "loader": train_loader.state_dict()}
        path = save_checkpoint(run_dir, step, orig_model, optimizers, meta, rank_state, rank, world_size, keep_last)
        print0(f"Saved checkpoint {path}")

    prompts = ["The capital of France is", "A list in Python is", "The opposite of hot is", "def add(a, b):"]

    # ------------------------------------------------------------------------- training loop
    step = ckpt["meta"]["step"] if ckpt is not None else 0
    tokens_seen = ckpt["meta"]["tokens_seen"] if ckpt is not None else 0
    train_time = ckpt["meta"]["train_time"] if ckpt is not None else 0.0
    val_bpb = None
    stop = False
    while True:
        last_step = step == total_steps or stop
        # checkpoint first, so that an eval or sampling crash never loses the training
        if step > 0 and (last_step or (save_every > 0 and step % save_every == 0)) and not (
                ckpt is not None and step == ckpt["meta"]["step"] and not last_step):
            checkpoint(step, tokens_seen, train_time)
        if stop:
            print0(f"Stopped at step {step} on request; resume with --resume=True")
            break
        if last_step or (eval_every > 0 and step % eval_every == 0):
            t0 = time.time()
            val_bpb = evaluate_bpb(model, val_batches(), eval_steps, token_bytes, autocast_ctx)
            print0(f"step {step:05d}/{total_steps:05d} | val bpb {val_bpb:.4f} | eval {time.time() - t0:.1f}s")
            metrics.log(step=step, val_bpb=val_bpb)
        if (master or use_fsdp) and (last_step or (sample_every > 0 and step % sample_every == 0 and step > 0)):
            with gathered_root(orig_model):  # FSDP: every rank runs the same forwards (all-gathers), rank 0 prints
                for p in prompts:
                    ids = tokenizer.encode(p, prepend=tokenizer.get_bos_token_id())
                    with autocast_ctx:
                        out = list(orig_model.generate(ids, max_tokens=16, temperature=0.0))
                    print0(f"sample: {p!r} -> {tokenizer.decode(out)!r}")
        if last_step:
            break

        # one optimizer step: grad_accum_steps micro-batches, gradients synced on the last one only
        synchronize(device)
        t0 = time.time()
        x, y = train_loader.next_batch(device_batch_size * grad_accum_steps)  # this step's rows, all micro-batches
        if ab_record is None or use_fsdp:  # no OOM step-down under FSDP (collectives inside forward/backward)
            loss = forward_backward(model, x, y, device_batch_size, autocast_ctx)
        else:  # a discovered size: an OOM steps every rank down to the next candidate and redoes the step
            loss, micro = forward_backward_or_step_down(model, x, y, device_batch_size, ab_record["candidates"],
                                                        autocast_ctx)
            if micro != device_batch_size:
                if master:
                    drop_cached(ab_record["cache_key"])
                ab_record["step_downs"] = ab_record.get("step_downs", []) + [[step, device_batch_size, micro]]
                if master:
                    atomic_write_json(os.path.join(run_dir, "auto_batch_size.json"), ab_record)
                device_batch_size, grad_accum_steps = micro, total_batch_size // (micro * max_seq_len * world_size)
        train_loss, stop = global_mean_and_flag(loss, signals.requested, device)
        check_finite(train_loss, step, run_dir)
        lrm = lr_multiplier(step, total_steps, warmup_ratio, warmdown_ratio, final_lr_frac)
        grad_norm = optimizer_step(orig_model, optimizers, lrm, muon_momentum(step), grad_clip)
        check_finite(grad_norm.item(), step, run_dir, "gradient norm")  # a NaN update was not applied
        synchronize(device)
        dt = time.time() - t0
        step += 1
        tokens_seen += total_batch_size
        if step > 1 or ckpt is not None:  # the first step includes warm-up / compilation
            train_time += dt
        line, row = step_log_line(step, total_steps, train_loss, grad_norm.item(), lrm, dt, total_batch_size,
                                  flops_per_token,
                                  peak_flops, world_size)
        print0(line)
        metrics.log(**row, tokens=tokens_seen)

    check_replicas(orig_model)
    print0(f"Done: {step} steps, {tokens_seen:,} tokens, training time {train_time / 60:.2f} min, "
           f"final val bpb {val_bpb if val_bpb is None else round(val_bpb, 4)}")
    print0(f"Outputs: {run_dir} (base dir {get_base_dir()})")
    metrics.close()
    report = write_section(os.path.basename(run_dir), "base", run_dir, {"wall_time_s": time.time() - t_start})
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
