"""Float8 training of the linear layers with torchao: torchtitan's ``quantize.linear.float8`` converter.

A recipe turns it on with ``model.converters = ["quantize.linear.float8"]`` and configures it in the section
``[quantize.linear.float8]``, with torchtitan 0.2.2's keys (``Float8Settings``). The model stays a plain nn.Module. The
conversion swaps torchao's ``Float8Linear`` in for chosen ``nn.Linear`` modules from outside, before FSDP and
torch.compile wrap the model, as torchtitan converts. A Float8Linear keeps its weight as the same high-precision
parameter. It casts the weight, the input and the output gradient to float8 inside each matrix product. So checkpoints
hold the plain weights, and they load into a model with or without float8.

``plan_float8`` converts the linears whose GEMM float8 speeds up. These stay in high precision, each with its reason:

- the output layer (``lm_head``), because the loss reads its weight (fused linear cross-entropy) and never calls
  it;
- any module whose name contains an entry of ``filter_fqns``;
- shapes float8 GEMMs cannot take (a dimension not divisible by 16);
- GEMMs too small to gain (torchao's auto-filter thresholds for the recipe, ``too_small_for_float8``). The
  per-head gate projections of GDN and KDA (a_proj and b_proj, with as many outputs as heads) always fall here.

Embeddings, norms, convolutions and the recurrent kernels are not nn.Linear and never convert. A converted linear runs
as itself. The models read weights into a fused product (``models.modules.fused_linear``, the SwiGLU's
``ops.swiglu_linear``) only while every linear involved is a plain nn.Linear (``models.modules.is_plain_linear``).

``float8_refusal`` says in one line why float8 cannot run: hardware, torchao missing, or contradictory settings.
``float8_warnings`` says what will run, but slowly or not as set. ``precompute_float8_scales`` is the post-optimizer
step of float8 all-gather under FSDP."""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn as nn

CONVERTER = "quantize.linear.float8"
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
TORCHAO_INSTALL = "pip install torchao==0.18.0"
# torchtitan's flag in filter_fqns that turns on torchao's size filter. Here the size filter is always on, so the
# flag is accepted (for recipes written for torchtitan) and matches no module.
AUTO_FILTER_FLAG = "auto_filter_small_kn"

@dataclass
class Float8Settings:
    """The section ``[quantize.linear.float8]`` with torchtitan's keys: ``Float8Settings(**section)``."""

    recipe_name: str | None = None  # "tensorwise" (None), "rowwise" or "rowwise_with_gw_hp"
    filter_fqns: list[str] = field(default_factory=list)  # module-name substrings kept in high precision
    enable_fsdp_float8_all_gather: bool = False  # FSDP all-gathers weights in float8 (tensorwise only)
    precompute_float8_dynamic_scale_for_fsdp: bool = False  # one all-reduce for all weight scales per step
    emulate: bool = False  # float8 numerics in float32 matmuls: tests on CPU or GPUs without float8

    @property
    def recipe(self) -> str:
        return self.recipe_name or "tensorwise"


def float8_settings(cfg) -> Float8Settings:
    """The recipe's ``[quantize.linear.float8]``."""
    return Float8Settings(**dataclasses.asdict(cfg.quantize.linear.float8))


@dataclass
class Float8Conversion:
    """What a conversion did or would do: the converted linears, the kept ones with their reasons, and whether the
    optimizer step must precompute the float8 weight scales (``precompute_float8_scales``)."""

    recipe: str
    converted: list[str]
    kept: dict[str, str]
    float8_all_gather: bool = False
    precompute_scales: bool = False
    emulate: bool = False
    flops_share: float = 0.0  # of the linear layers' matrix-product FLOPs (weight sizes), the output layer apart

    def summary(self) -> list[str]:
        """One line per kind of linear and reason, converted ones first, for the trainer's log and ``describe``. The
        sublayer index is dropped, as in ``layers.*.mlp.up_proj``."""
        total = len(self.converted) + len(self.kept)
        lines = [f"float8 ({self.recipe}): {len(self.converted)} of {total} linear layers converted, "
                 f"{self.flops_share:.1%} of their matrix-product FLOPs (the output layer apart)"]
        converted, kept = Counter(map(_kind, self.converted)), Counter((_kind(n), r) for n, r in self.kept.items())
        lines += [f"  float8  {kind} (x{count})" for kind, count in converted.items()]
        lines += [f"  kept    {kind} (x{count}): {reason}" for (kind, reason), count in kept.items()]
        return lines


def _kind(name: str) -> str:
    return re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", name)


