"""Helpers shared by the GPU harness's scripts (gpu_check, export_check, bench_throughput, trainer_speed).

Error measures, a timer, the bf16 matmul rate, tables, the process group of one that FSDP2 needs, the CUDA
allocator setting of the trainer, models built under a chosen kernel configuration from given weights, the
exporter's command line run in this process, and the FLA Hugging Face twin of a pure GDN / KDA model (its
configuration and the state-dict name mapping).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import io
import json
import os
import platform
import sys
import tempfile
import time
from typing import TYPE_CHECKING

HARNESS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HARNESS)
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # run from a checkout

import torch  # noqa: E402

if TYPE_CHECKING:  # hybridtitan is imported where it is used: trainer_speed runs other checkouts' trainers
    from hybridtitan.models.args import ModelArgs
    from hybridtitan.ops import KernelConfig

# H100 / H200 dense bf16 (datasheet), the yardstick beside the measured matmul rate
DATASHEET_FLOPS = 989e12

# ------------------------------------------------------------------------------------------------ measures


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float32 (float64 for the norms), b the reference; 0 when both are zero."""
    a = a.detach().double()
    b = b.detach().to(a.device).double()
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    den = b.norm().item()
    num = (a - b).norm().item()
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def rel_diff(a: float, b: float) -> float:
    """|a - b| / |b| for scalars, b the reference."""
    return abs(a - b) / abs(b) if b != 0 else (0.0 if a == b else float("inf"))


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def one_line(exc: BaseException, limit: int = 240) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def fmt(x, digits: int = 2) -> str:
    """A table cell: floats in scientific notation for errors, '-' for None."""
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:  # nan
            return "nan"
        return f"{x:.{digits}e}"
    return str(x)


def format_table(columns: list[str], rows: list[list]) -> str:
    """A plain text table with aligned columns (also valid Markdown: | a | b |)."""
    cells = [[str(c) for c in columns]] + [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = []
    for n, r in enumerate(cells):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ environment


def versions(device: torch.device | None = None) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "fla", "transformers"):
        try:
            mod = __import__(name)
            info[name] = getattr(mod, "__version__", "?")
        except Exception as e:  # noqa: BLE001 - a missing package is reported, not fatal
            info[name] = f"unavailable ({one_line(e, 80)})"
    if device is not None and device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    else:
        info["gpu"] = None
        info["cpu"] = platform.processor() or platform.machine()
    info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return info


# ------------------------------------------------------------------------------------------------ kernel configurations


def kernel_config_arguments(parser) -> None:
    """The harness scripts' two options for tuned kernel configurations (hybridtitan.ops.kernel_configs)."""
    parser.add_argument("--kernel-configs", default="shipped",
                        help="shipped (the package's for this GPU and versions; else FLA autotunes), autotune, or "
                             "a folder python -m hybridtitan.tune recorded (default shipped)")
    parser.add_argument("--record-kernel-configs", default=None, metavar="FOLDER",
                        help="after the run, merge what the autotuner chose into FOLDER (with --kernel-configs "
                             "autotune: every shape of the run tuned on this GPU)")


def use_kernel_configs(setting: str, device, quiet: bool = False):
    """The configurations ``setting`` gives, activated on a GPU: before anything imports FLA. Returns the choice."""
    from hybridtitan.ops import kernel_configs

    try:
        choice = kernel_configs.use(setting, torch.device(device))
    except kernel_configs.KernelConfigError as e:
        raise SystemExit(f"error: --kernel-configs: {e}") from None
    if not quiet:
        print(choice.message, flush=True)
    return choice


def record_kernel_configs(folder: str | None, device, what: str) -> None:
    """What the autotuner chose in this process, merged into ``folder`` (nothing where it is None or on a CPU)."""
    device = torch.device(device)
    if folder is None or device.type != "cuda":
        return
    from hybridtitan.ops import kernel_configs

    written = kernel_configs.save_choices(folder, kernel_configs.this_gpu(device),
                                          {"harness": what, "argv": sys.argv[1:]})
    print(f"recorded {sum(written.values())} shapes of {len(written)} kernels in {folder}", flush=True)


