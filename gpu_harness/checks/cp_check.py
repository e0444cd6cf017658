"""Context parallelism's ops on a GPU: hybridtitan.ops.context_parallel running FLA's kernels (and ours) through
``Kernels``, two ranks sharing one GPU, against the same kernels on the whole sequence in one process.

    python gpu_harness/checks/cp_check.py --json $OUT/cp_check.json      # on the GPU machine
    python gpu_harness/checks/cp_check.py --device cpu                    # dry run: the PyTorch reference on CPUs

The two ranks talk over gloo, which gathers and reduces CUDA tensors through the host (NCCL refuses two ranks on
one GPU): this checks the kernels' part of CP (packed segments with initial and final states, the delta rules'
summary pass over V + K value columns, the convolution's halo as its initial state), not NCCL's. The trainer's
CP over NCCL needs a machine with two GPUs.

Each op at the head sizes of a 300M flavor (the shapes whose kernels the GPU machine's seed cache has tuned),
inputs in bfloat16 as training gives them (the decays' parameters in float32): gated_delta_rule (gdn_300M: 4
query/key heads, 8 value heads, 64 x 64), kda (kda_300M: 8 heads, 32 x 64), simple_gla (Mamba2's SSD,
zebra_mamba2_300M: 32 heads, 64 x 64), the short convolution (1,024 channels, width 4) and attention (8 query
heads over 2 key heads of 128) and MLA's attention (16 heads with keys of their own, keys of 96 = 64 + 32 RoPE
wider than values of 64). Cases: two dense rows of T / 2 tokens, and one packed row
of T tokens whose document boundaries fall inside chunks, on a chunk's edge and one token before one; both layouts
(contiguous, zigzag). Per case: ||cp - one|| / ||one|| of the output and of every input's gradient (a shared
parameter's summed over the ranks), against --bar (default 2e-2: bfloat16 inputs, a state carried in float32).
Prints one line per case as both ranks finish it, PASS or FAIL; the ranks are stopped after --timeout seconds
(the first cases autotune FLA's kernels at shapes of their own: minutes on a cold Triton cache), the cases not
run reported. Exit code 1 if any failed or was not run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HARNESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)  # common.py, in gpu_harness/

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common import (  # noqa: E402,F401  (REPO: puts the checkout on sys.path)
    REPO,
    kernel_config_arguments,
    record_kernel_configs,
    rel_err,
    use_kernel_configs,
)

OPS = ("gated_delta_rule", "kda", "simple_gla", "short_conv", "attention", "mla")
WORLD = 2


def boundaries(T: int) -> list[int]:
    """One packed row's documents: boundaries inside chunks, on a chunk's edge, one token before one."""
    C = T // (2 * WORLD)
    return [0, C // 3, C, 2 * C - 1, 2 * C + C // 3, 3 * C + 5, T]


def inputs(op: str, B: int, T: int, seed: int, device, small: bool) -> tuple[dict, dict]:
    """(sequence tensors [B, T, ...] in bfloat16, parameters in float32): the same on every rank."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    def seq(*shape, scale=1.0):
        return randn(*shape, scale=scale).to(torch.bfloat16)

    s = 4 if small else 1  # the CPU dry run: heads and widths a quarter or less
    if op == "gated_delta_rule":
        H, HV, K, V = 4 // s or 1, 8 // s, 64 // s, 64 // s
        return ({"q": seq(B, T, H, K), "k": seq(B, T, H, K), "v": seq(B, T, HV, V), "a": seq(B, T, HV, scale=0.5),
                 "b": seq(B, T, HV)},
                {"A_log": torch.empty(HV).uniform_(1, 16, generator=g).log().to(device),
                 "dt_bias": randn(HV, scale=0.1) - 3})
    if op == "kda":
        H, K, V = 8 // s, 32 // s, 64 // s
        return ({"q": seq(B, T, H, K), "k": seq(B, T, H, K), "v": seq(B, T, H, V), "a": seq(B, T, H, K, scale=0.5),
                 "b": seq(B, T, H)},
                {"A_log": torch.empty(H).uniform_(1, 16, generator=g).log().to(device),
                 "dt_bias": randn(H * K, scale=0.1) - 3})
    if op == "simple_gla":
        H, K, V = 32 // s, 64 // s, 64 // s
        return ({"q": seq(B, T, H, K), "k": seq(B, T, H, K, scale=K ** -0.5), "v": seq(B, T, H, V),
                 "g": (-F.softplus(randn(B, T, H)) * 0.05).to(torch.bfloat16)}, {})
    if op == "short_conv":
        D = 1024 // s
        return {"x": seq(B, T, D)}, {"weight": randn(D, 4, scale=0.5), "bias": randn(D, scale=0.1)}
    if op == "mla":  # keys per head, wider than the values (a no-RoPE and a RoPE part): the efficient kernel
        H, Dk, Dv = 16 // s, 96 // s, 64 // s
        return {"q": seq(B, T, H, Dk), "k": seq(B, T, H, Dk), "v": seq(B, T, H, Dv)}, {}
    H, Hk, D = 8 // s, 2 // s or 1, 128 // s
    return {"q": seq(B, T, H, D), "k": seq(B, T, Hk, D), "v": seq(B, T, Hk, D)}, {}


