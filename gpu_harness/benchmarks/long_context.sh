#!/usr/bin/env bash
# zebra_llama_1B at 2,048, 32,768 and 65,536 tokens per sequence on one GPU (the same 65,536 tokens per
# micro-batch), by the trainer itself (gpu_harness/benchmarks/trainer_speed.py, the recipe's kernels and log frequency), and
# the upcycled 1B distilled from a Llama-3.1-8B-shaped teacher at 65,536 with full activation checkpointing
# (HyLo's 64K stage).
#   bash gpu_harness/benchmarks/long_context.sh OUT
set -euo pipefail
out=${1:?give the folder the reports go to}
python gpu_harness/benchmarks/trainer_speed.py \
  "zebra_llama_1B:training.seq_len=2048,training.local_batch_size=32" \
  "zebra_llama_1B:training.seq_len=32768,training.local_batch_size=2" \
  "zebra_llama_1B:training.seq_len=65536,training.local_batch_size=1" \
  --steps 30 --warmup 10 --timeout 300 --json "$out/long.json" --markdown "$out/long.md"
[ -f /tmp/teachers/llama_8B/.metadata ] || python gpu_harness/random_checkpoint.py llama_8B /tmp/teachers/llama_8B
python gpu_harness/benchmarks/trainer_speed.py \
  "zebra_llama_1B_upcycled:training.seq_len=65536,training.local_batch_size=1,activation_checkpoint.mode=full,distill.teacher=/tmp/teachers/llama_8B" \
  --recipe train_configs/upcycle/zebra_llama_1B_kl.toml --steps 20 --warmup 10 --timeout 300 \
  --json "$out/long_distill.json" --markdown "$out/long_distill.md"
