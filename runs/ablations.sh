#!/usr/bin/env bash
# The README's ablation table: base_train at the CPU recipe's config with the defaults, then with one technique
# changed at a time, same seed and data, one run after the other. Prints one line per run: the final val bpb and the
# median tokens/s. Needs the corpus and tokenizer of runs/cpu.sh (steps 1-2).
#   bash runs/ablations.sh                 # depth 4, 100 steps (~2 min a run on 2 cores)
#   DEPTH=8 STEPS=100 bash runs/ablations.sh
#   STEPS=400 ROWS="defaults value_embeds" bash runs/ablations.sh   # only the rows named
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOTRAIN_BASE_DIR="${NANOTRAIN_BASE_DIR:-$HOME/.cache/nanotrain}"
DEPTH="${DEPTH:-4}"
STEPS="${STEPS:-100}"
BASE="--depth=$DEPTH --max_seq_len=256 --device_batch_size=8 --total_batch_size=4096 --num_iterations=$STEPS \
--eval_every=100 --eval_tokens=32768 --sample_every=-1 --save_every=-1"
declare -A ROW=(  # row name -> the flags that change its technique from the default (off when on, on when off)
    [defaults]=""
    [value_embeds]="--value_embeds=False"
    [polar_express]="--polar_express=False"
    [muon_weight_decay]="--muon_weight_decay=0"
    [muon_weight_decay_1.6]="--muon_weight_decay=1.6"
    [matrix_lr]="--matrix_lr=0.02"
    [schedule]="--warmdown_ratio=0.2 --final_lr_frac=0.0"
    [normuon]="--muon_beta2=0.9"
    [smear]="--smear=False"
    [backout]="--backout=True"
    [x0_lambdas]="--x0_lambdas=True"
    [attention_constants]="--rotary_base=100000 --qk_scale=1.44"
    [fp32]="--dtype=float32"
    [best_fit]="--row_packing=best_fit"
    [bos_aligned]="--row_packing=bos_aligned"
    [momentum_warmup]="--momentum_warmup=0"
    [nanochat_momentum]="--momentum=0.97 --momentum_warmup=400 --final_momentum=0.90"
    [adamw_beta2]="--embedding_beta2=0.95 --unembedding_beta2=0.95"
    [adamw_weight_decay]="--weight_decay=0"
    [lr_warmup]="--warmup_ratio=0.1"
    [lr_batch_scaling]="--matrix_lr=0.002652 --embedding_lr=0.01768 --unembedding_lr=0.0003536 --scalar_lr=0.04419"
    [grad_clip]="--grad_clip=0"
)
ORDER="defaults value_embeds polar_express muon_weight_decay muon_weight_decay_1.6 matrix_lr schedule normuon smear backout x0_lambdas \
attention_constants fp32 best_fit bos_aligned \
momentum_warmup nanochat_momentum adamw_beta2 adamw_weight_decay lr_warmup lr_batch_scaling grad_clip"
for name in ${ROWS:-$ORDER}; do
    log="$NANOTRAIN_BASE_DIR/ablations/d${DEPTH}_s${STEPS}_$name.log"
    mkdir -p "$(dirname "$log")"
    # shellcheck disable=SC2086
    python scripts/base_train.py --run_name="ablation_d${DEPTH}_$name" $BASE ${ROW[$name]} > "$log" 2>&1
    rm -rf "$NANOTRAIN_BASE_DIR/base/ablation_d${DEPTH}_$name"
    bpb=$(grep -oE "final val bpb [0-9.]+" "$log" | awk '{print $4}')
    toks=$(grep -oE "tok/s [0-9,]+" "$log" | tr -d , | awk '{print $2}' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
    printf "%-20s %-45s val bpb %s  tok/s %s\n" "$name" "${ROW[$name]:-(the defaults)}" "$bpb" "$toks"
done
