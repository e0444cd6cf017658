#!/usr/bin/env bash
# Float8 training of the linears (docs/float8.md) against bf16 on one GPU, logs and tables in $OUT:
#   speed  the trainer itself (trainer_speed.py, mock data, the recipe's settings and log frequency) on each of
#          F8_FLAVORS (default gdn_1B): bf16, float8 tensorwise and float8 rowwise, one after the other
#   loss   the recipe F8_LOSS_FLAVOR (default gdn_1B: train_configs/FLAVOR.toml, its learning rate and schedule
#          shape) for F8_LOSS_STEPS (default 500) steps of F8_LOSS_BATCH (default 8) x 2,048 tokens on a corpus
#          larger than the tokens seen (gpu_harness/source_corpus.py: this machine's installed Python sources, made
#          once in $F8_CORPUS), so that no run memorises it; each run of F8_LOSS_RUNS (default "bf16:1 bf16:2
#          bf16:3 tensorwise:1 rowwise:1", precision:seed) from its seed's initial weights and batches. Prints each
#          run's loss at steps 1, 100 and 250, the mean of its last 50 losses and, for float8, that mean against the
#          bf16 runs' range (their spread from three seeds)
# Usage: OUT=results bash gpu_harness/checks/float8_check.sh [speed] [loss]   (default: both), from the repository's root
# Time boxes (seconds): F8_SPEED_S (default 420), F8_LOSS_S (default 300 per run).
# It needs torchao; on the lent GPU machine it comes in the bundle: bash ../shared/gpu/prepare.sh torchao==0.18.0
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
parts=${*:-speed loss}
F8="model.converters=quantize.linear.float8,quantize.linear.float8.recipe_name"
python -c "import torch, torchao; print('torch', torch.__version__, 'torchao', torchao.__version__)" || {
  echo "float8_check.sh: needs torch and torchao (pip install torchao; see the usage above)" >&2; exit 1; }

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
  flavor=${F8_LOSS_FLAVOR:-gdn_1B}
  steps=${F8_LOSS_STEPS:-500}
  corpus=${F8_CORPUS:-/tmp/source_corpus}
  runs=${F8_LOSS_RUNS:-bf16:1 bf16:2 bf16:3 tensorwise:1 rowwise:1}
  [[ -f $corpus/train.jsonl ]] || python gpu_harness/source_corpus.py "$corpus" --tokenizer hybridtitan/assets/tokenizer
  for run in $runs; do
    precision=${run%%:*} seed=${run##*:}
    extra=()
    [[ $precision != bf16 ]] && extra=(--model.converters quantize.linear.float8
                                       --quantize.linear.float8.recipe_name "$precision")
    rm -rf "/tmp/f8_$run"
    # the recipe's optimizer, learning rate and precision; the schedule's shape over these steps
    timeout "${F8_LOSS_S:-300}" torchrun --standalone --nproc_per_node 1 -m hybridtitan.train \
      --job.config_file "train_configs/$flavor.toml" --data.source hf --data.path "$corpus" \
      --data.tokenizer hybridtitan/assets/tokenizer --data.document_boundaries false --training.seq_len 2048 \
      --training.local_batch_size "${F8_LOSS_BATCH:-8}" --training.global_batch_size "${F8_LOSS_BATCH:-8}" \
      --training.steps "$steps" --lr_scheduler.warmup_steps $((steps / 10)) --debug.seed "$seed" \
      --checkpoint.enable false --validation.enable false --eval.tasks "" --metrics.log_freq 1 \
      --metrics.enable_tensorboard false --job.dump_folder "/tmp/f8_$run" "${extra[@]}" 2>&1 \
      | grep --line-buffered -v Warning > "$OUT/float8_loss_$run.log"
    grep -E "float8|step +(1|$steps)/|rror" "$OUT/float8_loss_$run.log" | tail -6
    cp "/tmp/f8_$run/metrics.jsonl" "$OUT/float8_loss_$run.jsonl" 2>/dev/null
  done
  python gpu_harness/checks/float8_losses.py "$OUT" "$steps" $runs | tee "$OUT/float8_loss.md"
fi