def one_process(kernels, op: str, d: dict, cu):
    if op == "gated_delta_rule":
        return kernels.gated_delta_rule(**d, cu_seqlens=cu)[0]
    if op == "kda":
        return kernels.kda(**d, cu_seqlens=cu)[0]
    if op == "simple_gla":
        return kernels.simple_gla(**d, cu_seqlens=cu)[0]
    if op == "short_conv":
        return kernels.short_conv(d["x"], d["weight"].to(d["x"].dtype), d["bias"].to(d["x"].dtype),
                                  cu_seqlens=cu)[0][0]
    return kernels.attention(d["q"], d["k"], d["v"], d["q"].shape[-1] ** -0.5, cu_seqlens=cu)


def context_parallel(kernels, shard, op: str, d: dict):
    from hybridtitan.ops import context_parallel as cp

    if op == "gated_delta_rule":
        return cp.cp_gated_delta_rule(kernels, shard, **d)[0]
    if op == "kda":
        return cp.cp_kda(kernels, shard, **d)[0]
    if op == "simple_gla":
        return cp.cp_simple_gla(kernels, shard, **d)[0]
    if op == "short_conv":
        return cp.cp_short_conv(kernels, shard, d["x"], d["weight"].to(d["x"].dtype),
                                d["bias"].to(d["x"].dtype))[0][0]
    k, v = cp.gather_sequence(d["k"], shard), cp.gather_sequence(d["v"], shard)
    return cp.cp_attention(kernels, shard, d["q"], k, v, d["q"].shape[-1] ** -0.5)


def leaves(d: dict) -> dict:
    return {name: t.detach().clone().requires_grad_(True) for name, t in d.items()}


def check(kernels, shard, op: str, B: int, cu, seed: int, device, small: bool) -> dict:
    """One op both ways on this rank: {"output": err, "d<name>": err, ...}. Every collective comes before any
    comparison, so the ranks' collectives stay matched."""
    import torch.distributed as dist

    seq, params = inputs(op, B, shard.seq_len, seed, device, small)
    full, full_params = leaves(seq), leaves(params)
    truth = one_process(kernels, op, {**full, **full_params}, cu)
    cotangent = torch.randn(truth.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    (truth.float() * cotangent).sum().backward()

    local, local_params = leaves({n: shard.split(t) for n, t in seq.items()}), leaves(params)
    ours = context_parallel(kernels, shard, op, {**local, **local_params})
    (ours.float() * shard.split(cotangent)).sum().backward()
    gathered = shard.gather(ours.detach())
    errors = {"output": rel_err(gathered, truth)}
    errors.update({f"d{n}": rel_err(local[n].grad, shard.split(full[n].grad)) for n in local})
    for name, p in local_params.items():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=shard.group)
        errors[f"d{name} (summed)"] = rel_err(grad, full_params[name].grad)
    return errors


