"""How much host (CPU) time a training step's gradient clipping and optimizer update cost: torch's functions on
FSDP's DTensors against the trainer's (``hybridtitan.optim``: the same arithmetic on each rank's shards).

Where micro-batches are small the host sets the step's pace (docs/benchmarks.md), and every operation on a
DTensor passes DTensor's dispatch. This wraps a flavor as the trainer does on one device (FSDP2 per sublayer,
bf16 compute, fp32 parameters and reductions), gives it gradients, and times each way: the host's time per call
(no synchronisation inside the timed calls) and the wall time with the device's work. It also checks that both
ways give the same norm and the same parameters.

    python scripts/probe_step_host.py [--flavor gdn_300M] [--calls 50]
    python scripts/probe_step_host.py --device cpu --tiny     # the CPU dry run: small widths, same parameters
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import torch
from _gpu_common import init_process_group_of_one, sync


def build(flavor: str, tiny: bool, device: torch.device):
    from hybridtitan.models import build_model, get_flavor
    from hybridtitan.parallel import apply_fsdp

    args = get_flavor(flavor)
    if tiny:  # the same parameters (names, count, kinds), narrow
        args = dataclasses.replace(args, vocab_size=256, dim=64, ffn_dim=128)
    mesh = init_process_group_of_one(device)
    model = build_model(args, device)
    model.init_weights()
    apply_fsdp(model, mesh, torch.bfloat16, torch.float32)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def time_calls(fn, calls: int, device: torch.device) -> tuple[float, float]:
    """(host ms, wall ms) per call."""
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - start
    sync(device)
    wall = time.perf_counter() - start
    return host * 1e3 / calls, wall * 1e3 / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flavor", default="gdn_300M")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="narrow widths (CPU dry runs)")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--implementation", default="fused", choices=["fused", "foreach"])
    args = p.parse_args()
    from hybridtitan.optim import LocalShardAdamW, clip_grad_norm_

    device = torch.device(args.device)
    params = build(args.flavor, args.tiny, device)
    grads = [q.grad.detach().clone() for q in params]
    start = [q.detach().clone() for q in params]
    print(f"{args.flavor}{' (tiny)' if args.tiny else ''} on {device}: {len(params)} parameters, "
          f"{args.calls} calls each")

    def torch_clip():
        return torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True).full_tensor()

    def ours_clip():
        return clip_grad_norm_(params, 1.0)

    norms = {}
    for name, fn in (("torch.nn.utils.clip_grad_norm_", torch_clip), ("hybridtitan.optim.clip_grad_norm_", ours_clip)):
        for q, g in zip(params, grads):
            q.grad.copy_(g)
        norms[name] = fn().item()
        host, wall = time_calls(fn, args.calls, device)
        print(f"clip, {name}: {host:.3f} ms host, {wall:.3f} ms wall per call; norm {norms[name]:.6g}")
    a, b = norms.values()
    assert abs(a - b) <= 1e-5 * abs(a), norms

    kwargs = {"lr": 1e-4, "weight_decay": 0.01, args.implementation: True}
    after = {}
    for name, cls in (("torch.optim.AdamW", torch.optim.AdamW), ("hybridtitan.optim.LocalShardAdamW",
                                                                   LocalShardAdamW)):
        with torch.no_grad():
            for q, s, g in zip(params, start, grads):
                q.copy_(s)
                q.grad.copy_(g)
        optimizer = cls(params, **kwargs)
        optimizer.step()  # the first step: the moments are created, not timed
        after[name] = [q.detach().full_tensor().clone() for q in params]
        host, wall = time_calls(optimizer.step, args.calls, device)
        print(f"AdamW {args.implementation} step, {name}: {host:.3f} ms host, {wall:.3f} ms wall per call")
    first, second = after.values()
    assert all(torch.equal(x, y) for x, y in zip(first, second)), "the two updates differ"
    print("same norm and same first update both ways")


if __name__ == "__main__":
    main()
