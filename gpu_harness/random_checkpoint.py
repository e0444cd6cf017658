"""A model-only checkpoint of a flavor with its reference initialisation: a stand-in teacher for distillation
measurements where a real one cannot be downloaded (the hub is out of reach of the GPU machine).

    python gpu_harness/random_checkpoint.py llama_1B /tmp/teachers/llama_1B [--dtype bfloat16] [--device cuda]

The folder is a step folder (model_args.json beside the DCP files) that ``--distill.teacher`` takes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("flavor")
    p.add_argument("output")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--device", default=None, help="where the weights are drawn (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    import torch

    from hybridtitan.checkpoint import save_model_checkpoint
    from hybridtitan.models import build_model, get_flavor

    torch.manual_seed(a.seed)
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model = build_model(get_flavor(a.flavor), "meta")
    model.to_empty(device=device)
    model.init_weights()
    save_model_checkpoint(model, a.output, getattr(torch, a.dtype))
    print(f"{a.flavor}: {sum(p.numel() for p in model.parameters()):,} parameters, {a.dtype}, written to {a.output} "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
