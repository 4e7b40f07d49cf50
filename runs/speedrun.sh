#!/usr/bin/env bash
# The 8-GPU recipe, the whole pipeline on the shape of nanochat's time-to-GPT-2 record (its Run 6: depth 24, data:param
# ratio 8, 2^20 tokens per step): a 32,768-token tokenizer and a depth-24 base model (730 M scaling parameters, 5.8 B
# tokens), the total batch automatic (2^20 tokens at this horizon), the lrs and Muon's weight decay transferred from
# depth 12 (nanochat's rules, scripts/base_train.py's defaults), the device batch found on the cards; on fineweb-edu,
# CORE, mid-training and SFT on the
# field's mixtures (SmolTalk, MMLU auxiliary train, GSM8K, ARC), the chat benchmarks and ChatCORE, RL on GSM8K, the
# report card. Needs the hub (the shards and the training mixtures are downloaded on first use).
#   bash runs/speedrun.sh
#   FP8=1 bash runs/speedrun.sh     # the blocks' matmuls in float8 (--fp8=True; H100/H200/B200: capability >= 8.9)
# What the record uses that nanotrain does not have: Flash Attention 3 kernels (nanotrain: flash-attn 2 or SDPA). FP8
# matmuls nanotrain has (--fp8=True, torchao's float8 training, nanotrain/fp8.py), off by default until the GPU check
# has measured them on a card: python scripts/bench.py --depth=24 --max_seq_len=2048 --device_batch_size=16 \
#   --total_batch_size=524288 --compile=True --vs="--fp8=True" (tokens/s of b / a in "vs.median_ratio").
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOTRAIN_BASE_DIR="${NANOTRAIN_BASE_DIR:-$HOME/.cache/nanotrain}"
export NANOTRAIN_FINEWEB_SHARDS="${NANOTRAIN_FINEWEB_SHARDS:-240}"  # ~24 GB of text: more than the 5.8 B tokens
export OMP_NUM_THREADS=1
NPROC="${NPROC:-8}"
FP8="${FP8:-0}"  # 1: base_train with --fp8=True

# 1. tokenizer on 2 B characters of fineweb-edu (downloads the shards)
python scripts/tok_train.py --data=fineweb-edu --vocab_size=32768 --max_chars=2000000000

# 2. pretraining
# Attention windows: full causal on every layer (--window_pattern=L, the default). The record trains SSSL (a 512-token
# window on three of every four layers); nanotrain has it (--window_pattern=SSSL: flash-attn 2's window or
# flex_attention on CUDA), but it stays off here until the GPU check has measured its tokens/s on a card.
echo "speedrun: attention windows L (full causal on every layer); --window_pattern=SSSL is not yet measured on a GPU"
# FP8 (the blocks' Linears in float8, tensorwise scaling; lm_head and embeddings bf16): off unless FP8=1
fp8_flag=""
if [ "$FP8" = "1" ]; then
    fp8_flag="--fp8=True"
    echo "speedrun: FP8 on (--fp8=True, tensorwise): the blocks' matmuls in float8, lm_head and embeddings in bf16"
else
    echo "speedrun: FP8 off (bf16 matmuls): not yet measured on a GPU; FP8=1 bash runs/speedrun.sh turns --fp8=True on"
fi
# Architecture and Muon as nanochat HEAD (karpathy/nanochat 92d63d4, nanochat/gpt.py and scripts/base_train.py) has
# them on, until an A/B on a GPU says otherwise: smear, backout, x0 / resid lambdas, rotary base 100,000 and queries
# and keys scaled by 1.2 each (--qk_scale=1.44), NorMuon (beta2 0.9), Muon's momentum 0.85 -> 0.97 over 400 steps and
# down to 0.90 over the warmdown. base_train's own defaults (off) are the CPU ablations' (dev/LOG.md); the README
# lists where the GPU recipe still differs from nanochat.
torchrun --standalone --nproc_per_node=$NPROC scripts/base_train.py --data=fineweb-edu --depth=24 --run_name=d24 \
    --target_param_data_ratio=8 --auto_batch_size=True \
    --smear=True --backout=True --x0_lambdas=True --rotary_base=100000 --qk_scale=1.44 \
    --muon_beta2=0.9 --momentum=0.97 --momentum_warmup=400 --final_momentum=0.90 $fp8_flag

# 3. CORE of the final model (the DCLM 22-task metric as nanochat computes it; downloads the ~162 MB eval bundle once;
#    GPT-2 1.5B scores 0.2565, see the README's "Base model evaluation (CORE)")
torchrun --standalone --nproc_per_node=$NPROC scripts/base_eval.py --run_name=d24

# 4. a sample
python scripts/sample.py --run_name=d24 --prompt="The capital of France is" --temperature=0

# 5. mid-training: the chat format, multiple choice and tool use on SmolTalk (460 K conversations), MMLU auxiliary
#    train (100 K) and GSM8K train (7.5 K, its <<expr=result>> annotations as calculator calls), one epoch
torchrun --standalone --nproc_per_node=$NPROC scripts/mid_train.py --run_name=d24 --base_run_name=d24 \
    --tasks=smoltalk:1,mmlu_aux:1,gsm8k:1

# 6. SFT on ARC-Easy + ARC-Challenge train, GSM8K train and a tenth of SmolTalk, with a small ChatCORE (24 problems
#    per benchmark) every 200 steps
torchrun --standalone --nproc_per_node=$NPROC scripts/chat_sft.py --run_name=d24 --source_run_name=d24 \
    --tasks=arc:1,gsm8k:1,smoltalk:0.1 --chatcore_every=200

# 7. the chat benchmarks on their full test sets (ARC-Easy, ARC-Challenge, MMLU, GSM8K, HumanEval) and ChatCORE
torchrun --standalone --nproc_per_node=$NPROC scripts/chat_eval.py --source=sft --run_name=d24 --tasks=chatcore

# 8. RL on GSM8K train (the calculator live), then the benchmarks again
torchrun --standalone --nproc_per_node=$NPROC scripts/chat_rl.py --run_name=d24 --source_run_name=d24 --tasks=gsm8k \
    --examples_per_step=16 --num_samples=16 \
    --max_new_tokens=256
torchrun --standalone --nproc_per_node=$NPROC scripts/chat_eval.py --source=rl --run_name=d24 --tasks=chatcore

# 9. the report card
python -m nanotrain.report d24
