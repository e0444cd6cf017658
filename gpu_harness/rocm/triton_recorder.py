"""Record every Triton kernel a piece of code compiles, as a manifest that can be compiled again for other GPUs.

    from triton_recorder import record_triton_kernels, save_manifest    # with gpu_harness/ on sys.path

    with record_triton_kernels() as rec:      # in a fresh process, around the first training step
        train_step()
    save_manifest("tests/assets/triton_kernels.json", rec.kernels)

A record names the ``@triton.jit`` function (module + qualified name, so it can be imported again) and holds what
``triton.compile`` needs to rebuild the same kernel: the signature (argument -> Triton type: ``*bf16``, ``i32``,
``fp32``, ``constexpr``), the constexpr values as launched (autotuned config kwargs and heuristics included), the
``attrs`` (divisibility-by-16 specialisations) and the options (num_warps, num_stages, num_ctas, maxnreg).
``gpu_harness/rocm/rocm_compile_check.py`` compiles every record for gfx942, gfx950 and sm_90 on a CPU machine.

How: Triton's official ``knobs.runtime.jit_post_compile_hook``. ``JITFunction.run`` calls it right after it
compiled a kernel (an in-memory cache miss; a hit in Triton's on-disk cache still counts as a compile here), with
exactly the (signature, constexprs, attrs, options) it passed to ``triton.compile``. The hook returns nothing
Triton looks at, adds nothing to a launch that is already compiled, and changes no kernel choice or numerics. The
alternatives are worse: ``jit_cache_hook`` can veto a compile (its return value matters), ``launch_enter_hook``
runs on every launch and only sees the compiled binary, and wrapping ``JITFunction.run`` is a monkeypatch.

Consequences:
- Enter the recorder before the first launch, in a fresh process: a kernel compiled earlier in the process is
  never compiled again, so it is not seen.
- The autotuner compiles every config it benchmarks. At exit each record of an autotuned kernel is marked
  ``chosen`` (a config the autotuner picked, read back from ``Autotuner.cache``) or ``candidate`` (benchmarked
  only); candidates are dropped unless ``keep_candidates=True``.
- Only ``@triton.jit`` functions launched through ``JITFunction.run`` are seen (FLA's and ours). torch.compile
  (Inductor) compiles the kernels it generates, and any user Triton kernel it traces, itself: record with
  torch.compile off (the FLA kernels and their configs are the same).

``record_triton_kernels(dry_run=GPUTarget(...))`` is the CPU twin used by the tests and to write a provisional
manifest: Triton's driver is replaced (``triton.runtime.driver.set_active``) by one that only reports a target,
and ``jit_cache_hook`` records each launch and tells Triton to skip it, so the Python side of a launch (binding,
specialisation, heuristics, autotuning over every config) runs on CPU tensors while no kernel is compiled or
run. Outputs are left unwritten: a dry run is for recording, in a process that computes nothing else. For FLA
to take its AMD branches too, call ``emulate_target_process("gfx942")`` before FLA is imported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

MANIFEST_FORMAT = 1

# Per-block resources of the targets the check knows, as Triton's loader checks them before a launch
# (CompiledKernel._init_handles): LDS / shared memory per block, threads per block, SMs / CUs.
TARGETS = {
    "gfx942": dict(target=GPUTarget("hip", "gfx942", 64), max_shared_mem=64 * 1024, max_threads=1024,
                   multiprocessor_count=304, device="AMD Instinct MI300X"),
    "gfx950": dict(target=GPUTarget("hip", "gfx950", 64), max_shared_mem=160 * 1024, max_threads=1024,
                   multiprocessor_count=256, device="AMD Instinct MI355X"),
    "sm_90": dict(target=GPUTarget("cuda", 90, 32), max_shared_mem=232448, max_threads=1024,
                  multiprocessor_count=132, device="NVIDIA H200"),
}


def target_info(name: str) -> dict:
    """``TARGETS[name]``; also accepts ``sm90`` / ``90`` for the NVIDIA control."""
    key = {"sm90": "sm_90", "90": "sm_90"}.get(name, name)
    if key not in TARGETS:
        raise KeyError(f"unknown target {name!r}; known: {', '.join(TARGETS)}")
    return TARGETS[key]


# --------------------------------------------------------------------------------------------- value encoding
# Constexpr values are Python scalars, strings, None, tuples, triton dtypes or JIT functions (e.g. an activation
# passed as a constexpr). JSON holds the scalars as they are and the rest as one-key objects.

def encode_value(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"float": repr(value)}
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v) for v in value]}
    if isinstance(value, triton.language.dtype):
        return {"dtype": str(value)}
    if isinstance(value, triton.language.constexpr):
        return {"constexpr": encode_value(value.value)}
    if isinstance(value, JITFunction):
        return {"jit_function": f"{value.module}:{value.fn.__qualname__}"}
    raise TypeError(f"cannot record a constexpr of type {type(value).__name__}: {value!r}")


def decode_value(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    (kind, inner), = value.items()
    if kind == "float":
        return float(inner)
    if kind == "tuple":
        return tuple(decode_value(v) for v in inner)
    if kind == "dtype":
        return triton.language.dtype(inner)
    if kind == "constexpr":
        return triton.language.constexpr(decode_value(inner))
    if kind == "jit_function":
        module, name = inner.split(":")
        return resolve_kernel(module, name)
    raise ValueError(f"unknown encoded value {value!r}")


# A path into the arguments: (i,) is argument i, (i, j) element j of a tuple argument. The manifest writes
# "name" and "name[j]" so it reads like the kernel's parameter list.

def path_to_str(path: tuple, arg_names: list[str]) -> str:
    return arg_names[path[0]] + "".join(f"[{i}]" for i in path[1:])


def str_to_path(text: str, arg_names: list[str]) -> tuple:
    name, *rest = re.split(r"\[", text)
    return (arg_names.index(name), *(int(r.rstrip("]")) for r in rest))


def _untuple(sig: Any) -> Any:
    return tuple(_untuple(s) for s in sig) if isinstance(sig, list) else sig


# --------------------------------------------------------------------------------------------- kernel lookup

def resolve_kernel(module: str, name: str) -> JITFunction:
    """The ``JITFunction`` ``module:name`` (importing the module), under its autotune / heuristics wrappers."""
    mod = importlib.import_module(module)
    registry = getattr(triton.runtime.jit, "_triton_jit_function_registry", {})  # every JITFunction, by name
    fn = registry.get(f"{module}:{name}")
    if fn is None and "<locals>" not in name:
        obj = mod
        for part in name.split("."):
            obj = getattr(obj, part, None)
        while isinstance(obj, (Autotuner, Heuristics)):
            obj = obj.fn
        fn = obj if isinstance(obj, JITFunction) else None
    if fn is None:
        raise LookupError(f"no @triton.jit function {module}:{name} (not importable: defined in a function?)")
    return fn


def kernel_wrappers(fn: JITFunction) -> list:
    """The launch wrappers around ``fn`` (outermost first: Autotuner, Heuristics, ...), found among its module's
    globals; [] when ``fn`` is launched bare."""
    module = sys.modules.get(fn.module)
    best: list = []
    for obj in vars(module).values() if module else ():
        chain = []
        while isinstance(obj, (Autotuner, Heuristics)):
            chain.append(obj)
            obj = obj.fn
        if obj is fn and len(chain) > len(best):
            best = chain
    return best


def find_autotuner(fn: JITFunction) -> Autotuner | None:
    return next((w for w in kernel_wrappers(fn) if isinstance(w, Autotuner)), None)


# --------------------------------------------------------------------------------------------- recording

_OPTION_KEYS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
                "ir_override", "debug")


def _options(full: dict) -> dict:
    options = {k: full[k] for k in _OPTION_KEYS if k in full}
    for key in ("maxnreg", "ir_override"):
        if options.get(key) is None:
            options.pop(key, None)
    for key in ("launch_cooperative_grid", "debug"):
        if not options.get(key):
            options.pop(key, None)
    return options


def record_id(record: dict) -> str:
    body = {k: record[k] for k in ("module", "name", "signature", "constexprs", "attrs", "options")}
    return hashlib.sha1(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]


def make_record(fn: JITFunction, signature: dict, constants: dict, attrs: dict, options: dict,
                target: GPUTarget) -> dict:
    """One manifest record, from what ``JITFunction.run`` hands ``triton.compile``."""
    names = fn.arg_names
    record = {
        "kernel": f"{fn.module}:{fn.fn.__qualname__}",
        "module": fn.module,
        "name": fn.fn.__qualname__,
        "signature": {k: list(v) if isinstance(v, tuple) else v for k, v in signature.items()},
        "constexprs": {path_to_str(p, names): encode_value(v) for p, v in sorted(constants.items())},
        "attrs": {path_to_str(p, names): [list(a) for a in v] for p, v in sorted(attrs.items()) if v},
        "options": options,
        "recorded_target": {"backend": target.backend, "arch": target.arch, "warp_size": target.warp_size},
    }
    record["id"] = record_id(record)
    return record


class Recording:
    """What ``record_triton_kernels`` saw. ``kernels`` is final after the ``with`` block."""

    def __init__(self, keep_candidates: bool):
        self.keep_candidates = keep_candidates
        self.kernels: list[dict] = []
        self.skipped: list[str] = []  # compiles seen but not recordable (one line each)
        self._seen: dict[str, tuple[dict, JITFunction]] = {}

    # The hook's keyword arguments are those of JITFunction._call_hook (triton/runtime/jit.py).
    def hook(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled, **_) -> None:
        jit_fn = getattr(fn, "jit_function", None)
        if not isinstance(jit_fn, JITFunction) or not isinstance(compile, dict):
            self.skipped.append(f"{getattr(fn, '__name__', fn)!s}: not a JITFunction launch (Inductor?)")
            return
        try:
            data = json.loads(compile["specialization_data"])  # Triton's own serialisation of this compile
            target = GPUTarget(**data["target"])
            attrs = compile["configs"][0] if compile.get("configs") else {}
            record = make_record(jit_fn, compile["signature"], compile["constants"], attrs,
                                 _options(data["options"]), target)
        except Exception as e:  # never break the run being recorded
            self.skipped.append(f"{jit_fn.module}:{jit_fn.fn.__qualname__}: {type(e).__name__}: {e}")
            return
        self._seen.setdefault(record["id"], (record, jit_fn))

    def finish(self) -> None:
        kernels = []
        for record, jit_fn in self._seen.values():
            record = dict(record)
            try:
                record["autotune"] = _autotune_role(record, jit_fn)
            except Exception as e:  # keep the record: the check then compiles it as if it were not autotuned
                record["autotune"] = None
                self.skipped.append(f"{record['kernel']}: autotune role unknown: {type(e).__name__}: {e}")
            if record["autotune"] and record["autotune"]["role"] == "candidate" and not self.keep_candidates:
                continue
            kernels.append(record)
        self.kernels = sorted(kernels, key=lambda r: (r["kernel"], r["id"]))


def _config_matches(config, record: dict) -> bool:
    constexprs = record["constexprs"]
    options = record["options"]
    return (all(constexprs.get(k) == encode_value(v) for k, v in config.kwargs.items())
            and options.get("num_warps") == config.num_warps and options.get("num_stages") == config.num_stages
            and options.get("num_ctas", 1) == config.num_ctas
            and options.get("maxnreg") == getattr(config, "maxnreg", None))


def _autotune_role(record: dict, jit_fn: JITFunction) -> dict | None:
    tuner = find_autotuner(jit_fn)
    if tuner is None:
        return None
    keys = sorted({k for c in tuner.configs for k in c.kwargs})
    picked = list(tuner.cache.values()) if len(tuner.configs) > 1 else list(tuner.configs)
    chosen = any(_config_matches(c, record) for c in picked)
    return {"role": "chosen" if chosen else "candidate", "keys": keys, "num_configs": len(tuner.configs)}


@contextlib.contextmanager
def record_triton_kernels(*, keep_candidates: bool = False, dry_run: GPUTarget | str | None = None
                          ) -> Iterator[Recording]:
    """Record every Triton kernel compiled inside the block (see the module docstring).

    keep_candidates: also keep the autotune configs that were benchmarked but not picked.
    dry_run: a target (``GPUTarget`` or a ``TARGETS`` name); Triton launches inside the block are recorded as
        they would be compiled for it, and neither compiled nor run. For CPU processes (tests, a provisional
        manifest); it replaces Triton's active driver for the block.
    """
    recording = Recording(keep_candidates)
    with contextlib.ExitStack() as stack:
        if dry_run is None:
            previous = knobs.runtime.jit_post_compile_hook

            def post_compile_hook(**kwargs):
                recording.hook(**kwargs)
                if previous is not None:
                    return previous(**kwargs)

            knobs.runtime.jit_post_compile_hook = post_compile_hook
            stack.callback(setattr, knobs.runtime, "jit_post_compile_hook", previous)
        else:
            stack.enter_context(target_only_driver(dry_run))
            previous = knobs.runtime.jit_cache_hook

            def skip_hook(**kwargs):
                recording.hook(**kwargs)
                return True  # JITFunction.run: "do not compile, do not launch"

            knobs.runtime.jit_cache_hook = skip_hook
            stack.callback(setattr, knobs.runtime, "jit_cache_hook", previous)
            # FLA's autotuners keep results on disk (cache_results=True): keep a dry run's made-up timings apart.
            cache_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="triton-dry-run-"))
            stack.enter_context(knobs.cache.scope())
            knobs.cache.dir = cache_dir
        try:
            yield recording
        finally:
            recording.finish()


# --------------------------------------------------------------------------------------------- target-only driver

class _Utils:
    def __init__(self, info: dict):
        self.info = info

    def get_device_properties(self, device: int = 0) -> dict:
        info = self.info
        return {"max_shared_mem": info["max_shared_mem"], "multiprocessor_count": info["multiprocessor_count"],
                "max_num_regs": 65536, "warpSize": info["target"].warp_size, "sm_clock_rate": 0,
                "mem_clock_rate": 0, "mem_bus_width": 0}


class TargetOnlyDriver(DriverBase):
    """A Triton driver that has no device: it reports a target (and its per-block limits) so that code which
    asks Triton what it runs on (FLA's ``fla.utils``: IS_AMD, check_shared_mem, get_multiprocessor_count) sees
    that target, and benchmarks nothing (every config times the same, so an autotuner keeps its first)."""

    def __init__(self, target: GPUTarget | str):
        super().__init__()
        if isinstance(target, str):
            info = target_info(target)
        else:
            info = next((dict(v) for v in TARGETS.values() if v["target"] == target),
                        dict(target=target, max_shared_mem=64 * 1024, max_threads=1024, multiprocessor_count=1,
                             device=str(target)))
        self.info = info
        self.target = info["target"]
        self.utils = _Utils(info)

    @classmethod
    def is_active(cls) -> bool:
        return False

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("a target-only driver launches nothing")

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_current_device(self) -> int:
        return 0

    def set_current_device(self, device: int) -> None:
        pass

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_device_interface(self):
        import torch

        return torch.cuda

    def get_benchmarker(self):
        def benchmark(kernel_call, quantiles=None, **kwargs):
            kernel_call()
            return [1.0, 1.0, 1.0] if quantiles else 1.0

        return benchmark


@contextlib.contextmanager
def target_only_driver(target: GPUTarget | str) -> Iterator[TargetOnlyDriver]:
    """Make a ``TargetOnlyDriver`` Triton's active driver inside the block (``triton.runtime.driver.set_active``)."""
    drv = TargetOnlyDriver(target)
    config = triton.runtime.driver
    previous = config._active
    config.set_active(drv)
    try:
        yield drv
    finally:
        config._active = previous


def emulate_target_process(target: str) -> TargetOnlyDriver:
    """Make this GPU-less process look, to code that asks Triton and torch what it runs on, like a process with
    one ``target`` GPU: for the compile check's workers and for dry runs, never for training.

    Call it before FLA is imported: ``fla.utils`` reads the device once, at import (IS_AMD from Triton's active
    driver, the LDS size of every ``torch.cuda`` device for ``check_shared_mem``, the CU count), and module-level
    autotune lists and dot precisions follow. Triton's driver becomes a ``TargetOnlyDriver`` and, for the LDS
    size to be read, ``torch.cuda.device_count`` reports 1 in this process. AMD targets only: FLA reads an NVIDIA
    GPU's name and capability from ``torch.cuda`` itself, which a CPU build of torch cannot answer.
    """
    drv = TargetOnlyDriver(target)
    if drv.target.backend != "hip":
        raise ValueError(f"{target}: only AMD targets can be emulated (FLA asks torch.cuda about NVIDIA GPUs)")
    if "fla" in sys.modules:
        raise RuntimeError("emulate_target_process() must run before fla is imported")
    import torch

    triton.runtime.driver.set_active(drv)
    torch.cuda.device_count = lambda: 1
    return drv


# --------------------------------------------------------------------------------------------- manifest

def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _device_name() -> str:
    drv = triton.runtime.driver._active
    if isinstance(drv, TargetOnlyDriver):
        return f"none (dry run for {drv.info['device']})"
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name()
    except Exception:
        pass
    return "cpu"


def save_manifest(path: str | os.PathLike, records: list[dict], *, device: str | None = None, **extra) -> dict:
    """Write ``{"format", "triton", "fla", "torch", "device", ..., "kernels": records}`` as JSON; return it.
    Records are deduplicated by id (several recordings may be concatenated) and sorted."""
    unique = {r["id"]: r for r in reversed(records)}
    records = sorted(unique.values(), key=lambda r: (r["kernel"], r["id"]))
    manifest = {
        "format": MANIFEST_FORMAT,
        "triton": triton.__version__,
        "fla": _version("flash-linear-attention") or _version("fla-core"),
        "fla_core": _version("fla-core"),
        "torch": _version("torch"),
        "device": device or _device_name(),
        **extra,
        "kernels": records,
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


def load_manifest(path: str | os.PathLike) -> dict:
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: manifest format {manifest.get('format')!r}, expected {MANIFEST_FORMAT}")
    return manifest


# --------------------------------------------------------------------------------------------- rebuilding

@dataclasses.dataclass
class CompileArgs:
    fn: JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def source(self):
        from triton.compiler import ASTSource

        return ASTSource(self.fn, self.signature, self.constexprs, self.attrs)


def compile_args(record: dict, target: GPUTarget, *, amd_buffer_ops: bool | None = None) -> CompileArgs:
    """What to hand ``triton.compile`` to rebuild ``record`` for ``target``.

    Attributes are moved across vendors the way Triton's own binder would set them on the target: on AMD,
    Triton marks every tensor argument whose storage is under 2 GiB with ``tt.pointer_range = 32`` (buffer
    loads/stores, ``knobs.amd.use_buffer_ops``, on by default); a record from an NVIDIA GPU has no such
    attribute, so it is added to every pointer argument (the training tensors are far below 2 GiB), and it is
    removed for NVIDIA targets.
    """
    fn = resolve_kernel(record["module"], record["name"])
    names = fn.arg_names
    signature = {k: _untuple(v) for k, v in record["signature"].items()}
    constexprs = {str_to_path(k, names): decode_value(v) for k, v in record["constexprs"].items()}
    attrs = {str_to_path(k, names): [list(a) for a in v] for k, v in record["attrs"].items()}
    if amd_buffer_ops is None:
        amd_buffer_ops = bool(knobs.amd.use_buffer_ops)
    for path in list(attrs):
        attrs[path] = [a for a in attrs[path] if a[0] != "tt.pointer_range"]
    if target.backend == "hip" and amd_buffer_ops:
        for name, ty in signature.items():
            if isinstance(ty, str) and ty.startswith("*"):
                path = (names.index(name),)
                attrs.setdefault(path, []).append(["tt.pointer_range", 32])
    attrs = {p: a for p, a in attrs.items() if a}
    return CompileArgs(fn, signature, constexprs, attrs, dict(record["options"]))
