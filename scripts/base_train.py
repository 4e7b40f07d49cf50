"""
Pretrain a GPT on plain text: the base model.

    python scripts/base_train.py --depth=4 --max_seq_len=256 --device_batch_size=8 --total_batch_size=4096
    torchrun --standalone --nproc_per_node=8 scripts/base_train.py --depth=20

Outputs go to <base_dir>/base/<run>/ (base_dir: $NANOTRAIN_BASE_DIR or ~/.cache/nanotrain): config.json,
metrics.jsonl and checkpoints/. Needs a tokenizer (python scripts/tok_train.py).
"""

import nanotrain.stop  # first, before torch: from here on SIGINT/SIGTERM ask the run to stop

# isort: split
import os
import time

import torch
import torch.distributed as dist

from nanotrain import run, training
from nanotrain.attention import attention_windows
from nanotrain.auto_batch_size.builders import gpt_builder
from nanotrain.auto_batch_size.model_memory import check_model_fits
from nanotrain.auto_batch_size.policy import discover_with_policy
from nanotrain.auto_batch_size.stepdown import OOMStepDown
from nanotrain.checkpoint import check_resume, load_optimizers, resume_checkpoint, save_checkpoint
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
from nanotrain.dataloader import TokenLoader
from nanotrain.dataset import resolve_data_files
from nanotrain.downloads import rank0_first
from nanotrain.engine import Engine
from nanotrain.errors import UserError
from nanotrain.evaluation.core_bundle import ensure_bundle
from nanotrain.evaluation.core_eval import evaluate_core, write_results
from nanotrain.evaluation.gold_bpb import ensure_rows, evaluate_gold_bpb
from nanotrain.fp8 import check_fp8, convert_to_fp8, describe
from nanotrain.fsdp import gathered_root, shard_model
from nanotrain.gpt import GPT, build_model, config_from_depth, policy_name
from nanotrain.loss_eval import evaluate_bpb
from nanotrain.optim import adamw_lr_scale, compile_optimizer_step, setup_optimizers
from nanotrain.report.card import write_section_or_warn
from nanotrain.tokenizer import get_token_bytes, get_tokenizer