def set_expandable_segments(device: torch.device) -> bool:
    """The trainer's allocator setting (hybridtitan/train.py), before the first CUDA allocation."""
    if device.type != "cuda":
        return False
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    return True


def init_process_group_of_one(device: torch.device):
    """A process group of one (NCCL on a GPU, gloo on a CPU), as the trainer makes without torchrun, and the
    1-D data-parallel mesh of hybridtitan.parallel; returns the mesh."""
    import torch.distributed as dist

    from hybridtitan.parallel import DataParallel, build_mesh

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
        store = tempfile.NamedTemporaryFile(prefix="hybridtitan-pg-", delete=False).name
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return build_mesh(DataParallel(1, 1), device.type)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """CUDA events on a GPU, perf_counter on a CPU; seconds."""

    def __init__(self, device: torch.device):
        self.device = device

    def __enter__(self):
        sync(self.device)
        if self.device.type == "cuda":
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.end.record()
            sync(self.device)
            self.seconds = self.start.elapsed_time(self.end) / 1e3
        else:
            self.seconds = time.perf_counter() - self.t0
        return False


def matmul_rate(device: torch.device, n: int, warmup: int = 3, iters: int = 10) -> float:
    """FLOP/s of an n x n x n bf16 torch.matmul, mean over ``iters`` after ``warmup`` (CUDA events on a GPU):
    what the GPU's GEMMs reach here, the denominator of an MFU that the datasheet's peak overstates."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(warmup):
        c = a @ b
    with Timer(device) as t:
        for _ in range(iters):
            c = a @ b
    del a, b, c
    free_memory(device)
    return 2 * n ** 3 * iters / t.seconds


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def free_memory(device: torch.device | None = None) -> None:
    gc.collect()
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def write_json(path: str, obj) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
    os.replace(tmp, path)


def run_exporter(module: str, argv: list[str]) -> None:
    """The exporter's command line, MODULE's main(argv) as `python -m MODULE` calls it, in this process (which has
    imported what a fresh interpreter spends ~6 s of CPU importing), its output kept back. A command-line error
    (SystemExit other than 0) becomes a RuntimeError naming the line it said, which a check's `except Exception`
    records as that case's failure."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            importlib.import_module(module).main(argv)
    except SystemExit as e:  # a command line's error: its one line said, then exit 2
        if e.code not in (0, None):
            tail = said.getvalue().strip().splitlines()
            raise RuntimeError(f"{module} exited {e.code}: {tail[-1] if tail else ''}") from None


# ------------------------------------------------------------------------------------------------ models


def build_with_kernels(args: ModelArgs, device, config: KernelConfig, state: dict | None = None,
                       dtype: torch.dtype | None = None):
    """A HybridLM whose modules run ``config``'s kernels, holding ``state`` (a state dict) when given, on
    ``device`` in ``dtype``: the same weights under another kernel choice (the kernels are fixed at build time)."""
    from hybridtitan import ops
    from hybridtitan.models import build_model

    model = build_model(args, "meta", ops.Kernels(config))
    model.to_empty(device=device)
    if state is None:
        model.init_weights()
    else:
        model.load_state_dict(state)
    return model.to(dtype) if dtype is not None else model


# ------------------------------------------------------------------------------------------------ FLA's HF twin


