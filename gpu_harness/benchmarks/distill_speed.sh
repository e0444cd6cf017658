#!/usr/bin/env bash
# Distillation's speed and memory on one GPU, beside plain training of the same student, by the trainer itself
# (gpu_harness/benchmarks/trainer_speed.py, mock data, the recipe's log frequency), with random stand-in teachers of the
# Llama-3.2-1B and Llama-3.1-8B shapes (the hub is out of reach): the Zebra-Llama 1B stage-2 recipe
# (train_configs/upcycle/zebra_llama_1B_kl.toml: 12 x 2,048 tokens per GPU, KL alone); the first teacher also with
# FLA's fused KL (distill.kernel fla).
#   bash gpu_harness/benchmarks/distill_speed.sh OUT [TEACHER...]      (default teachers: llama_1B llama_8B)
set -euo pipefail
out=${1:?give the folder the reports go to}
shift
[ $# -gt 0 ] || set -- llama_1B llama_8B
cases=("zebra_llama_1B_upcycled:distill.teacher=")
for t in "$@"; do
  [ -f "/tmp/teachers/$t/.metadata" ] || python gpu_harness/random_checkpoint.py "$t" "/tmp/teachers/$t"
  cases+=("zebra_llama_1B_upcycled:distill.teacher=/tmp/teachers/$t")
done
# the first teacher again with FLA's fused KL in place of ours
cases+=("zebra_llama_1B_upcycled:distill.teacher=/tmp/teachers/$1,distill.kernel=fla")
python gpu_harness/benchmarks/trainer_speed.py "${cases[@]}" --recipe train_configs/upcycle/zebra_llama_1B_kl.toml \
  --steps 30 --warmup 10 --timeout 400 --json "$out/distill.json" --markdown "$out/distill.md"
