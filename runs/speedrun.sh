#!/usr/bin/env bash
# The 8-GPU recipe: a 65,536-token tokenizer and a depth-20 base model (561 M parameters, 11.2 B tokens at 20 tokens
# per parameter) on fineweb-edu, as nanochat's speedrun. Needs the hub (the shards are downloaded on first use).
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
