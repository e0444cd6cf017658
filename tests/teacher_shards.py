"""One rank of tests/test_teacher_shards.py: a model folder read into an FSDP2-sharded model (gloo, as
hybridtitan.distill's teacher), then gathered whole on rank 0 and saved, with each rank's peak host memory growth
while reading.

    python tests/teacher_shards.py MODEL_FOLDER OUT_DIR   (the environment of a torchrun rank)
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hybridtitan.model_folder import read_folder
from hybridtitan.model_loader import load_into_shards
from hybridtitan.models import build_model
from hybridtitan.parallel import build_mesh, parallelize, resolve_data_parallel


def status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024  # kB


def reset_peak() -> None:
    """VmHWM, the peak resident memory, back to the current (Linux's clear_refs 5): a forked rank would otherwise
    start with its parent's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(folder: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args = read_folder(folder).args
    model = build_model(args, "meta")
    parallelize(model, build_mesh(resolve_data_parallel(1, -1, world), "cpu"), ac_mode="none", ac_every=1,
                compile_model=False, param_dtype=torch.float32, reduce_dtype=torch.float32,
                reshard_after_forward="always")
    model.to_empty(device="cpu")
    reset_peak()
    before = status_mib("VmRSS")
    load_into_shards(model, folder)
    grown = status_mib("VmHWM") - before
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(whole, os.path.join(out, "gathered.pt"))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"peak_growth_mib": grown, "world": world}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