def worker(rank: int, folder: str, device_type: str, T: int, tuned: str, record: str | None) -> None:
    """One rank: every case in turn, each appended to folder/rank<R>.jsonl as it completes (a run cut short keeps
    what it found). ``tuned``: the kernel configurations (activated before FLA is imported); ``record``: a folder
    to merge what this rank's autotuner chose into, after its cases."""
    import datetime

    use_kernel_configs(tuned, device_type, quiet=rank > 0)

    import torch.distributed as dist

    from hybridtitan.ops import Kernels
    from hybridtitan.ops import context_parallel as cp

    device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))  # first calls autotune FLA's kernels
    kernels = Kernels()
    small = device.type == "cpu"
    with open(f"{folder}/rank{rank}.jsonl", "a") as out:
        for layout in cp.LAYOUTS:
            for case in ("dense", "packed"):
                B, cu = (2, None) if case == "dense" else (1, torch.tensor(boundaries(T), device=device))
                length = T // 2 if case == "dense" else T
                shard = cp.shard_for(cu, length, None, layout, device=device)
                for i, op in enumerate(OPS):
                    start = time.perf_counter()
                    errors = check(kernels, shard, op, B, cu, 1000 * i + 7, device, small)
                    out.write(json.dumps({"case": f"{op} {layout} {case}", "errors": errors,
                                          "seconds": time.perf_counter() - start}) + "\n")
                    out.flush()
    record_kernel_configs(record, device, f"cp_check rank {rank}")
    dist.destroy_process_group()


def completed(folder: str) -> list[list[dict]]:
    """Per case that every rank has finished, in order: each rank's record."""
    per_rank = []
    for r in range(WORLD):
        path = f"{folder}/rank{r}.jsonl"
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        per_rank.append([json.loads(line) for line in lines if line.endswith("}")])
    return [list(records) for records in zip(*per_rank)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--seq-len", type=int, default=None, help="T of the packed row (default 8192; CPU 256)")
    p.add_argument("--bar", type=float, default=2e-2)
    p.add_argument("--timeout", type=float, default=480, help="seconds before the ranks are stopped (default 480)")
    p.add_argument("--json", default=None)
    kernel_config_arguments(p)
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    T = args.seq_len or (8192 if args.device == "cuda" else 256)
    use_kernel_configs(args.kernel_configs, args.device)  # checked here, activated in each rank
    versions = {"torch": torch.__version__}
    try:
        import fla
        import triton

        versions.update(triton=triton.__version__, fla=fla.__version__)
    except ImportError:
        pass
    print(f"context parallelism over {WORLD} ranks on one {args.device} device (gloo), T = {T}; "
          + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    report, failed, expected = {}, 0, len(OPS) * 2 * 2

    def take(records: list[dict]) -> None:
        nonlocal failed
        key = records[0]["case"]
        worst = {name: max(r["errors"][name] for r in records) for name in records[0]["errors"]}
        ok = all(e <= args.bar for e in worst.values())
        failed += not ok
        report[key] = {"ok": ok, "worst": worst, "seconds": max(r["seconds"] for r in records)}
        detail = ", ".join(f"{name} {e:.1e}" for name, e in worst.items())
        print(f"{'PASS' if ok else 'FAIL'}  {key:<34} {detail}  ({report[key]['seconds']:.1f} s)", flush=True)

    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(worker, args=(folder, args.device, T, args.kernel_configs,
                                                   args.record_kernel_configs), nprocs=WORLD, join=False,
                                     start_method="spawn")
        deadline, finished = time.monotonic() + args.timeout, False
        try:
            while not finished and time.monotonic() < deadline:
                finished = context.join(timeout=2)
                for records in completed(folder)[len(report):]:
                    take(records)
        finally:
            for process in context.processes:  # stopped here, so that none keeps the GPU after this script
                if process.is_alive():
                    process.kill()
        for records in completed(folder)[len(report):]:
            take(records)
    missing = expected - len(report)
    print(f"{len(report) - failed} of {len(report)} cases within {args.bar:g}"
          + (f"; {missing} not run within {args.timeout:g} s" if missing else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"versions": versions, "seq_len": T, "bar": args.bar, "cases": report,
                       "not_run": missing}, f, indent=1)
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
