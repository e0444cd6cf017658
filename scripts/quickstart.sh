#!/usr/bin/env bash
# The main job on a CPU machine, from a fresh clone:
#   1. sets up .venv (torch 2.13.0 CPU build + hybridtitan),
#   2. trains the debug hybrid (*-M-M-*-: MLA + Gated DeltaNet + SwiGLU) with 2 processes (FSDP2 over gloo) on
#      the corpus and tokenizer the repo ships, with the held-out loss every 50 steps,
#   3. exports the final DCP checkpoint to Hugging Face safetensors and generates from the export,
#   4. evaluates the checkpoint with lm-eval on a small local multiple-choice task,
#   5. draws the run's curves.
# Everything lands in outputs/quickstart (replaced on every run). Extra arguments go to the trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_cpu.sh
OUT=outputs/quickstart
rm -rf "$OUT"

# 100 of the recipe's 200 steps keep the whole job to a few minutes on 2 cores (--training.steps 200 for all)
echo "== training debug_hybrid on 2 CPU processes =="
torchrun --standalone --nproc_per_node 2 -m hybridtitan.train \
  --job.config_file train_configs/debug_hybrid.toml --job.dump_folder "$OUT" --training.steps 100 "$@"

echo "== exporting the last checkpoint to Hugging Face format, and generating from the export =="
python -m hybridtitan.export_hf --checkpoint "$OUT" --output "$OUT/hf"
python -m hybridtitan.generate --checkpoint "$OUT/hf" --prompt "Return the number of" --max_new_tokens 16 \
  --temperature 0

echo "== evaluating the checkpoint with lm-eval =="
python -m hybridtitan.eval --checkpoint "$OUT/checkpoint" --tasks stdlib_mc \
  --include_path tests/assets/tasks --output_path "$OUT/eval.json"

python -m hybridtitan.plot "$OUT" --output "$OUT/curves.png"
echo "done: checkpoints in $OUT/checkpoint, Hugging Face export in $OUT/hf, metrics in $OUT/metrics.jsonl," \
  "curves in $OUT/curves.png"
