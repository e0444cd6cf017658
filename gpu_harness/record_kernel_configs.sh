#!/usr/bin/env bash
# Records the kernel configurations the package ships for this GPU (hybridtitan/kernel_configs/<GPU>/, or $FOLDER):
# python -m hybridtitan.tune over every GPU recipe of train_configs/ and train_configs/upcycle/ (decoding's
# shapes too), then the GPU harness's checks (export_check, cp_check, gpu_check) with --kernel-configs autotune
# --record-kernel-configs. A shape the folder holds already keeps its configuration, so a second run of this
# script only tunes what the first did not reach. Each step is time-boxed (STEP_S, default 420 s) and the whole
# run ends by TOTAL_S (default 540 s) from its start; a tune step cut short records the shapes it tuned before the
# cut, a harness step cut short records nothing. Logs and a summary in $OUT (default kernel_configs_logs).
# Usage, from the repository's root on the GPU machine:
#   OUT=$OUT bash gpu_harness/record_kernel_configs.sh [recipes|upcycle|harness ...]   (default: all three)
# RECIPES="gdn_300M kda_1B" records those recipes of train_configs/ alone, in that order (default: every GPU recipe);
# UPCYCLE_ILD and UPCYCLE_KL likewise name the layer-distillation and KL recipes of train_configs/upcycle/.
set -uo pipefail
OUT=${OUT:-kernel_configs_logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
parts=${*:-recipes upcycle harness}
folder_args=()
harness_folder=${FOLDER:-}
if [[ -n ${FOLDER:-} ]]; then folder_args=(--output "$FOLDER"); fi
if [[ -z $harness_folder ]]; then
  harness_folder=$(python -c "import torch; from hybridtitan.ops import kernel_configs as k; \
print(k.SHIPPED / k.this_gpu(torch.device('cuda'))['dir'])")
fi
start=$SECONDS
left() { echo $(( ${TOTAL_S:-540} - (SECONDS - start) )); }
step() {  # step NAME COMMAND...: run it within min(STEP_S, what is left), log it, and note its exit code and time
  local name=$1 budget
  shift
  budget=$(left)
  (( budget > ${STEP_S:-420} )) && budget=${STEP_S:-420}
  if (( budget < 30 )); then
    echo "skipped  $name (out of time)" | tee -a "$OUT/summary.txt"
    return
  fi
  local t0=$SECONDS
  mkdir -p "$(dirname "$OUT/$name.log")"  # upcycle/NAME
  # --foreground: SIGTERM to the tuner alone, which then records what it tuned; sent to its process group as well,
  # it killed the ptxas compiling a kernel (exit -15), which Triton's autotuner passes over as a failed config
  timeout --foreground -k 30 "$budget" "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  echo "exit $code  $name  $((SECONDS - t0)) s  $(grep -E '^hybridtitan.tune:|^recorded|^error' "$OUT/$name.log" \
    | tail -1)" | tee -a "$OUT/summary.txt"
}
tune() { step "$1" python -m hybridtitan.tune --job.config_file "train_configs/$1.toml" "${folder_args[@]}" "${@:2}"; }

if [[ $parts == *recipes* ]]; then
  # the 300M shapes first (the seed Triton cache holds their kernels), then the larger ones; a model of one
  # sublayer of each kind has every shape of the whole model in a fraction of the memory (8B fits one GPU)
  for recipe in ${RECIPES:-gdn_300M kda_300M zebra_gdn_300M zebra_mamba2_300M mamba_370M gdn_1B gdn_1B_10B gdn_1B_8k \
                kda_1B zebra_kda_1B zebra_llama_1B zebra_llama_3B zebra_llama_8B}; do
    tune "$recipe" --decode --one-of-each
  done
fi
if [[ $parts == *upcycle* ]]; then
  # stand-in teachers of the recipes' shapes (the hub is out of reach here); the students whole (layer
  # distillation pairs each student layer with the teacher's)
  for teacher in llama_1B llama_8B; do
    [[ -d /tmp/teachers/$teacher ]] || step "teacher_$teacher" python gpu_harness/random_checkpoint.py "$teacher" \
      "/tmp/teachers/$teacher"
  done
  for recipe in ${UPCYCLE_ILD:-zebra_llama_1B_ild_mla zebra_llama_1B_ild_mamba2 hylo_1B_ild_gdn}; do
    tune "upcycle/$recipe" --distill.teacher /tmp/teachers/llama_1B
  done
  # the KL stages' students one sublayer of each kind (the same shapes; beside the 8B teacher the whole student's
  # autotuning ran out of memory on one H100 at 4 x 8,192 tokens, 2026-12-07)
  for recipe in ${UPCYCLE_KL:-zebra_llama_1B_kl hylo_1B_kl_8k hylo_1B_kl_64k}; do
    tune "upcycle/$recipe" --distill.teacher /tmp/teachers/llama_8B --decode --one-of-each
  done
fi
if [[ $parts == *harness* ]]; then
  record=(--kernel-configs autotune --record-kernel-configs "$harness_folder")
  step export_check python gpu_harness/checks/export_check.py "${record[@]}"
  step cp_check python gpu_harness/checks/cp_check.py --timeout 360 "${record[@]}"
  step gpu_check python gpu_harness/checks/gpu_check.py "${record[@]}"
fi
echo "done in $((SECONDS - start)) s; the folder: ${FOLDER:-$harness_folder}" | tee -a "$OUT/summary.txt"