def is_pure_fla_model(args: ModelArgs) -> bool:
    """A pure GDN or KDA stack (mixer, MLP, mixer, MLP, ...) that FLA's own HF classes can hold."""
    return args.mixer in ("gdn", "kda") and args.n_layers % 2 == 0 and args.pattern == "M-" * (args.n_layers // 2)


def fla_config(args: ModelArgs, loss: str = "plain", **extra):
    """FLA's GatedDeltaNetConfig / KDAConfig for a pure GDN / KDA ModelArgs.

    loss: 'plain'  -> fuse_cross_entropy=True, fuse_linear_cross_entropy=False (FLA's fused CE over all logits)
          'linear' -> fuse_cross_entropy=False, fuse_linear_cross_entropy=True (FLA's FusedLinearCrossEntropy)
          'torch'  -> both False (nn.CrossEntropyLoss)
    KDA's model has no fused full-logit path in training: 'plain' there is torch's cross-entropy (see below).
    (validate_loss_config refuses both True.)
    """
    if not is_pure_fla_model(args):
        raise ValueError(f"FLA's HF classes hold pure GDN/KDA stacks only, not pattern {args.pattern!r} "
                         f"with mixer {args.mixer!r}")
    flags = {"plain": (True, False), "linear": (False, True), "torch": (False, False)}[loss]
    m = getattr(args, args.mixer)
    common = dict(
        hidden_size=args.dim, num_hidden_layers=args.n_layers // 2, num_heads=m.num_heads, head_dim=m.head_dim,
        expand_v=m.head_v_dim / m.head_dim, conv_size=m.conv_size, intermediate_size=args.ffn_dim,
        hidden_act="swish", vocab_size=args.vocab_size, norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_embeddings, initializer_range=args.init_std, use_cache=False,
        fuse_cross_entropy=flags[0], fuse_linear_cross_entropy=flags[1], max_position_embeddings=8192,
    )
    if args.mixer == "kda":
        # FLA 0.6.0's KDAForCausalLM reads only fuse_cross_entropy, and in training it means the fused *linear*
        # cross-entropy; without it the loss is torch's cross-entropy over the full logits.
        common["fuse_cross_entropy"] = loss == "linear"
        common.pop("fuse_linear_cross_entropy")
    common.update(extra)
    if args.mixer == "gdn":
        from fla.models import GatedDeltaNetConfig

        return GatedDeltaNetConfig(num_v_heads=m.num_v_heads, **common)
    from fla.models import KDAConfig

    return KDAConfig(**common)


def fla_model_class(args: ModelArgs):
    from fla.models import GatedDeltaNetForCausalLM, KDAForCausalLM

    return GatedDeltaNetForCausalLM if args.mixer == "gdn" else KDAForCausalLM


def to_fla_state_dict(state: dict, args: ModelArgs) -> dict:
    """hybridtitan HybridLM state dict -> FLA ForCausalLM state dict (pure GDN / KDA stacks).

    layers.{j}.mixer.X -> model.layers.{j//2}.attn.X; layers.{j}.norm -> model.layers.{j//2}.attn_norm (even j)
    or .mlp_norm (odd j); layers.{j}.mlp.X -> model.layers.{j//2}.mlp.X; embeddings -> model.embeddings;
    norm -> model.norm; lm_head (untied) -> lm_head; a tied output layer is the embedding.
    """
    if not is_pure_fla_model(args):
        raise ValueError(f"no FLA layout for pattern {args.pattern!r}")
    out = {}
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "embeddings":
            new = "model." + key
        elif parts[0] == "norm":
            new = "model." + key
        elif parts[0] == "lm_head":
            new = key
        elif parts[0] == "layers":
            j = int(parts[1])
            block = f"model.layers.{j // 2}"
            rest = ".".join(parts[3:])
            if parts[2] == "norm":
                new = f"{block}.{'attn_norm' if j % 2 == 0 else 'mlp_norm'}.{rest}"
            elif parts[2] == "mixer":
                new = f"{block}.attn.{rest}"
            elif parts[2] == "mlp":
                new = f"{block}.mlp.{rest}"
            else:
                raise KeyError(f"unexpected key {key!r}")
        else:
            raise KeyError(f"unexpected key {key!r}")
        out[new] = value
    if args.tie_embeddings:
        out["lm_head.weight"] = out["model.embeddings.weight"]
    return out


def load_into_fla(fla_model, state: dict, args: ModelArgs) -> None:
    """Loads a hybridtitan state dict into an FLA model; every FLA parameter must be set, none left over."""
    mapped = to_fla_state_dict(state, args)
    missing, unexpected = fla_model.load_state_dict(mapped, strict=False)
    missing = [k for k in missing if not (args.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"FLA state dict mismatch: missing {missing[:6]}, unexpected {unexpected[:6]}")
    if args.tie_embeddings and fla_model.lm_head.weight.data_ptr() != fla_model.model.embeddings.weight.data_ptr():
        raise RuntimeError("FLA model's lm_head is not tied to its embedding")
