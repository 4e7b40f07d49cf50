#!/usr/bin/env bash
# The README's ablation table: base_train at the CPU recipe's config with the defaults, then with one technique
# changed at a time, same seed and data, one run after the other. Prints one line per run: the last val bpb and the
# median tokens/s of its steps. Needs the corpus and tokenizer of runs/cpu.sh (steps 1-2). The bpb does not depend
# on the thread count or on load, so the long columns can run as two one-thread streams side by side; compare
# tokens/s with scripts/bench.py --vs (interleaved in one process) rather than across these runs.
#   bash runs/ablations.sh                 # depth 4, 100 steps (~1.5 min a run on 2 cores)
#   DEPTH=8 STEPS=100 bash runs/ablations.sh
#   STEPS=400 ROWS="defaults value_embeds" OMP_NUM_THREADS=1 bash runs/ablations.sh   # only the rows named
#   BENCH=1 bash runs/ablations.sh         # tokens/s of each row against the defaults (bench.py --vs, interleaved)
set -euo pipefail
cd "$(dirname "$0")/.."
export NANOTRAIN_BASE_DIR="${NANOTRAIN_BASE_DIR:-$HOME/.cache/nanotrain}"
DEPTH="${DEPTH:-4}"
STEPS="${STEPS:-100}"
BASE="--depth=$DEPTH --max_seq_len=256 --device_batch_size=8 --total_batch_size=4096 --num_iterations=$STEPS \
--eval_every=100 --eval_tokens=32768 --sample_every=-1 --save_every=-1 \
--hparam_transfer=False --matrix_lr=0.03 --embedding_lr=0.2 --unembedding_lr=0.004 --muon_weight_decay=0.4 \
--lr_warmup_steps=0 --grad_clip=1.0"  # the CPU recipe's values (runs/cpu.sh), which the rows change one at a time
declare -A ROW=(  # row name -> the flags that change its technique from the default (off when on, on when off)
    [defaults]=""
    [value_embeds]="--value_embeds=False"
    [polar_express]="--polar_express=False"
    [muon_weight_decay]="--muon_weight_decay=0"
    [matrix_lr]="--matrix_lr=0.02"
    [schedule]="--warmdown_ratio=0.2 --final_lr_frac=0.0"
    [normuon]="--muon_beta2=0.9"
    [smear]="--smear=True"
    [backout]="--backout=True"
    [x0_lambdas]="--x0_lambdas=True"
    [attention_constants]="--rotary_base=100000 --qk_scale=1.44"
    [fp32]="--dtype=float32"
    [best_fit]="--row_packing=best_fit"
    [bos_aligned]="--row_packing=bos_aligned"
    [momentum_warmup]="--momentum_warmup=0"
    [nanochat_momentum]="--momentum=0.97 --momentum_warmup=400 --final_momentum=0.90"
    [adamw]="--weight_decay=0 --embedding_beta2=0.95 --unembedding_beta2=0.95"
    [lr_warmup]="--lr_warmup_steps=40"
    [lr_batch_scaling]="--matrix_lr=0.002652 --embedding_lr=0.01768 --unembedding_lr=0.0003536 --scalar_lr=0.04419"
    [grad_clip]="--grad_clip=0"
)
ORDER="defaults value_embeds smear backout x0_lambdas attention_constants polar_express normuon muon_weight_decay adamw \
matrix_lr schedule momentum_warmup nanochat_momentum lr_warmup lr_batch_scaling best_fit bos_aligned grad_clip fp32"
if [ "${BENCH:-0}" = 1 ]; then  # tokens/s instead: each row against the defaults, interleaved in one process
    for name in ${ROWS:-$ORDER}; do
        out="$NANOTRAIN_BASE_DIR/ablations/bench_d${DEPTH}_$name.json"
        mkdir -p "$(dirname "$out")"
        # the defaults row times the defaults against themselves: the spread of a ratio that should be 1
        # shellcheck disable=SC2086
        if python scripts/bench.py --depth="$DEPTH" --max_seq_len=256 --device_batch_size=8 --total_batch_size=4096 \
            --pairs=6 --pair_steps=3 --memory_estimate=False --vs="${ROW[$name]:---seed=42}" > "$out" 2> "$out.err"; then
            python - "$out" "$name" <<'PY'
import json, sys
o = json.load(open(sys.argv[1]))
r = o["vs"]["ratios"]
print(f"{sys.argv[2]:<20} tok/s {o['a']['tokens_per_sec']:,.0f} -> {o['b']['tokens_per_sec']:,.0f}  "
      f"ratio {o['vs']['median_ratio']:.3f} ({min(r):.3f}-{max(r):.3f} over {len(r)} pairs)")
PY
        else  # settings bench.py does not take (lr, schedule, momentum, clipping) change values, not the step's work
            printf "%-20s %s\n" "$name" "$(tail -1 "$out.err")"
        fi
    done
    exit 0
fi
for name in ${ROWS:-$ORDER}; do
    run="ablation_d${DEPTH}_s${STEPS}_$name"
    log="$NANOTRAIN_BASE_DIR/ablations/$run.log"
    mkdir -p "$(dirname "$log")"
    # shellcheck disable=SC2086
    python scripts/base_train.py --run_name="$run" $BASE ${ROW[$name]} > "$log" 2>&1
    rm -rf "$NANOTRAIN_BASE_DIR/base/$run"
    bpb=$(grep -oE "\| val bpb [0-9.]+" "$log" | tail -1 | awk '{print $4}')  # the last evaluation, 4 decimals
    toks=$(grep -oE "tok/s [0-9,]+" "$log" | tr -d , | awk '{print $2}' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
    printf "%-20s %-45s val bpb %s  tok/s %s\n" "$name" "${ROW[$name]:-(the defaults)}" "$bpb" "$toks"
done
