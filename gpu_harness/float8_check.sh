#!/usr/bin/env bash
# Float8 training of the linears (docs/float8.md) against bf16 on one GPU, logs and tables in $OUT:
#   speed  the trainer itself (trainer_speed.py, mock data, the recipe's settings and log frequency) on each of
#          F8_FLAVORS (default gdn_1B): bf16, float8 tensorwise and float8 rowwise, one after the other
#   loss   F8_LOSS_FLAVOR (default gdn_300M) on the shipped corpus (packed documents), F8_LOSS_STEPS (default 300)
#          steps per precision from the same seed: the same initial weights and the same batches. Prints each
#          run's first loss and the mean of its last 50 losses, and that mean's difference from bf16's
# Usage: OUT=results bash gpu_harness/float8_check.sh [speed] [loss]   (default: both), from the repository's root
# Time boxes (seconds): F8_SPEED_S (default 420), F8_LOSS_S (default 150 per run).
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
  timeout "${F8_SPEED_S:-420}" python gpu_harness/trainer_speed.py "${cases[@]}" --timeout 300 \
    --markdown "$OUT/float8_speed.md" --json "$OUT/float8_speed.json" 2>&1 | grep --line-buffered -v Warning \
    | tee "$OUT/float8_speed.log" | tail -20
fi
if [[ $parts == *loss* ]]; then
  flavor=${F8_LOSS_FLAVOR:-gdn_300M}
  steps=${F8_LOSS_STEPS:-300}
  for precision in bf16 tensorwise rowwise; do
    extra=()
    [[ $precision != bf16 ]] && extra=(--model.converters quantize.linear.float8
                                       --quantize.linear.float8.recipe_name "$precision")
    rm -rf "/tmp/f8_$precision"
    timeout "${F8_LOSS_S:-150}" torchrun --standalone --nproc_per_node 1 -m hybridtitan.train \
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
  python - "$OUT" "$steps" <<'EOF'
import json, os, statistics, sys
out, steps = sys.argv[1], int(sys.argv[2])
runs = {}
for precision in ("bf16", "tensorwise", "rowwise"):
    path = os.path.join(out, f"float8_loss_{precision}.jsonl")
    if os.path.exists(path):
        runs[precision] = {r["step"]: r["loss"] for r in map(json.loads, open(path)) if "loss" in r}
print("precision | steps | loss at step 1 | mean of the last 50 losses | vs bf16")
base = None
for precision, losses in runs.items():
    last = [losses[s] for s in sorted(losses) if s > steps - 50]
    if max(losses, default=0) < steps or len(last) < 50:
        print(f"{precision} | {max(losses, default=0)} | - | incomplete | -")
        continue
    mean = statistics.fmean(last)
    base = mean if precision == "bf16" else base
    rel = "" if base is None or precision == "bf16" else f"{(mean - base) / base:+.3%}"
    print(f"{precision} | {max(losses)} | {losses.get(1, float('nan')):.4f} | {mean:.4f} | {rel}")
EOF
fi