# ----------------------------------------------------------------------------- settings
run_name = ""  # outputs go to <base_dir>/base/<run_name>; "" means d<depth> (not --run: torchrun claims that prefix)
data = "builtin"  # training text: builtin (offline), fineweb-edu, or a local directory/glob of parquet/jsonl/txt
row_packing = "contiguous"  # training rows: contiguous | best_fit | bos_aligned (nanotrain/dataloader.py)
device_type = ""  # cuda | mps | cpu; "" autodetects
seed = 42  # int: seed of the weight initialisation
# model
depth = 20  # >= 1: n_layer; model_dim = depth * 64, head dim 128 (fewer heads for small models)
max_seq_len = 2048  # >= 2: tokens per row (context length)
value_embeds = True  # value embeddings: token-indexed tables added to V through a per-head gate, every other block
smear = False  # add a gated share of the previous token's embedding to each token's
backout = False  # subtract a learned share of the middle block's output before the head
x0_lambdas = False  # learned per-block scalars mixing the embedding back in: x <- a_i * x + b_i * x0
rotary_base = 10000.0  # > 0: base of the rotary position frequencies
qk_scale = 1.0  # > 0: scale of the attention logits on top of 1/sqrt(head_dim)
window_pattern = "L"  # attention windows tiled over the layers, the last always L: L full, S short (e.g. SSSL)
short_window = None  # >= 1: an S layer's query at i attends keys i-short_window..i; None: max_seq_len/4 up to 128s
# batch
device_batch_size = None  # >= 1: rows per micro-batch per device; None: discovered (auto_batch_size) or 32
total_batch_size = -1  # >= 1: tokens per optimizer step, all ranks and micro-batches together; -1: from the horizon
auto_batch_size = False  # discover the largest device_batch_size that fits (only grad_accum_steps changes)
batch_size_margin = 0.85  # (0, 1]: fraction of device memory the training step may use (bytes, not batch units)
batch_size_cache = True  # reuse discoveries from <base_dir>/auto_batch_cache
device_memory_gb = None  # > 0: device memory budget in GiB; None: the GPU's memory, or half the available RAM on CPU
max_batch_size = None  # >= 1: upper bound for discovered device_batch_size (None: no bound)
# training horizon: num_iterations if set, else target_flops if > 0, else target_param_data_ratio * scaling params
num_iterations = None  # >= 0: optimizer steps; None derives them from target_flops or target_param_data_ratio
target_flops = -1.0  # > 0: training FLOPs of the run (steps = target_flops / (flops per token * total_batch_size))
target_param_data_ratio = 12  # > 0: tokens per scaling parameter (nanochat's default; the speedrun record uses 8)
hparam_transfer = True  # lrs x sqrt(B/2^19), Muon weight decay x sqrt(B/2^19) * D_ref/D (training.hparam_transfer_scales)
# optimizer
matrix_lr = 0.02  # >= 0: Muon lr of the transformer blocks' matrices
embedding_lr = 0.3  # >= 0: AdamW lr of the token embedding (scaled by (model_dim/768)**-0.5)
unembedding_lr = 0.008  # >= 0: AdamW lr of the lm_head (scaled by (model_dim/768)**-0.5)
scalar_lr = 0.5  # >= 0: AdamW lr of the learned scalars (x0_lambdas; resid_lambdas get 1/100 of it, smear/backout 0.4)
weight_decay = 0.01  # >= 0: AdamW weight decay (embeddings, lm_head; decays with the lr)
embedding_beta2 = 0.995  # [0, 1): AdamW beta2 of the token and value embeddings
unembedding_beta2 = 0.96  # [0, 1): AdamW beta2 of the lm_head
muon_weight_decay = 0.28  # >= 0: Muon's cautious weight decay (decays with the lr); None: training.muon_weight_decay_for
polar_express = True  # Muon orthogonalises with the Polar Express coefficients (else the fixed Newton-Schulz quintic)
muon_beta2 = 0.0  # [0, 1): NorMuon: EMA factor of the update's per-row variance (0 turns it off)
ns_dtype = ""  # Muon's Newton-Schulz dtype: float32 | bfloat16; "" means bf16 on CUDA and on CPUs with fast bf16 matmuls
momentum = 0.95  # [0, 1): Muon's momentum after its warmup
momentum_warmup = 300  # >= 0: steps of Muon's linear momentum warmup from 0.85 (0: none)
final_momentum = None  # [0, 1): Muon's momentum at the last step, reached linearly over the lr warmdown; None: no decay
grad_clip = 0.0  # >= 0: clip the global gradient norm to this (on the device, no sync); 0: off, as nanochat
lr_warmup_steps = 40  # >= 0: optimizer steps of linear lr warmup (nanochat's 40)
warmdown_ratio = 0.65  # [0, 1]: fraction of the steps at the end with a linear lr decay to final_lr_frac
final_lr_frac = 0.05  # [0, 1]: lr multiplier at the last step
# evaluation, sampling, checkpoints (-1 turns each off, except at the end of the run)
eval_every = 250  # -1 or >= 1: steps between validation bpb evaluations
eval_tokens = None  # >= 1: validation tokens per evaluation; None: 20 x 2^19 on CUDA (nanochat's), 2^20 elsewhere
sample_every = 2000  # -1 or >= 1: steps between greedy samples of a few fixed prompts (rank 0)
save_every = 1000  # -1 or >= 1: steps between checkpoints
keep_last = 2  # >= 0: checkpoints kept on disk (0 keeps all)
core_every = -1  # -1 or >= 1: steps between CORE evaluations (and at the end, not at 0); each step saved before it
core_max_per_task = 500  # -1 or >= 1: rows per CORE task in the loop (-1: all)
core_log_samples = False  # also write core_samples.jsonl (one record per CORE row) next to core.json at each CORE evaluation
eval_bundle = ""  # a CORE eval bundle directory copied by hand; "" downloads it once into <base_dir>/eval_bundle
own_eval_bundle = False  # True: --eval_bundle is your own bundle, not compared with the pinned one (only checked)
gold_bpb_every = -1  # -1 or >= 1: steps between gold-answer bpb evaluations (NOT CORE; nanotrain/evaluation/gold_bpb.py)
wandb_project = ""  # log metrics.jsonl's rows to this Weights & Biases project too (rank 0); "" is off
resume = False  # continue from the newest complete checkpoint of this run
# precision and speed
dtype = ""  # bfloat16 | float32; "" means bfloat16 autocast on CUDA and on CPUs with fast bf16 matmuls, else float32
compile = None  # torch.compile the model; None means on for CUDA, off elsewhere
activation_checkpointing = ""  # none|selective|full|auto (nanotrain/gpt.py); "": auto on CUDA if discovered, else none
fsdp = False  # shard parameters, gradients and optimizer state with FSDP2 (torchrun with >1 rank)
fp8 = False  # the blocks' Linears in float8 with dynamic scaling (torchao; CUDA capability >= 8.9); nanotrain/fp8.py
fp8_recipe = "tensorwise"  # --fp8's scaling: tensorwise (one scale per tensor) | rowwise (per row, slower, more exact)
fp8_emulate = False  # --fp8=True on any device with the float8 casts emulated in fp32 (for tests: no speed-up)
config = configure(globals(), none_types={"num_iterations": (int,), "device_batch_size": (int,),
                                          "muon_weight_decay": (float,), "final_momentum": (float,),
                                          "device_memory_gb": (float,), "max_batch_size": (int,), "compile": (bool,),
                                          "eval_tokens": (int,), "short_window": (int,)})
