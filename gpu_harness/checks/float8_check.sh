#!/usr/bin/env bash
# Float8 training of the linears (docs/float8.md) against bf16 on one GPU, logs and tables in $OUT:
#   speed  the trainer itself (trainer_speed.py, mock data, the recipe's settings and log frequency) on each of
#          F8_FLAVORS (default gdn_1B): bf16, float8 tensorwise and float8 rowwise, one after the other
#   loss   F8_LOSS_FLAVOR (default gdn_300M) on the shipped corpus (packed documents), F8_LOSS_STEPS (default 300)
#          steps per run of F8_LOSS_RUNS (default "bf16 bf16-again tensorwise"; also "rowwise", which converts
#          nothing at 300M) from the same seed: the same initial weights and the same batches. Prints each run's
#          first loss, its loss at steps 50 and 100, the mean of its last 50 losses and that mean's difference
#          from the first bf16 run's; bf16-again, the same bf16 run once more, is the spread between two runs
#          (they are not bitwise reproducible)
# Usage: OUT=results bash gpu_harness/checks/float8_check.sh [speed] [loss]   (default: both), from the repository's root
# Time boxes (seconds): F8_SPEED_S (default 420), F8_LOSS_S (default 240 per run: the first run on a cold Triton
# cache autotunes the packed shapes, 1:44 for its first step on the H200 on 2026-12-03).
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
parts=${*:-speed loss}
F8="model.converters=quantize.linear.float8,quantize.linear.float8.recipe_name"
python -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)"

if [[ $parts == *speed* ]]; then
  cases=()
  for flavor in ${F8_FLAVORS:-gdn_1B}; do
    cases+=("$flavor" "$flavor:$F8=tensorwise" "$flavor:$F8=rowwise")
  done
  timeout "${F8_SPEED_S:-420}" python gpu_harness/benchmarks/trainer_speed.py "${cases[@]}" --timeout 300 \
    --markdown "$OUT/float8_speed.md" --json "$OUT/float8_speed.json" 2>&1 | grep --line-buffered -v Warning \
    | tee "$OUT/float8_speed.log" | tail -20
fi
if [[ $parts == *loss* ]]; then
  flavor=${F8_LOSS_FLAVOR:-gdn_300M}
  steps=${F8_LOSS_STEPS:-300}
  for precision in ${F8_LOSS_RUNS:-bf16 bf16-again tensorwise}; do
    extra=()
    [[ $precision != bf16* ]] && extra=(--model.converters quantize.linear.float8
                                        --quantize.linear.float8.recipe_name "$precision")
    rm -rf "/tmp/f8_$precision"
    timeout "${F8_LOSS_S:-240}" torchrun --standalone --nproc_per_node 1 -m hybridtitan.train \
      --job.config_file train_configs/debug_hybrid.toml --model.flavor "$flavor" --data.document_boundaries true \
      --training.seq_len 2048 --training.local_batch_size 8 --training.global_batch_size 8 \
      --training.steps "$steps" --optimizer.lr 1e-3 --optimizer.implementation fused \
      --lr_scheduler.warmup_steps 30 --checkpoint.enable false --validation.enable false --compile.enable true \
      --compile.components norm,swiglu --metrics.log_freq 1 --metrics.enable_tensorboard false \
      --job.dump_folder "/tmp/f8_$precision" "${extra[@]}" 2>&1 | grep --line-buffered -v Warning \
      > "$OUT/float8_loss_$precision.log"
    grep -E "float8|step +(1|$steps)/|rror" "$OUT/float8_loss_$precision.log" | tail -6
    cp "/tmp/f8_$precision/metrics.jsonl" "$OUT/float8_loss_$precision.jsonl" 2>/dev/null
  done
  python - "$OUT" "$steps" ${F8_LOSS_RUNS:-bf16 bf16-again tensorwise} <<'EOF'
import json, os, statistics, sys
out, steps, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
print("run | steps | loss at 1 | at 50 | at 100 | mean of the last 50 | vs bf16")
base = None
for name in names:
    path = os.path.join(out, f"float8_loss_{name}.jsonl")
    losses = {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r} if os.path.exists(path) else {}
    if max(losses, default=0) < steps:
        print(f"{name} | {max(losses, default=0)} | incomplete")
        continue
    mean = statistics.fmean(losses[s] for s in range(steps - 49, steps + 1))
    base = mean if name == "bf16" else base
    rel = "" if base is None or name == "bf16" else f"{(mean - base) / base:+.2%}"
    at = {s: f"{losses[s]:.4f}" if s in losses else "-" for s in (1, 50, 100)}  # (F8_LOSS_STEPS may be under 100)
    print(f"{name} | {steps} | {at[1]} | {at[50]} | {at[100]} | {mean:.4f} | {rel}")
EOF
fi