def too_small_for_float8(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether a GEMM with this weight [N=out_features, K=in_features] is too small to be faster in float8 than in bf16.

    The thresholds are those of torchao 0.18's ``_auto_filter_for_recipe``, from torchao's H100 benchmarks. For small
    products the casts to float8 cost about as much as the product saves. torchao has no thresholds for
    rowwise_with_gw_hp. That recipe keeps the grad_weight product in bf16, so it gains less than rowwise on every shape,
    and rowwise's thresholds apply."""
    N, K = out_features, in_features
    if recipe == "tensorwise":
        return K <= 4096 and N <= 1024
    return N <= 2048 or K <= 1024 or (N <= 4096 and K <= 2048)


def plan_float8(model: nn.Module, settings: Float8Settings, *, fsdp_sharded: bool = False,
                size_filter: bool = True) -> Float8Conversion:
    """Which nn.Linear modules of ``model`` convert to Float8Linear, and why each other one stays. Nothing is converted.
    Preflight, ``describe`` and the trainer's log use the plan; torchao need not be installed.

    Float8 all-gather takes effect only where FSDP shards the weights (``fsdp_sharded``), as in torchtitan. The plan
    says whether the optimizer step must precompute the scales. ``size_filter=False`` lifts only the size thresholds, so
    that tests can exercise float8 on toy shapes; the divisibility by 16 still holds."""
    fqn_filters = [f for f in settings.filter_fqns if f != AUTO_FILTER_FLAG]
    converted, kept = [], {}
    all_flops = converted_flops = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        N, K = module.weight.shape
        all_flops += N * K if name.split(".")[-1] != "lm_head" else 0
        matched = next((f for f in fqn_filters if f in name), None)
        if name.split(".")[-1] == "lm_head":
            kept[name] = "output layer: the loss reads its weight (fused linear cross-entropy), never calls it"
        elif matched is not None:
            kept[name] = f"matches filter_fqns entry {matched!r}"
        elif N % 16 or K % 16:
            kept[name] = f"weight {N}x{K}: float8 GEMMs need both dimensions divisible by 16"
        elif size_filter and too_small_for_float8(settings.recipe, N, K):
            kept[name] = f"weight {N}x{K}: GEMM too small to gain from float8 {settings.recipe} (torchao's thresholds)"
        else:
            converted.append(name)
            converted_flops += N * K
    all_gather = settings.enable_fsdp_float8_all_gather and fsdp_sharded
    return Float8Conversion(settings.recipe, converted, kept, float8_all_gather=all_gather,
                            precompute_scales=all_gather and settings.precompute_float8_dynamic_scale_for_fsdp,
                            emulate=settings.emulate, flops_share=converted_flops / max(all_flops, 1))


def torchao_float8_config(conversion: Float8Conversion):
    """torchao's Float8LinearConfig for the recipe. As torchtitan chooses, it is the recipe's config, with emulation as
    set."""
    from torchao.float8 import Float8LinearConfig

    if conversion.recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=conversion.float8_all_gather,
                                  emulate=conversion.emulate)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(conversion.recipe), emulate=conversion.emulate)


def apply_float8(model: nn.Module, conversion: Float8Conversion) -> None:
    """Swaps Float8Linear in, in place, for the linears the plan converts. Run it before FSDP and torch.compile wrap the
    model. The meta device is fine, because the weights are taken over as they are. Check ``float8_refusal`` first: this
    raises ImportError without torchao."""
    from torchao.float8 import convert_to_float8_training

    if conversion.recipe == "rowwise":
        # torchtitan's workaround for pytorch/pytorch#150859 (inductor's fused casts rounding otherwise than
        # eager's under rowwise scaling)
        import torch._inductor.config

        torch._inductor.config.emulate_precision_casts = True
    chosen = set(conversion.converted)
    convert_to_float8_training(model, config=torchao_float8_config(conversion),
                               module_filter_fn=lambda module, name: name in chosen)


def convert_to_float8(model: nn.Module, settings: Float8Settings, *, fsdp_sharded: bool,
                      size_filter: bool = True) -> Float8Conversion:
    """``plan_float8`` and ``apply_float8`` in one: the plan, carried out on ``model``."""
    conversion = plan_float8(model, settings, fsdp_sharded=fsdp_sharded, size_filter=size_filter)
    apply_float8(model, conversion)
    return conversion


def precompute_float8_scales(model_parts: nn.Module | list[nn.Module], conversion: Float8Conversion) -> None:
    """The post-optimizer step of float8 all-gather (torchtitan's Float8LinearConverter.post_optimizer_hook).

    It computes the float8 scales of every sharded weight from one all-reduce of their amax, instead of one per weight
    at the next all-gather. Call it after ``optimizer.step()``. It does nothing unless the conversion asks for it."""
    if not conversion.precompute_scales:
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    for part in model_parts if isinstance(model_parts, list) else [model_parts]:
        precompute_float8_dynamic_scale_for_fsdp(part)


def torchao_installed() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


# AMD GPUs whose matrix cores do float8 (PyTorch's torch._scaled_mm on ROCm; torchao's float8 dtypes). The MI300
# series (CDNA3) uses the FNUZ variants float8_e4m3fnuz / e5m2fnuz; the MI350 series (CDNA4) and RDNA4 the OCP ones.
ROCM_FLOAT8_ARCHS = {
    "gfx940": "MI300 (FP8 e4m3fnuz)", "gfx941": "MI300 (FP8 e4m3fnuz)", "gfx942": "MI300X/MI325X (FP8 e4m3fnuz)",
    "gfx950": "MI350X/MI355X (OCP FP8 e4m3fn)",
    "gfx1200": "RDNA4 (OCP FP8 e4m3fn)", "gfx1201": "RDNA4 (OCP FP8 e4m3fn)",
}