# -----------------------------------------------------------------------------

# settings a resume must share with its checkpoint (device_batch_size may change: the same tokens; so may fp8: the
# checkpoint holds the same fp32 weights with and without it)
RESUME_KEYS = ("depth", "max_seq_len", "total_batch_size", "data", "row_packing", "value_embeds", "smear", "backout",
               "x0_lambdas", "rotary_base", "qk_scale", "window_pattern", "short_window")
SAMPLE_PROMPTS = ["The capital of France is", "A list in Python is", "The opposite of hot is", "def add(a, b):"]


def main():
    t_start = time.time()  # wall time of the stage, for the report card
    is_ddp, rank, local_rank, world_size, device = compute_init(device_type)
    master = rank == 0
    compute_dtype, autocast_ctx = training.precision(dtype, device)  # fp32 master weights; bf16 autocast where fast
    # nanochat's evaluation size is sized for 8 GPUs: 10.5 M tokens would take ~20 minutes on a CPU at depth 4
    eval_tokens = config["eval_tokens"] = config["eval_tokens"] or (20 * 2**19 if device.type == "cuda" else 2**20)
    use_compile = training.resolve_compile(compile, device)  # None: on for CUDA, off elsewhere
    config["activation_checkpointing"] = training.resolve_activation_checkpointing(
        activation_checkpointing, device, config["device_batch_size"] is None and auto_batch_size)
    ac_policy = policy_name(config["activation_checkpointing"], allow_auto=True)  # auto: chosen with the batch size
    use_fsdp = fsdp and world_size > 1
    if fp8:  # one line before anything is built: no FP8 tensor cores, no torchao, an unknown recipe
        check_fp8(fp8_recipe, fp8_emulate, device)
    if fsdp and not use_fsdp:
        print0("--fsdp=True with one process: nothing to shard, training without FSDP")
    if use_fsdp and (core_every > 0 or gold_bpb_every > 0):
        raise UserError("--core_every and --gold_bpb_every need the whole model on every rank: not with --fsdp=True "
                        "(evaluate the saved checkpoint with scripts/base_eval.py instead)")

    # ------------------------------------------------------------------------- tokenizer, model config, run directory
    tokenizer = get_tokenizer()
    tokenizer_sha256 = tokenizer.fingerprint()  # stored in every checkpoint, checked on every load
    token_bytes = get_token_bytes(device)
    vocab_size = tokenizer.get_vocab_size()
    model_config = config_from_depth(depth, vocab_size, max_seq_len, value_embeds=value_embeds, smear=smear,
                                     backout=backout, x0_lambdas=x0_lambdas, rotary_base=rotary_base, qk_scale=qk_scale,
                                     window_pattern=window_pattern, short_window=short_window)

    check_model_fits(model_config, device, f"--depth={depth}", world_size if use_fsdp else 1)  # before any memory
    # ------------------------------------------------------------------------- horizon, total batch, lr and wd transfer
    # nanochat's recipe: the horizon D = target_param_data_ratio x scaling parameters (blocks + lm_head) in tokens,
    # D_ref the same for depth 12 (where the defaults were tuned, at 2^19 tokens per step); total_batch_size=-1 picks
    # the batch from D / D_ref; the lrs and Muon's weight decay then move with the batch and the horizon
    with torch.device("meta"):
        horizon = int(target_param_data_ratio * GPT(model_config).num_scaling_params())
        ref_config = config_from_depth(12, vocab_size, max_seq_len, value_embeds=value_embeds, smear=smear,
                                       backout=backout, x0_lambdas=x0_lambdas, rotary_base=rotary_base, qk_scale=qk_scale)
        ref_horizon = target_param_data_ratio * GPT(ref_config).num_scaling_params()
    total_batch_size = total_batch_size_flag = config["total_batch_size"]
    if total_batch_size == -1:
        total_batch_size = training.auto_total_batch_size(horizon, ref_horizon)
    lr_scale, wd_scale = (training.hparam_transfer_scales(total_batch_size, horizon, ref_horizon) if hparam_transfer
                          else (1.0, 1.0))
    matrix_lr, embedding_lr, unembedding_lr, scalar_lr = (config[k] * lr_scale for k in (
        "matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr"))
    muon_wd = config["muon_weight_decay"]
    if muon_wd is None:  # 0.4, shrinking with the width squared above model_dim 512 (not transferred)
        muon_wd = training.muon_weight_decay_for(model_config.model_dim)
    else:
        muon_wd *= wd_scale
    config["total_batch_size"] = total_batch_size  # config.json keeps the size used, a resume checks it
    config["recipe"] = {"total_batch_size": total_batch_size, "automatic": total_batch_size != total_batch_size_flag,
                        "horizon_tokens": horizon, "ref_horizon_tokens": ref_horizon, "lr_scale": lr_scale,
                        "weight_decay_scale": wd_scale, "muon_weight_decay": muon_wd}
    print0(f"Recipe: total batch {total_batch_size:,} tokens ({'automatic' if config['recipe']['automatic'] else 'given'}"
           f"), horizon {horizon:,} tokens (depth-12 reference {ref_horizon:,.0f}), lrs x {lr_scale:.4f}, Muon weight "
           f"decay {muon_wd:.4f} (x {wd_scale:.4f})")
    train_files = resolve_data_files(data, "train")  # before anything is written: bad --data leaves no trace
    val_files = resolve_data_files(data, "val")
    # the downstream evaluations' data before anything is written: offline, one line and no run directory
    bundle = rank0_first(lambda: ensure_bundle(eval_bundle, own_eval_bundle), device) if core_every > 0 else None
    gold_rows = rank0_first(ensure_rows, device) if gold_bpb_every > 0 else None
    run_dir = run.get_run_dir("base", run_name or f"d{depth}")
    run.lock_run_dir(run_dir, device, rank)  # one writer per run: a second run of this name refuses

    # ------------------------------------------------------------------------- device batch size
    # given, discovered (before the model is built, so CUDA probes have the memory), or 32;
    # only grad_accum_steps depends on it, the optimization does not
    device_batch_size = config["device_batch_size"]
    step_down = None  # with a discovered size: steps every rank down to a smaller size on out-of-memory
    if device_batch_size is not None and auto_batch_size:
        print0(f"--device_batch_size={device_batch_size} given: skipping the automatic discovery")
    if device_batch_size is None and not auto_batch_size:
        device_batch_size = 32
        print0(f"device_batch_size not set: using the fixed default {device_batch_size}")
    if device_batch_size is None or ac_policy == "auto":
        if device_batch_size is not None:  # a given size that does not divide the batch: one line, before probing
            training.grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, world_size)
        build = lambda policy: gpt_builder(  # noqa: E731
            model_config, activation_checkpointing=policy, matrix_lr=matrix_lr, embedding_lr=embedding_lr,
            unembedding_lr=unembedding_lr, scalar_lr=scalar_lr, weight_decay=weight_decay, ns_dtype=ns_dtype,
            muon_weight_decay=muon_wd, polar_express=polar_express, muon_beta2=muon_beta2,
            fp8_recipe=fp8_recipe if fp8 else None, fp8_emulate=fp8_emulate)  # the probes run the fp8 step
        record_path = os.path.join(run_dir, "auto_batch_size.json")
        discovered = device_batch_size is None
        ac_policy, device_batch_size, ab_record = discover_with_policy(
            build, ac_policy, device_batch_size=device_batch_size, max_seq_len=max_seq_len, vocab_size=vocab_size,
            total_batch_size=total_batch_size, world_size=world_size, device=device, amp_dtype=compute_dtype,
            compile=use_compile, margin=batch_size_margin, device_memory_gb=device_memory_gb,
            max_batch_size=max_batch_size, use_cache=batch_size_cache, key_fields={}, record_path=record_path)
        if use_fsdp:  # no step-down under FSDP: its collectives run inside forward and backward
            print0(f"--fsdp=True: device_batch_size={device_batch_size} was measured for the unsharded (DDP) model, "
                   f"which needs more memory per device than FSDP; no out-of-memory step-down under FSDP")
        elif discovered:
            step_down = OOMStepDown(ab_record, record_path, device_batch_size)

    def batch_sizes(device_batch_size):  # everything that depends on the device batch size, here and after a step-down
        grad_accum_steps = training.grad_accum_steps_for(total_batch_size, device_batch_size, max_seq_len, world_size)
        eval_steps = max(1, eval_tokens // (device_batch_size * max_seq_len * world_size))  # always eval_tokens
        return device_batch_size, grad_accum_steps, eval_steps
    device_batch_size, grad_accum_steps, eval_steps = batch_sizes(device_batch_size)
    rows_per_step = device_batch_size * grad_accum_steps  # per rank, all micro-batches: fixed by total_batch_size

    # ------------------------------------------------------------------------- resume
    # the newest complete checkpoint of this run, written with the same data and sizes
    ckpt = resume_checkpoint(run_dir, torch.device("cpu") if use_fsdp else device, rank, device) if resume else None
    if ckpt is not None:
        check_resume(ckpt, run_dir, config, RESUME_KEYS, world_size)

    # ------------------------------------------------------------------------- model
    # initialised from the seed (or loaded), then sharded (FSDP), its optimizers, then compiled and wrapped
    seed_everything(seed)
    model = build_model(model_config, device, ckpt, vocab_size, tokenizer_sha256=tokenizer_sha256,
                        init_device=torch.device("cpu") if use_fsdp else None)  # FSDP: whole on the host only
    if fp8:  # the block Linears, before FSDP / compile / DDP and the optimizers (the same fp32 Parameters)
        print0(describe(convert_to_fp8(model, fp8_recipe, fp8_emulate, fsdp_float8_all_gather=use_fsdp and device.type
                                       == "cuda" and fp8_recipe == "tensorwise"), fp8_recipe, fp8_emulate))
    model.activation_checkpointing = ac_policy  # before FSDP / DDP / compile wrap it
    if use_fsdp:  # in place, block by block onto the device (the CPU init equals DDP's on CPU, not CUDA's RNG);
        # with --compile each block is compiled before it is sharded (compile, then wrap)
        shard_model(model, device, compute_dtype, compile_backend="inductor" if use_compile else None)
    orig_model = model
    num_params = model.num_params()
    flops_per_token = model.estimate_flops()
    optimizers = setup_optimizers(model, matrix_lr=matrix_lr, embedding_lr=embedding_lr,
                                  unembedding_lr=unembedding_lr, scalar_lr=scalar_lr, weight_decay=weight_decay,
                                  ns_dtype=ns_dtype, muon_weight_decay=muon_wd, embedding_beta2=embedding_beta2,
                                  unembedding_beta2=unembedding_beta2,
                                  polar_express=polar_express, muon_beta2=muon_beta2,
                                  process_group=dist.group.WORLD if world_size > 1 else None)  # Muon shares its work
    if ckpt is not None:
        for change in load_optimizers(model, optimizers, ckpt["optim"]):  # lrs and weight decay: this run's flags
            print0(f"--resume=True: optimizer setting from this run's flags: {change}")
    if use_compile:  # compile, then wrap in DDP (torch's documented order; FSDP: the blocks, above); the optimizer step
        if not use_fsdp:
            model = torch.compile(model, dynamic=False)
        compile_optimizer_step(optimizers, device)
    if not use_fsdp:
        model = training.wrap_ddp(model, device, world_size)  # DDP for more than one process, else the model itself

    # ------------------------------------------------------------------------- horizon
    if num_iterations is not None:
        total_steps = num_iterations
    elif target_flops > 0:  # the FLOPs of the run: steps of flops_per_token x total_batch_size each
        total_steps = max(1, round(target_flops / (flops_per_token * total_batch_size)))
    else:
        total_steps = max(1, horizon // total_batch_size)

    # ------------------------------------------------------------------------- data
    # each rank reads its own share of the documents; the loader's position is part of every checkpoint
    train_loader = TokenLoader(tokenizer, train_files, device_batch_size, max_seq_len, device, rank, world_size,
                               row_packing=row_packing)
    if ckpt is not None:
        train_loader.load_state_dict(ckpt["rank_state"]["loader"])

    def val_batches():  # contiguous rows whatever row_packing is: every validation token counted once
        return TokenLoader(tokenizer, val_files, device_batch_size, max_seq_len, device, rank, world_size)

    # ------------------------------------------------------------------------- logging
    peak_flops, peak_source = get_peak_flops(device, compute_dtype)
    print0(f"Device: {device} x {world_size} | dtype {str(compute_dtype).removeprefix('torch.')} | "
           f"compile {use_compile} | fsdp {use_fsdp}")
    print0(f"Model: depth {depth}, model_dim {model_config.model_dim}, n_head {model_config.n_head}, "
           f"vocab {vocab_size:,}, params {num_params:,}, FLOPs/token {flops_per_token:.3e}")
    print0(f"AdamW lrs scaled by (model_dim/768)**-0.5 = {adamw_lr_scale(model_config.model_dim):.6f}; "
           f"Muon weight decay {muon_wd:.4f}")
    windows = attention_windows(model_config)
    if any(w is not None for w in windows):  # the windows' backend: nanotrain/attention.py
        short = [i for i, w in enumerate(windows) if w is not None]
        print0(f"Attention windows: pattern {window_pattern}, layers {short} see keys i-{model_config.short_window}"
               f"..i, the others full causal")
    print0(f"Tokens / micro-batch / rank: {device_batch_size} x {max_seq_len} = {device_batch_size * max_seq_len:,}")
    print0(f"Total batch size {total_batch_size:,} tokens => gradient accumulation steps: {grad_accum_steps}")
    print0(f"Steps: {total_steps:,} ({total_steps * total_batch_size:,} tokens, "
           f"{total_steps * total_batch_size / num_params:.1f} tokens/param)")
    print0(f"MFU peak: {'n/a' if peak_flops is None else f'{peak_flops:.3e} FLOP/s per device'} ({peak_source})")
    print0(f"Validation: {eval_steps * device_batch_size * max_seq_len * world_size:,} tokens per evaluation "
           f"({eval_steps} batches of {device_batch_size} x {max_seq_len}{f' x {world_size} ranks' if world_size > 1 else ''}"
           f"), {f'every {eval_every} steps and ' if eval_every > 0 else ''}at the end; the first prints its ETA after "
           f"its second batch")
    metrics = run.open_run_log(run_dir, config, ckpt["meta"]["step"] if ckpt is not None else None, master, device)

    def checkpoint(step, tokens_seen, train_time):
        meta = {"config": config, "model_config": vars(model_config), "tokens_seen": tokens_seen,
                "tokenizer_sha256": tokenizer_sha256,
                "train_time": train_time, "device_batch_size": device_batch_size, "max_seq_len": max_seq_len,
                "total_batch_size": total_batch_size}
        rank_state = {"rng": rng_state(device), "loader": train_loader.state_dict()}
        path = save_checkpoint(run_dir, step, orig_model, optimizers, meta, rank_state, rank, world_size, keep_last)
        print0(f"Saved checkpoint {path}")

    # ------------------------------------------------------------------------- training loop
    if ckpt is not None:  # last: the set-up above draws from the RNGs (the CPU MFU probe's matmul inputs)
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
            stats, t0, lrm = pending
            train_loss, grad_norm, stop = training.read_step_stats(stats, step - 1, run_dir)  # NaN: UserError
            pending = None
            dt = time.time() - t0  # the read waited for the step's last kernel
            if step > 1 or ckpt is not None:  # the first step includes warm-up / compilation
                train_time += dt
            line, row = run.step_log_line(step, total_steps, loss=train_loss, grad_norm=grad_norm, lrm=lrm, dt=dt,
                                          tokens=total_batch_size, flops_per_token=flops_per_token,
                                          peak_flops=peak_flops, world_size=world_size, eta_s=eta.update(step, dt))
            print0(line)
            metrics.log(**row, tokens=tokens_seen)
        last_step = step == total_steps or stop
        # checkpoint first, so that an eval or sampling crash never loses the training (a resumed run has its own)
        resume_step = ckpt["meta"]["step"] if ckpt is not None else None
        core_due = core_every > 0 and step > 0 and not stop and (last_step or step % core_every == 0)
        # CORE runs long: its step is saved before it starts (a crash or stop request in it loses nothing)
        if run.save_due(step, last_step, save_every, resume_step) or (core_due and step not in (0, resume_step)):
            checkpoint(step, tokens_seen, train_time)
        if stop:
            print0(f"Stopped at step {step} on request; resume with --resume=True")
            break
        # validation bpb (also at the resume step: see MetricsLog)
        if last_step or (eval_every > 0 and step % eval_every == 0):
            t0 = time.time()
            val_bpb = evaluate_bpb(model, val_batches(), eval_steps, token_bytes, autocast_ctx,
                                   stop=lambda: any_rank(nanotrain.stop.requested, device),
                                   log_eta=print0 if val_bpb is None else None)
            if val_bpb is None:  # a stop request during the evaluation: save this step and stop
                stop = True  # (a resumed run evaluates at its first step)
                continue
            print0(f"step {step:05d}/{total_steps:05d} | val bpb {val_bpb:.4f} | eval {time.time() - t0:.1f}s")
            metrics.log(step=step, val_bpb=val_bpb)
        # downstream: gold-answer bpb (not CORE) and CORE, on the unwrapped model
        if gold_bpb_every > 0 and (last_step or step % gold_bpb_every == 0):
            t0 = time.time()
            gold = evaluate_gold_bpb(orig_model, tokenizer, gold_rows, token_bytes, device, autocast_ctx)
            print0(f"step {step:05d}/{total_steps:05d} | gold-answer bpb (not CORE) {gold['gold_bpb']:.4f} ("
                   + ", ".join(f"{k} {v:.4f}" for k, v in gold.items() if k != "gold_bpb")
                   + f") | {time.time() - t0:.1f}s")
            metrics.log(step=step, **{("gold_bpb" if k == "gold_bpb" else f"gold_bpb_{k}"): v for k, v in gold.items()})
        if core_due:
            t0 = time.time()
            core = evaluate_core(orig_model, tokenizer, bundle, device, autocast_ctx, core_max_per_task,
                                 stop=lambda: any_rank(nanotrain.stop.requested, device), log_samples=core_log_samples)
            if core is None:  # a stop request during CORE: this step is saved (above), stop here
                print0(f"Stopped at step {step} during CORE; its checkpoint is saved: resume with --resume=True")
                break
            print0(f"step {step:05d}/{total_steps:05d} | CORE {core['core']:.4f} | {time.time() - t0:.1f}s")
            metrics.log(step=step, core=core["core"])
            if master:
                write_results(run_dir, core, step)
        # greedy samples of a few fixed prompts
        if (master or use_fsdp) and (last_step or (sample_every > 0 and step % sample_every == 0 and step > 0)):
            with gathered_root(orig_model):  # FSDP: every rank runs the same forwards (all-gathers), rank 0 prints
                for p in SAMPLE_PROMPTS:
                    ids = tokenizer.encode(p, prepend=tokenizer.get_bos_token_id())
                    with autocast_ctx:
                        out = Engine(orig_model, tokenizer).generate([ids], 16, ignore_eos=True)[0]
                    print0(f"sample: {p!r} -> {tokenizer.decode(out)!r}")
        if last_step:
            break

        # one optimizer step, queued without a host read: this step's rows as grad_accum_steps micro-batches,
        # gradients synced on the last one; a non-finite gradient norm leaves the weights as they are (on the device)
        t0 = time.time()
        x, y = train_loader.next_batch(rows_per_step)
        if step_down is not None:  # an out-of-memory steps every rank down to a smaller size and redoes the step
            loss = step_down.forward_backward(model, x, y, autocast_ctx, step)
            if step_down.device_batch_size != device_batch_size:
                device_batch_size, grad_accum_steps, eval_steps = batch_sizes(step_down.device_batch_size)
        else:
            loss = training.forward_backward(model, training.micro_batches(x, y, device_batch_size), autocast_ctx)
        # clip, set the scheduled lr and momentum, update, zero the gradients
        lrm = training.lr_multiplier(step, total_steps, min(1.0, lr_warmup_steps / total_steps), warmdown_ratio,
                                     final_lr_frac)
        mom = training.muon_momentum(step, warmup_steps=momentum_warmup, start=0.85, end=momentum,
                                     total_steps=total_steps, warmdown_ratio=warmdown_ratio, final=final_momentum)
        grad_norm = training.optimizer_step(orig_model, optimizers, lrm, mom, grad_clip)
        stats = training.step_stats(loss, grad_norm, nanotrain.stop.requested, device)  # every rank the same
        pending = (stats, t0, lrm)  # read at the top of the loop
        step += 1
        tokens_seen += total_batch_size

    # ------------------------------------------------------------------------- the end
    # replicas agree, the summary, the report card section
    summary = (f"Done: {step} steps, {tokens_seen:,} tokens, training time {train_time / 60:.2f} min, "
               f"final val bpb {val_bpb if val_bpb is None else round(val_bpb, 4)}")
    run.finish_run(orig_model, run_dir, metrics, summary)
    # the training and its checkpoint are done: a report card that cannot be written is a warning, not a failure
    write_section_or_warn(os.path.basename(run_dir), "base", run_dir, {"wall_time_s": time.time() - t_start})


if __name__ == "__main__":
    run_script(main, trains=True)
