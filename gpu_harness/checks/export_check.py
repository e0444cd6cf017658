"""Each mixer's Hugging Face export on the GPU, through transformers and FLA's kernels, against the same export on
the CPU (the PyTorch forms), and left-padded batches against each prompt alone.

    python gpu_harness/checks/export_check.py --json $OUT/export_check.json   # on the GPU machine, a minute warm
    python gpu_harness/checks/export_check.py --device cpu                  # dry run: the same code, CPU on both sides

For each of debug_gdn, debug_kda, debug_mamba2 and debug_hybrid (MLA + GDN): a model-only checkpoint of random
weights drawn at init std 0.3 (peaked logits, so that greedy decoding has no near-ties), exported by the command
line of ``python -m hybridtitan.export_hf --format hybridtitan`` (bfloat16 weights; the package's own model code,
FLA's layout being FLA's classes), then loaded with ``AutoModelForCausalLM.from_pretrained(...,
trust_remote_code=True)`` twice: float32 on the CPU and float32 on DEVICE. Checked:

logits  a batch of 2 x 300 tokens: relative error ||gpu - cpu|| / ||cpu|| below 1e-2 (FLA's float32 kernels use
        TF32 products), and the share of positions whose top token differs (reported)
greedy  3 prompts of 7, 23 and 61 tokens, 24 new tokens each: the left-padded batch on DEVICE equals each prompt
        alone on DEVICE, and each prompt alone on the CPU
bf16    the same logits with the model in bfloat16 on DEVICE, against the CPU's float32 (reported, bar 5e-2)

Prints one line per case (PASS/FAIL) and the versions of torch, triton, flash-linear-attention and transformers;
exit code 1 if a case failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HARNESS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(HARNESS)
sys.path.insert(0, REPO)
if HARNESS not in sys.path:
    sys.path.insert(0, HARNESS)  # common.py, in gpu_harness/

FLAVORS = ["debug_gdn", "debug_kda", "debug_mamba2", "debug_hybrid"]


def versions() -> dict:
    out = {}
    for name, module in (("torch", "torch"), ("triton", "triton"), ("flash-linear-attention", "fla"),
                         ("transformers", "transformers")):
        try:
            out[name] = __import__(module).__version__
        except ImportError:
            out[name] = None
    return out


def make_export(flavor: str, folder: str) -> str:
    import torch

    from common import run_exporter
    from hybridtitan.checkpoint import save_model_checkpoint
    from hybridtitan.models import build_model, get_flavor

    torch.manual_seed(0)
    args = get_flavor(flavor)
    args.init_std = 0.3
    model = build_model(args, "meta")
    model.to_empty(device="cpu")
    model.init_weights()
    step = os.path.join(folder, "checkpoint", "step-0")
    save_model_checkpoint(model, step, torch.float32)
    export = os.path.join(folder, "export")
    # the exporter's command line in this process; its error is this flavor's failure, not the run's
    run_exporter("hybridtitan.export_hf", ["--checkpoint", step, "--output", export, "--tokenizer",
                                           os.path.join(REPO, "hybridtitan", "assets", "tokenizer"), "--format",
                                           "hybridtitan"])
    return export


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def check(flavor: str, device: str, work: str) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    export = make_export(flavor, os.path.join(work, flavor))
    cpu = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).eval()
    fast = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32).to(device).eval()
    from hybridtitan.ops import fla_available

    # the export's model takes FLA's kernels where fla imports and its config allows them; a CPU tensor always
    # runs the PyTorch forms
    fla = getattr(fast.config, "use_fla_kernels", True) and fla_available() and device != "cpu"
    kernels = "FLA" if fla else "reference"
    g = torch.Generator().manual_seed(1)
    vocab = cpu.config.vocab_size
    results = []

    def case(name: str, ok: bool, detail: str) -> None:
        results.append({"flavor": flavor, "case": name, "ok": bool(ok), "detail": detail, "kernels": kernels})
        print(f"{'PASS' if ok else 'FAIL'}  {flavor:13s} {name:7s} {detail}  [{kernels} kernels on {device}]",
              flush=True)

    ids = torch.randint(0, vocab, (2, 300), generator=g)
    with torch.no_grad():
        ref = cpu(input_ids=ids).logits
        out = fast(input_ids=ids.to(device)).logits.cpu()
    err = rel(out, ref)
    flips = float((out.argmax(-1) != ref.argmax(-1)).float().mean())
    case("logits", err < 1e-2, f"rel err {err:.2e} (bar 1e-2), top-1 differs at {flips:.2%} of positions")

    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in (7, 23, 61)]
    width = max(len(p) for p in prompts)
    pad = cpu.config.pad_token_id if cpu.config.pad_token_id is not None else 0
    batch = torch.full((len(prompts), width), pad)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):], mask[i, width - len(p):] = p, 1
    gen = dict(max_new_tokens=24, do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        together = fast.generate(input_ids=batch.to(device), attention_mask=mask.to(device), **gen)[:, width:].cpu()
        alone = [fast.generate(input_ids=p[None].to(device), **gen)[0, len(p):].cpu() for p in prompts]
        on_cpu = [cpu.generate(input_ids=p[None], **gen)[0, len(p):] for p in prompts]
    same_batch = all(torch.equal(together[i], alone[i]) for i in range(len(prompts)))
    same_cpu = all(torch.equal(alone[i], on_cpu[i]) for i in range(len(prompts)))
    case("greedy", same_batch and same_cpu, f"left-padded batch == each alone: {same_batch}; "
                                            f"{device} == cpu: {same_cpu} (3 prompts x 24 tokens)")

    half = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.bfloat16).to(device).eval()
    with torch.no_grad():
        out16 = half(input_ids=ids.to(device)).logits.cpu()
    err16 = rel(out16, ref)
    case("bf16", err16 < 5e-2, f"rel err {err16:.2e} against the CPU's float32 (bar 5e-2)")
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="the fast side (default: cuda if available, else cpu)")
    p.add_argument("--flavors", default=",".join(FLAVORS))
    p.add_argument("--json", default=None, help="write the results here too")
    from common import kernel_config_arguments, record_kernel_configs, use_kernel_configs

    kernel_config_arguments(p)
    a = p.parse_args(argv)
    import warnings

    import torch
    import transformers

    # quiet by itself: no filter in a pipe after it (grep holds its output back in a buffer until it ends, and a
    # call cut at its time limit then keeps nothing)
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    use_kernel_configs(a.kernel_configs, device)  # before FLA is imported
    info = versions()
    print("versions:", ", ".join(f"{k} {v}" for k, v in info.items()), flush=True)
    t0, results = time.perf_counter(), []
    with tempfile.TemporaryDirectory() as work:
        for flavor in a.flavors.split(","):
            try:
                results += check(flavor, device, work)
            except Exception as e:  # one flavor's failure does not hide the others'
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                results.append({"flavor": flavor, "case": "run", "ok": False, "detail": f"{type(e).__name__}: {first}"})
                print(f"FAIL  {flavor:13s} run     {type(e).__name__}: {first}", flush=True)
    print(f"{sum(r['ok'] for r in results)}/{len(results)} passed in {time.perf_counter() - t0:.0f} s", flush=True)
    record_kernel_configs(a.record_kernel_configs, device, "export_check")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"versions": info, "device": device, "results": results}, f, indent=1)
    sys.exit(0 if all(r["ok"] for r in results) else 1)


if __name__ == "__main__":
    main()
