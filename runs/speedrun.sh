#!/usr/bin/env bash
# The 8-GPU recipe, the whole pipeline as nanochat's speedrun: a 65,536-token tokenizer and a depth-20 base model
# (561 M parameters, 11.2 B tokens at 20 tokens per parameter) on fineweb-edu, CORE, mid-training and SFT on the
# field's mixtures (SmolTalk, MMLU auxiliary train, GSM8K, ARC), the chat benchmarks and ChatCORE, RL on GSM8K, the
# report card. Needs the hub (the shards and the training mixtures are downloaded on first use).
#   bash runs/speedrun.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOTRAIN_BASE_DIR="${NANOTRAIN_BASE_DIR:-$HOME/.cache/nanotrain}"
export NANOTRAIN_FINEWEB_SHARDS="${NANOTRAIN_FINEWEB_SHARDS:-240}"  # ~24 GB of text: enough for 11.2 B tokens
export OMP_NUM_THREADS=1
NPROC="${NPROC:-8}"

# 1. tokenizer on 2 B characters of fineweb-edu (downloads the shards)
python scripts/tok_train.py --data=fineweb-edu --vocab_size=65536 --max_chars=2000000000

# 2. pretraining
torchrun --standalone --nproc_per_node=$NPROC scripts/base_train.py --data=fineweb-edu --depth=20 --run_name=d20

# 3. CORE of the final model (the DCLM 22-task metric as nanochat computes it; downloads the ~162 MB eval bundle once;
#    GPT-2 1.5B scores 0.2565, see the README's "Base model evaluation (CORE)")
torchrun --standalone --nproc_per_node=$NPROC scripts/base_eval.py --run_name=d20

# 4. a sample
python scripts/sample.py --run_name=d20 --prompt="The capital of France is" --temperature=0

# 5. mid-training: the chat format, multiple choice and tool use on SmolTalk (460 K conversations), MMLU auxiliary
#    train (100 K) and GSM8K train (7.5 K, its <<expr=result>> annotations as calculator calls), one epoch
torchrun --standalone --nproc_per_node=$NPROC scripts/mid_train.py --run_name=d20 --base_run_name=d20 \
    --tasks=smoltalk:1,mmlu_aux:1,gsm8k:1

# 6. SFT on ARC-Easy + ARC-Challenge train, GSM8K train and a tenth of SmolTalk, with a small ChatCORE (24 problems
#    per benchmark) every 200 steps
torchrun --standalone --nproc_per_node=$NPROC scripts/chat_sft.py --run_name=d20 --source_run_name=d20 \
    --tasks=arc:1,gsm8k:1,smoltalk:0.1 --chatcore_every=200

# 7. the chat benchmarks on their full test sets (ARC-Easy, ARC-Challenge, MMLU, GSM8K, HumanEval) and ChatCORE
torchrun --standalone --nproc_per_node=$NPROC scripts/chat_eval.py --source=sft --run_name=d20 --tasks=chatcore

# 8. RL on GSM8K train (the calculator live), then the benchmarks again
torchrun --standalone --nproc_per_node=$NPROC scripts/chat_rl.py --run_name=d20 --source_run_name=d20 --tasks=gsm8k \
    --examples_per_step=16 --num_samples=16 \
    --max_new_tokens=256
torchrun --standalone --nproc_per_node=$NPROC scripts/chat_eval.py --source=rl --run_name=d20 --tasks=chatcore

# 9. the report card
python -m nanotrain.report d20
