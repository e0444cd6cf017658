#!/usr/bin/env bash
# Everything the GPU issue asks for, in one call on one GPU (each part time-boxed, logs in $OUT):
#   1. throughput against FLA's models and the anchors (bench_throughput.py, with a profile of gdn_300M),
#   2. parity of every kernel and of FLA's HF classes with the PyTorch reference (gpu_check.py),
#   3. a real training run: zebra_gdn_300M on the shipped corpus with packed documents, 150 steps, stop,
#      then resumed to 300 steps.
# Usage: OUT=results bash scripts/gpu_all.sh [bench|check|train ...]   (default: all three)
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
parts=${*:-bench check train}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"

if [[ $parts == *bench* ]]; then
  timeout 240 python scripts/bench_throughput.py --time-budget 200 --markdown "$OUT/benchmarks.md" \
    --json "$OUT/bench.json" --profile gdn_300M --profile-dir /tmp/profiles 2>&1 | tee "$OUT/bench.log" | tail -45
  cat /tmp/profiles/*.txt >> "$OUT/bench.log" 2>/dev/null
fi
if [[ $parts == *check* ]]; then
  timeout 170 python scripts/gpu_check.py --json /tmp/gpu_check.json 2>&1 | tee "$OUT/gpu_check.log" | tail -45
fi
if [[ $parts == *train* ]]; then
  run="torchrun --standalone --nproc_per_node 1 -m hybridtitan.train --job.config_file train_configs/debug_hybrid.toml
       --model.flavor zebra_gdn_300M --job.dump_folder /tmp/zebra_run --training.seq_len 2048
       --training.local_batch_size 8 --training.global_batch_size 8 --optimizer.lr 1e-3 --optimizer.implementation fused
       --lr_scheduler.warmup_steps 30 --lr_scheduler.total_steps 300 --checkpoint.interval 150
       --metrics.log_freq 10 --metrics.enable_tensorboard false"
  rm -rf /tmp/zebra_run
  timeout 150 $run --training.steps 150 2>&1 | grep -v Warning | tee "$OUT/train.log" | grep -E "step|resumed|error" | tail -20
  timeout 150 $run --training.steps 300 2>&1 | grep -v Warning | tee -a "$OUT/train.log" | grep -E "step|resumed|error" | tail -20
  cp /tmp/zebra_run/metrics.jsonl "$OUT/train_metrics.jsonl" 2>/dev/null
fi
