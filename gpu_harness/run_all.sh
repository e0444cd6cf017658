#!/usr/bin/env bash
# Everything the GPU issues ask for, on one GPU, each part time-boxed, logs in $OUT:
#   bench   throughput against FLA's models and the anchors (bench_throughput.py, with a profile of gdn_300M),
#   check   parity of every kernel and of FLA's HF classes with the PyTorch reference, and CUDA-graph replays
#           against eager calls (gpu_check.py); the gated delta rule's gate gradients over seeds
#           (probe_gate_grads.py),
#   record  the Triton kernel manifest of one training step per debug and 300M flavor (ROCm compile check),
#   train   zebra_gdn_300M on the shipped corpus with packed documents: 40 steps straight, and the same run
#           resumed from its step-20 checkpoint; the losses of steps 21-40 compared,
#   trainspeed  the trainer itself on the gdn_300M and kda_300M recipes (micro-batch 32, the shipped corpus
#           tokenized into a Megatron shard, and the mock source), 30 steps: its tokens/s, to set against the
#           benchmark's (bench).
# Usage: OUT=results bash scripts/gpu_all.sh [bench|check|record|train|trainspeed ...]   (default: all but
# trainspeed)
# Time boxes (seconds) can be changed with BENCH_S, CHECK_S, RECORD_S, TRAIN_S.
set -uo pipefail
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
parts=${*:-bench check record train}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton, fla; print('torch', torch.__version__, 'triton', triton.__version__, 'fla', fla.__version__)"

if [[ $parts == *bench* ]]; then
  budget=${BENCH_S:-300}
  timeout "$budget" python scripts/bench_throughput.py --time-budget $((budget - 60)) --markdown "$OUT/benchmarks.md" \
    --json "$OUT/bench.json" --profile gdn_300M --profile-dir /tmp/profiles ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log" | grep -v "^ \|^-\|Warning\|warn" | tail -40
  cat /tmp/profiles/*.txt >> "$OUT/bench.log" 2>/dev/null
fi
if [[ $parts == *check* ]]; then
  # two processes: a kernel fault leaves the CUDA context unusable, and the end-to-end cases (whole models) are
  # where one was seen (debug_mamba2 packed); CUDA_LAUNCH_BLOCKING there names the kernel that faults
  timeout "${CHECK_S:-240}" python scripts/gpu_check.py --only ops,graphs,fla --json "$OUT/gpu_check.json" 2>&1 \
    | tee "$OUT/gpu_check.log" | grep -v "Warning\|warn" | tail -45
  CUDA_LAUNCH_BLOCKING=1 timeout "${CHECK_S:-240}" python scripts/gpu_check.py --only e2e --verbose \
    --json "$OUT/gpu_check_e2e.json" 2>&1 | tee "$OUT/gpu_check_e2e.log" | grep -v "Warning\|warn" | tail -30
  # the gated delta rule's A_log / dt_bias gradients over seeds (the one op case near the bar)
  timeout 120 python scripts/probe_gate_grads.py 2>&1 | tee "$OUT/probe_gate_grads.log" | grep -v "Warning\|warn"
fi
if [[ $parts == *record* ]]; then
  # RECORD_ARGS, e.g. "--flavors debug_kda,kda_300M,zebra_mamba2_300M" to record only some flavors; they are
  # merged into a copy of the repository's manifest, which comes back whole in $OUT
  cp tests/assets/triton_kernels.json "$OUT/triton_kernels.json"
  timeout "${RECORD_S:-420}" python scripts/record_triton_manifest.py --jobs 8 --timeout $((${RECORD_S:-420} - 30)) \
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
  rm -rf /tmp/speed_data && python scripts/prepare_data.py --dataset hybridtitan/assets/corpus/train.jsonl \
    --tokenizer hybridtitan/assets/tokenizer --output /tmp/speed_data/shard --workers 1 2>&1 | tail -1
  for flavor in ${SPEED_FLAVORS:-gdn_300M kda_300M}; do
    for source in ${SPEED_SOURCES:-megatron mock}; do
      data="--data.source megatron --data.tokenizer hybridtitan/assets/tokenizer"
      data="$data --data.path /tmp/speed_data/shard_00000"
      [[ $source == mock ]] && data="--data.source mock"
      rm -rf /tmp/speed
      echo "== trainer $flavor, $source data"
      timeout "${SPEED_S:-150}" torchrun --standalone --nproc_per_node 1 -m hybridtitan.train \
        --job.config_file "train_configs/$flavor.toml" $data --training.global_batch_size 32 \
        --training.steps 30 --checkpoint.enable false --metrics.enable_tensorboard false \
        --job.dump_folder /tmp/speed ${SPEED_ARGS:-} 2>&1 | grep -v Warning \
        | tee "$OUT/trainspeed_${flavor}_$source.log" | grep -E "step (10|20|30)/|rror" | tail -4
    done
  done
fi
