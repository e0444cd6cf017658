"""Record the Triton kernels of real training steps on a GPU into the manifest the ROCm compile check reads.

    python gpu_harness/rocm/record_triton_manifest.py                   # every debug and 300M flavor, packed and not
    python gpu_harness/rocm/record_triton_manifest.py --flavors debug_gdn --boundaries false --out /tmp/k.json

Each (flavor, packed documents or not) is one step of the trainer (``hybridtitan.train.main``: the shipped corpus
and tokenizer, sequence 2048, batch 1, torch.compile off so that every Triton kernel is FLA's or ours and goes
through the recorder) in a fresh process under ``triton_recorder.record_triton_kernels`` (beside this script): a
kernel compiled earlier in a process is never compiled again, so it would not be seen. Up to ``--jobs``
recordings run at once (the first step autotunes, which is mostly compilation on the CPU). The records are
merged (deduplicated by id) into ``--out``, on top of what it already holds, with the device, the versions and
what was recorded, rewritten after each recording (a run cut short keeps what it recorded). Exit 1 if a
recording failed or saw a compile it could not record; exit 2 on a machine without a GPU (nothing would be
recorded).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HARNESS = os.path.dirname(os.path.abspath(__file__))  # gpu_harness/rocm/
REPO = os.path.dirname(os.path.dirname(HARNESS))
for _path in (REPO, HARNESS):  # run from a checkout: the trainer, and the recorder beside this script
    if _path not in sys.path:
        sys.path.insert(0, _path)

from triton_recorder import load_manifest, record_triton_kernels, save_manifest  # noqa: E402

DEFAULT_FLAVORS = ("debug_gdn,debug_kda,debug_mamba2,debug_hybrid,"
                   "gdn_300M,kda_300M,zebra_gdn_300M,zebra_mamba2_300M")
# the fields a merge writes itself (save_manifest's and this script's); the others of an existing --out are kept
MANIFEST_OWN_FIELDS = ("format", "triton", "fla", "fla_core", "torch", "device", "source", "recorded", "failed",
                       "skipped", "kernels")


def record_one(flavor: str, boundaries: str, out: str, workdir: str) -> int:
    """In this (fresh) process: one training step of ``flavor`` under the recorder; the records go to ``out``."""
    from hybridtitan.train import main

    with record_triton_kernels() as rec:
        main(["--job.config_file", os.path.join(REPO, "train_configs", "debug_hybrid.toml"),  # exits on failure
              "--model.flavor", flavor, "--data.document_boundaries", boundaries,
              "--training.steps", "1", "--training.seq_len", "2048", "--training.local_batch_size", "1",
              "--training.global_batch_size", "1", "--compile.enable", "false",
              "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false",
              "--job.dump_folder", os.path.join(workdir, f"{flavor}_{boundaries}")])
    save_manifest(out, rec.kernels, recorded=f"{flavor}, document_boundaries {boundaries}", skipped=rec.skipped)
    print(f"{flavor} boundaries={boundaries}: {len(rec.kernels)} records, {len(rec.skipped)} skipped")
    return 1 if rec.skipped else 0


def merge(out: str, workdir: str, done: dict, base: dict | None = None) -> tuple[dict | None, list[str], list[str]]:
    """Merge the recordings finished so far into ``out`` (rewritten after each one, so a run cut short keeps
    what it recorded), on top of ``base`` (what ``out`` held when the run started: its records, its list of
    recordings and its other fields stay; a record recorded again replaces its old copy). Returns (manifest or
    None, failed recordings, skipped compiles)."""
    parts, recorded, skipped = [], list(base["recorded"]) if base else [], []
    for flavor, b in done:
        path = os.path.join(workdir, f"{flavor}_{b}.json")
        if os.path.exists(path):
            m = load_manifest(path)
            parts.append(m)
            recorded.append(m["recorded"])
            skipped += m.get("skipped", [])
    failed = sorted(f"{f} boundaries={b}" for (f, b), rc in done.items() if rc)
    if not parts:
        return None, failed, skipped
    records = [{"origin": m["device"], **r} for m in parts for r in m["kernels"]]  # where each was recorded
    kept = {k: v for k, v in (base or {}).items() if k not in MANIFEST_OWN_FIELDS}  # e.g. "supplemented"
    # the new records first: of two with one id, save_manifest keeps the first
    manifest = save_manifest(
        out, records + (base["kernels"] if base else []), device=parts[0]["device"], **kept,
        source="recorded by gpu_harness/rocm/record_triton_manifest.py: one training step per flavor (sequence 2048, "
               "batch 1, torch.compile off), each in a fresh process under record_triton_kernels()",
        recorded=sorted(set(recorded)), **({"failed": failed} if failed else {}),
        **({"skipped": skipped} if skipped else {}))
    return manifest, failed, skipped


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", default=DEFAULT_FLAVORS)
    p.add_argument("--boundaries", default="false,true", help="document_boundaries values to record")
    p.add_argument("--out", default=os.path.join(REPO, "tests", "assets", "triton_kernels.json"))
    p.add_argument("--workdir", default="/tmp/record_triton")
    p.add_argument("--jobs", type=int, default=4, help="recordings at once")
    p.add_argument("--timeout", type=float, default=900, help="seconds per recording")
    p.add_argument("--one", nargs=3, metavar=("FLAVOR", "BOUNDARIES", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        return record_one(*args.one, args.workdir)

    import torch

    if not torch.cuda.is_available():
        print("error: no GPU visible: a training step on the CPU launches no Triton kernel, nothing to record",
              file=sys.stderr)
        return 2
    os.makedirs(args.workdir, exist_ok=True)
    base = load_manifest(args.out) if os.path.exists(args.out) else None  # merged into, not overwritten
    todo = [(f, b) for f in args.flavors.split(",") if f for b in args.boundaries.split(",") if b]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    running: list[tuple] = []
    done: dict[tuple, int] = {}
    manifest, failed, skipped = None, [], []
    t0 = time.perf_counter()
    while todo or running:
        while todo and len(running) < args.jobs:
            flavor, b = todo.pop(0)
            part = os.path.join(args.workdir, f"{flavor}_{b}.json")
            log = open(os.path.join(args.workdir, f"{flavor}_{b}.log"), "w")
            proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--workdir", args.workdir,
                                     "--one", flavor, b, part], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=REPO)
            running.append((flavor, b, part, proc, log, time.perf_counter()))
        time.sleep(1)
        for item in list(running):
            flavor, b, part, proc, log, started = item
            if proc.poll() is None and time.perf_counter() - started > args.timeout:
                proc.kill()
                proc.wait()
            if proc.poll() is not None:
                log.close()
                running.remove(item)
                done[(flavor, b)] = proc.returncode
                print(f"[{time.perf_counter() - t0:6.1f}s] {flavor} boundaries={b}: exit {proc.returncode} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
                if proc.returncode:
                    with open(log.name) as f:
                        print("    " + "    ".join(f.readlines()[-5:]), flush=True)
                manifest, failed, skipped = merge(args.out, args.workdir, done, base)

    if manifest is None:
        print("no recording succeeded", file=sys.stderr)
        return 1
    kernels = {r["kernel"] for r in manifest["kernels"]}
    print(f"wrote {args.out}: {len(manifest['kernels'])} records, {len(kernels)} kernels, from "
          f"{len(manifest['recorded'])} recordings ({manifest['device']}); failed: {failed or 'none'}")
    return 1 if failed or skipped else 0


if __name__ == "__main__":
    sys.exit(main())
