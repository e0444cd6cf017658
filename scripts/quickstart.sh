#!/usr/bin/env bash
# The main job on a CPU machine, from a fresh clone:
#   1. sets up .venv (torch 2.13.0 CPU build + hybridtitan),
#   2. trains the debug hybrid (*-M-M-*-: MLA + Gated DeltaNet + SwiGLU) with 2 processes (FSDP2 over gloo)
#      on the corpus and tokenizer the repo ships,
#   3. exports the final DCP checkpoint to Hugging Face safetensors and generates a few tokens from it,
#   4. evaluates the checkpoint with lm-eval on a small local multiple-choice task.
# Everything lands in outputs/quickstart (replaced on every run). Extra arguments go to the trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_cpu.sh
OUT=outputs/quickstart
rm -rf "$OUT"

# 100 of the recipe's 200 steps keep the whole job under 5 minutes on 2 cores (the full recipe takes about 4
# minutes of training alone: pass --training.steps 200).
echo "== training debug_hybrid on 2 CPU processes =="
torchrun --standalone --nproc_per_node 2 -m hybridtitan.train \
  --job.config_file train_configs/debug_hybrid.toml --job.dump_folder "$OUT" --training.steps 100 "$@"

echo "== exporting the last checkpoint to Hugging Face format =="
python -m hybridtitan.export_hf --checkpoint "$OUT" --output "$OUT/hf"
python - "$OUT/hf" <<'EOF'
import sys

import hybridtitan  # registers the hybridtitan model type with transformers' Auto classes
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = sys.argv[1]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
ids = tok("Return the number of", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=16, do_sample=False)
print("generate():", repr(tok.decode(out[0])))
EOF

echo "== evaluating the checkpoint with lm-eval =="
python -m hybridtitan.eval --checkpoint "$OUT/checkpoint" --tasks stdlib_mc \
  --include_path tests/assets/tasks --output_path "$OUT/eval.json"
echo "done: checkpoints in $OUT/checkpoint, Hugging Face export in $OUT/hf, metrics in $OUT/metrics.jsonl"
