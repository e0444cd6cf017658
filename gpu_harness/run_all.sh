#!/usr/bin/env bash
# The GPU harness on one GPU, each part time-boxed, logs in $OUT:
#   bench   throughput against FLA's models and the anchors (bench_throughput.py, with a profile of gdn_300M),
#   check   parity of every kernel and of FLA's HF classes with the PyTorch reference, and CUDA-graph replays
#           against eager calls (gpu_check.py),
#   record  the Triton kernel manifest of one training step per debug and 300M flavor (ROCm compile check),
#   train   zebra_gdn_300M on the shipped corpus with packed documents: 40 steps straight, and the same run
#           resumed from its step-20 checkpoint; the losses of steps 21-40 compared,
#   trainspeed  the trainer itself on the gdn_300M and kda_300M recipes (trainer_speed.py: mock data, and the
#           shipped corpus tokenized into a Megatron shard), 30 steps: its tokens/s, to set against the
#           benchmark's (bench).
# Usage: OUT=results bash gpu_harness/run_all.sh [bench|check|record|train|trainspeed ...]   (default: all but
# trainspeed), from the repository's root
# Time boxes (seconds) can be changed with BENCH_S, CHECK_S, RECORD_S, TRAIN_S, SPEED_S.
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
parts=${*:-bench check record train}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"

if [[ $parts == *bench* ]]; then
  budget=${BENCH_S:-300}
  timeout "$budget" python gpu_harness/benchmarks/bench_throughput.py --time-budget $((budget - 60)) \
    --markdown "$OUT/benchmarks.md" \
    --json "$OUT/bench.json" --profile gdn_300M --profile-dir /tmp/profiles ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log" | grep -v "^ \|^-\|Warning\|warn" | tail -40
  cat /tmp/profiles/*.txt >> "$OUT/bench.log" 2>/dev/null
fi
if [[ $parts == *check* ]]; then
  # two processes: a kernel fault leaves the CUDA context unusable, and the end-to-end cases (whole models, whose
  # kernels autotune at shapes of their own) are where one is likeliest; CUDA_LAUNCH_BLOCKING there names the
  # kernel that faults
  timeout "${CHECK_S:-240}" python gpu_harness/checks/gpu_check.py --only ops,graphs,fla --json "$OUT/gpu_check.json" 2>&1 \
    | tee "$OUT/gpu_check.log" | grep -v "Warning\|warn" | tail -45
  CUDA_LAUNCH_BLOCKING=1 timeout "${CHECK_S:-240}" python gpu_harness/checks/gpu_check.py --only e2e --verbose \
    --json "$OUT/gpu_check_e2e.json" 2>&1 | tee "$OUT/gpu_check_e2e.log" | grep -v "Warning\|warn" | tail -30
fi
if [[ $parts == *record* ]]; then
  # RECORD_ARGS, e.g. "--flavors debug_kda,kda_300M,zebra_mamba2_300M" to record only some flavors; they are
  # merged into a copy of the repository's manifest, which comes back whole in $OUT
  cp tests/assets/triton_kernels.json "$OUT/triton_kernels.json"
  timeout "${RECORD_S:-420}" python gpu_harness/rocm/record_triton_manifest.py --jobs 8 \
    --timeout $((${RECORD_S:-420} - 30)) \
    --out "$OUT/triton_kernels.json" ${RECORD_ARGS:-} 2>&1 | tee "$OUT/record.log" | tail -25
fi
if [[ " $parts " == *" train "* ]]; then
  run="torchrun --standalone --nproc_per_node 1 -m hybridtitan.train --job.config_file train_configs/debug_hybrid.toml
       --model.flavor zebra_gdn_300M --data.document_boundaries true --training.seq_len 2048
       --training.local_batch_size 8 --training.global_batch_size 8 --training.steps 40 --optimizer.lr 1e-3
       --optimizer.implementation fused --lr_scheduler.warmup_steps 10 --checkpoint.interval 20
       --checkpoint.keep_latest_k 0 --compile.enable true --compile.components norm,swiglu --metrics.log_freq 1
       --metrics.enable_tensorboard false"
  rm -rf /tmp/straight /tmp/resumed
  timeout "${TRAIN_S:-150}" $run --job.dump_folder /tmp/straight 2>&1 | grep -v Warning | tee "$OUT/train.log" \
    | grep -E "step (1|20|40)/|resum|rror" | tail -8
  mkdir -p /tmp/resumed/checkpoint && cp -r /tmp/straight/checkpoint/step-20 /tmp/resumed/checkpoint/
  timeout "${TRAIN_S:-150}" $run --job.dump_folder /tmp/resumed 2>&1 | grep -v Warning | tee -a "$OUT/train.log" \
    | grep -E "step (21|40)/|resum|rror" | tail -8
  cp /tmp/straight/metrics.jsonl "$OUT/train_straight.jsonl"; cp /tmp/resumed/metrics.jsonl "$OUT/train_resumed.jsonl"
  python - "$OUT/train_straight.jsonl" "$OUT/train_resumed.jsonl" <<'EOF'
import json, sys
a, b = ({r["step"]: r for r in map(json.loads, open(p))} for p in sys.argv[1:3])
steps = sorted(set(a) & set(b))
print("step | loss straight | loss resumed | |diff| | grad_norm straight | resumed")
for s in steps:
    print(f"{s} | {a[s]['loss']:.6f} | {b[s]['loss']:.6f} | {abs(a[s]['loss'] - b[s]['loss']):.2e} | "
          f"{a[s]['grad_norm']:.4f} | {b[s]['grad_norm']:.4f}")
d = [abs(a[s]["loss"] - b[s]["loss"]) / abs(a[s]["loss"]) for s in steps]
print(f"resumed steps {steps[0] if steps else '-'}-{steps[-1] if steps else '-'}: max relative loss difference "
      f"{max(d) if d else float('nan'):.2e}; first step resumed: {min(b) if b else '-'}")
EOF
fi
if [[ $parts == *trainspeed* ]]; then
  # SPEED_FLAVORS, SPEED_SOURCES (mock: no data work; megatron: the shipped corpus as a Megatron shard),
  # SPEED_OVERRIDES (trainer keys added to every case, e.g. "data.document_boundaries=true"), SPEED_ARGS (options
  # of trainer_speed.py, e.g. "--tree ../before --repeat 2")
  rm -rf /tmp/speed_data && python scripts/prepare_data.py --dataset hybridtitan/assets/corpus/train.jsonl \
    --tokenizer hybridtitan/assets/tokenizer --output /tmp/speed_data/shard --workers 1 2>&1 | tail -1
  cases=()
  for flavor in ${SPEED_FLAVORS:-gdn_300M kda_300M}; do
    for source in ${SPEED_SOURCES:-megatron mock}; do
      settings=""
      [[ $source == megatron ]] && settings="data.source=megatron,data.tokenizer=hybridtitan/assets/tokenizer"
      [[ $source == megatron ]] && settings="$settings,data.path=/tmp/speed_data/shard_00000"
      [[ -n ${SPEED_OVERRIDES:-} ]] && settings="${settings:+$settings,}$SPEED_OVERRIDES"
      cases+=("$flavor${settings:+:$settings}")
    done
  done
  timeout "${SPEED_S:-900}" python gpu_harness/benchmarks/trainer_speed.py "${cases[@]}" --timeout 240 \
    --markdown "$OUT/trainspeed.md" --json "$OUT/trainspeed.json" ${SPEED_ARGS:-} 2>&1 | grep -v Warning \
    | tee "$OUT/trainspeed.log" | tail -20
fi