def float8_refusal(settings: Float8Settings, *, device_type: str, capability: tuple[int, int] | None = None,
                   gcn_arch: str | None = None, compiled: bool = False, torchao_present: bool | None = None
                   ) -> str | None:
    """One line saying why float8 training cannot run with these settings on this device, or None.

    - ``device_type``: the torch device type ("cpu", "cuda"; ROCm GPUs are "cuda" too).
    - ``capability``: an NVIDIA GPU's compute capability.
    - ``gcn_arch``: a ROCm GPU's architecture (torch.cuda.get_device_properties().gcnArchName, such as
      "gfx942:sramecc+:xnack-"), None on NVIDIA.
    - ``compiled``: whether torch.compile covers the model.
    - ``torchao_present``: None to look it up.

    ``float8_refusal_here`` reads these from a torch device."""
    key = "quantize.linear.float8"
    if settings.recipe not in RECIPES:
        return f"{key}.recipe_name must be one of {', '.join(RECIPES)} (or unset: tensorwise), got {settings.recipe!r}"
    if settings.enable_fsdp_float8_all_gather and settings.recipe != "tensorwise":
        return (f"{key}.enable_fsdp_float8_all_gather needs the tensorwise recipe (one scale per weight is what FSDP "
                f"can all-gather in float8), got recipe_name {settings.recipe!r}")
    if settings.precompute_float8_dynamic_scale_for_fsdp and not settings.enable_fsdp_float8_all_gather:
        return (f"{key}.precompute_float8_dynamic_scale_for_fsdp precomputes the scales of float8 all-gather: it "
                f"needs {key}.enable_fsdp_float8_all_gather = true")
    if settings.emulate and compiled:
        return (f"{key}.emulate runs in eager mode only (torchtitan's rule): set compile.enable = false or drop "
                "\"model\" from compile.components")
    if not settings.emulate:
        hardware = _hardware_refusal(device_type, capability, gcn_arch)
        if hardware is not None:
            return hardware
    if not (torchao_installed() if torchao_present is None else torchao_present):
        return f"float8 training ({CONVERTER} in model.converters) needs torchao: {TORCHAO_INSTALL}"
    return None


def _hardware_refusal(device_type: str, capability: tuple[int, int] | None, gcn_arch: str | None) -> str | None:
    if device_type == "cpu":
        return ("float8 training needs a GPU with float8 matrix units (NVIDIA compute capability 8.9+, AMD MI300 or "
                f"MI350); on CPU only {CONVERTER}.emulate = true runs (float8 numerics in float32, for tests)")
    if device_type != "cuda":
        return f"float8 training runs on NVIDIA and AMD GPUs (device type cuda), not on {device_type}"
    if gcn_arch is not None:
        arch = gcn_arch.split(":")[0]
        if arch in ROCM_FLOAT8_ARCHS:
            return None
        return (f"this AMD GPU ({arch}) has no float8 matrix cores; float8 training needs "
                + ", ".join(f"{name} {a}" for a, name in ROCM_FLOAT8_ARCHS.items() if a in ("gfx942", "gfx950"))
                + " or RDNA4 (gfx1200/gfx1201)")
    if capability is None or tuple(capability) < (8, 9):
        found = f"sm_{capability[0]}{capability[1]}" if capability is not None else "of unknown compute capability"
        return (f"this NVIDIA GPU is {found}: float8 matrix products need compute capability 8.9 or newer "
                f"(Ada, Hopper, Blackwell); {CONVERTER}.emulate = true runs float8 numerics without them")
    return None


def float8_refusal_here(settings: Float8Settings, device: torch.device, *, compiled: bool) -> str | None:
    """``float8_refusal`` for a torch device of this process."""
    capability = gcn_arch = None
    if device.type == "cuda":
        if torch.version.hip:
            gcn_arch = torch.cuda.get_device_properties(device).gcnArchName
        else:
            capability = torch.cuda.get_device_capability(device)
    return float8_refusal(settings, device_type=device.type, capability=capability, gcn_arch=gcn_arch,
                          compiled=compiled)


def float8_warnings(settings: Float8Settings, *, compiled: bool, fsdp_sharded: bool) -> list[str]:
    """What runs, but not as fast or not as set, one line each: float8 in eager mode, and float8 all-gather without FSDP
    sharding, which is then off, as in torchtitan."""
    warnings = []
    if not compiled and not settings.emulate:
        warnings.append(f"float8 {settings.recipe} without torch.compile of the model: torchao's casts to float8 run "
                        "as separate eager kernels, which torchao and torchtitan expect to cost more than float8 "
                        "saves" + (" (rowwise especially)" if settings.recipe != "tensorwise" else "")
                        + "; set compile.enable = true with \"model\" in compile.components")
    if settings.enable_fsdp_float8_all_gather and not fsdp_sharded:
        warnings.append(f"{CONVERTER}.enable_fsdp_float8_all_gather is off for this run: FSDP does not shard the "
                        "weights (data-parallel shard degree 1)")
    return warnings
