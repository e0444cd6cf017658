"""Tuned kernel configurations: the choices Triton's autotuner makes for FLA's kernels and ours, kept as data.

    choice = kernel_configs.choose("shipped", device)   # KernelConfigError (one line): a bad or foreign folder
    kernel_configs.activate(choice)                     # before FLA is imported: its kernels then read the folder
    ...                                                  # the first step: no autotuning where the folder has a config
    kernel_configs.autotuned_here(choice)               # the kernels that autotuned anyway, for the log
    kernel_configs.save_choices(folder, gpu, recorded)  # what the autotuner chose in this process, into a folder

FLA autotunes each kernel the first time it meets a shape. For a new model on a new machine that takes minutes, in every
process of a run, and the processes may pick different configurations. A folder of recorded choices removes that. Every
rank reads the same folder, so every rank runs the same kernels. ``python -m hybridtitan.tune`` records a folder, and
the package ships them under ``hybridtitan/kernel_configs/<GPU>/``.

A folder is in FLA's own format (``fla.ops.utils.cache``), with one ``{kernel name}.json`` per kernel. Its
``autotune_entries`` are keyed by the md5 of the autotune key as Triton builds it: the key arguments' values, then the
dtypes of the tensor arguments. Each entry has its ``autotune_key`` and chosen ``config``, and the file has a
``default_config``. Beside them, hybridtitan writes ``record.json``. It names the GPU (name, and compute capability or
gfx architecture), the Triton, FLA and torch versions, and what was recorded.

A folder is used only on its own GPU with its own Triton and FLA versions, because the kernels' code and the compiler
decide which configurations are valid and fast. The torch version is recorded but not compared, because no FLA kernel or
configuration depends on it.

Activation uses FLA's own mechanism:

* ``FLA_CONFIG_DIR`` names the folder.
* ``FLA_CACHE_MODE=fuzzy`` takes the entry of the exact key, else the first recorded entry of the same key
  structure, whose numeric values may differ.
* ``configure_fla_cache_autotune()`` makes every ``triton.autotune`` defined afterwards FLA's CachedAutotuner.
  It autotunes only where nothing matches, or where the kernel's own pruning rejects the recorded configuration.

Importing any module of FLA imports all its kernels, because its package imports its layers. So FLA's cache module is
loaded first on its own, from its own file and under its own name. FLA's kernels then find it already imported."""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import gc
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch

from hybridtitan.errors import UserError

SHIPPED = Path(__file__).resolve().parent.parent / "kernel_configs"  # hybridtitan/kernel_configs/<GPU>/
RECORD = "record.json"
FORMAT = 1
SETTINGS = ("shipped", "autotune")  # or a folder's path
RECORD_COMMAND = "python -m hybridtitan.tune --job.config_file RECIPE --output FOLDER"


class KernelConfigError(UserError):
    """A kernel-configuration folder that cannot be used: missing, malformed, or of another GPU or versions."""


def gpu_dir_name(name: str) -> str:
    """A GPU's name as a folder name, spelled as FLA spells it (fla.ops.utils.cache.sanitize_gpu_name). For example,
    "NVIDIA H200" becomes "NVIDIA_H200"."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu"


def this_gpu(device: torch.device) -> dict[str, str] | None:
    """The GPU of ``device`` as a record names it, or None on a CPU. It gives the name, the folder name, and the compute
    capability ("9.0") or, on ROCm, the gfx architecture ("gfx942")."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip:
        arch = str(getattr(props, "gcnArchName", "")).split(":")[0]
    else:
        arch = f"{props.major}.{props.minor}"
    return {"name": props.name, "dir": gpu_dir_name(props.name), "capability": arch}


def _version(*distributions: str) -> str | None:
    for name in distributions:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def these_versions() -> dict[str, str | None]:
    """The Triton and FLA versions a folder is compared with, and torch's version. They are read from the installed
    distributions. Nothing is imported, because importing FLA would define its kernels."""
    return {"triton": _version("triton", "pytorch-triton-rocm", "pytorch-triton"),
            "fla": _version("fla-core", "flash-linear-attention"), "torch": torch.__version__}


# ---- the folder


def key_hash(key) -> str:
    """The md5 FLA files an autotune key under (fla.ops.utils.cache.AutotuneKey.key_hash)."""
    return hashlib.md5(json.dumps(_plain(key), separators=(",", ":"), sort_keys=True).encode()).hexdigest()


def _plain(value):
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class Folder:
    """A checked folder of kernel configurations."""

    path: str
    record: dict[str, Any]
    kernels: dict[str, dict[str, Any]]  # kernel name -> its file's content

    def entries(self) -> int:
        return sum(len(k.get("autotune_entries") or {}) for k in self.kernels.values())


def _check_config(where: str, config) -> None:
    if not isinstance(config, dict) or not isinstance(config.get("kwargs"), dict):
        raise KernelConfigError(f"{where}: its config needs a 'kwargs' mapping")
    for name in ("num_warps", "num_stages"):
        if not isinstance(config.get(name), int) or isinstance(config.get(name), bool) or config[name] < 1:
            raise KernelConfigError(f"{where}: its config needs a positive integer '{name}'")


def read_folder(path: str) -> Folder:
    """The folder at ``path``, checked. It needs a record.json of this format, and every kernel file in FLA's format
    with each entry filed under its key's hash. KernelConfigError (one line) names the first problem."""
    folder = Path(path)
    if not folder.is_dir():
        raise KernelConfigError(f"{path}: no such folder of kernel configurations (record one: {RECORD_COMMAND})")
    record_path = folder / RECORD
    try:
        record = json.loads(record_path.read_text())
    except FileNotFoundError:
        raise KernelConfigError(f"{path}: not a folder of kernel configurations (no {RECORD}; record one: "
                                f"{RECORD_COMMAND})") from None
    except (OSError, ValueError) as e:
        raise KernelConfigError(f"{record_path}: unreadable ({e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("gpu"), dict) \
            or not isinstance(record.get("versions"), dict):
        raise KernelConfigError(f"{record_path}: not a record of format {FORMAT} (it needs 'format', 'gpu' and "
                                "'versions')")
    kernels = {}
    for file in sorted(folder.glob("*.json")):
        if file.name == RECORD:
            continue
        try:
            data = json.loads(file.read_text())
        except (OSError, ValueError) as e:
            raise KernelConfigError(f"{file}: unreadable ({e})") from None
        entries = data.get("autotune_entries") if isinstance(data, dict) else None
        if not isinstance(entries, dict):
            raise KernelConfigError(f"{file}: not in FLA's format (it needs an 'autotune_entries' mapping)")
        for h, entry in entries.items():
            where = f"{file} entry {h}"
            if not isinstance(entry, dict) or not isinstance(entry.get("autotune_key"), list):
                raise KernelConfigError(f"{where}: it needs an 'autotune_key' list")
            if key_hash(entry["autotune_key"]) != h:
                raise KernelConfigError(f"{where}: filed under another hash than its key's "
                                        f"({key_hash(entry['autotune_key'])}): FLA would never find it")
            _check_config(where, entry.get("config"))
        if data.get("default_config") is not None:
            _check_config(f"{file} default_config", data["default_config"])
        kernels[file.stem] = data
    return Folder(str(folder), record, kernels)


def foreign(record: dict[str, Any], gpu: dict[str, str] | None, versions: dict[str, str | None]) -> str | None:
    """Why the folder whose record is ``record`` is not for this GPU and these versions, or None if it is. Without a GPU
    (``gpu`` None) only the versions are compared."""
    r_gpu, r_versions = record["gpu"], record["versions"]
    if gpu is not None and (r_gpu.get("dir"), r_gpu.get("capability")) != (gpu["dir"], gpu["capability"]):
        return (f"recorded on {r_gpu.get('name')} (capability {r_gpu.get('capability')}), this is {gpu['name']} "
                f"(capability {gpu['capability']})")
    for name in ("triton", "fla"):
        if r_versions.get(name) != versions.get(name):
            return f"recorded with {name} {r_versions.get(name)}, this has {name} {versions.get(name)}"
    return None


@dataclasses.dataclass(frozen=True)
class Choice:
    """The configurations a run uses: a checked folder, or none (FLA autotunes). ``message`` is the log's line that says
    which."""

    setting: str
    folder: Folder | None
    message: str
    mode: str = "fuzzy"  # FLA_CACHE_MODE: fuzzy (a shape not recorded takes one of the same structure), or strict

    @property
    def path(self) -> str | None:
        return None if self.folder is None else self.folder.path


def choose(setting: str, device: torch.device) -> Choice:
    """The configurations that ``setting`` ("shipped", "autotune" or a folder) gives on ``device``.

    A folder named by its path must be well-formed and of this GPU and these versions; otherwise KernelConfigError is
    raised. "shipped" takes the package's folder for this GPU where its versions match. Otherwise it says that FLA
    autotunes."""
    versions = these_versions()
    if setting == "autotune":
        return Choice(setting, None, "kernel configurations: FLA autotunes each kernel at each new shape "
                                     "(training.kernel_configs = \"autotune\")")
    if setting == "shipped":
        gpu = this_gpu(device)
        if gpu is None:
            return Choice(setting, None, "kernel configurations: none (no GPU: no Triton kernel runs)")
        path = SHIPPED / gpu["dir"]
        if not (path / RECORD).exists():
            return Choice(setting, None, f"kernel configurations: none shipped for {gpu['name']}: FLA autotunes "
                                         f"each kernel at each new shape, in every process (record them once: "
                                         f"{RECORD_COMMAND}, then training.kernel_configs = FOLDER)")
        folder = read_folder(str(path))
        why = foreign(folder.record, gpu, versions)
        if why:
            return Choice(setting, None, f"kernel configurations: the shipped ones for {gpu['name']} do not apply "
                                         f"({why}): FLA autotunes each kernel at each new shape (record them "
                                         f"for these versions: {RECORD_COMMAND})")
        return Choice(setting, folder, f"kernel configurations: shipped for {gpu['name']} ({path}, "
                                       f"{folder.entries()} recorded shapes of {len(folder.kernels)} kernels)")
    folder = read_folder(setting)
    gpu = this_gpu(device)
    why = foreign(folder.record, gpu, versions)
    if why:
        raise KernelConfigError(f"training.kernel_configs {setting}: another machine's configurations ({why}); "
                                f"record this one's: {RECORD_COMMAND}")
    where = "" if gpu is not None else " (no GPU here: read and checked, not used)"
    return Choice(setting, folder, f"kernel configurations: {setting} ({folder.entries()} recorded shapes of "
                                   f"{len(folder.kernels)} kernels){where}")


# ---- activation


def _fla_cache_module():
    """FLA's fla.ops.utils.cache, loaded on its own from its file (see the module docstring)."""
    name = "fla.ops.utils.cache"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("flash-linear-attention is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / "utils" / "cache.py"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def activate(choice: Choice) -> None:
    """Makes FLA's kernels, and ours in hybridtitan.ops, read ``choice``'s folder, or autotune where it has none. It
    must run before FLA is imported. A process that has already imported FLA cannot be changed (RuntimeError)."""
    if choice.folder is None:
        # a user's FLA_CACHE_MODE or FLA_CONFIG_DIR must not choose for the recipe
        os.environ["FLA_CACHE_MODE"] = "disabled"
        os.environ.pop("FLA_CONFIG_DIR", None)
        return
    if any(m == "fla" or m.startswith("fla.") for m in sys.modules if m != "fla.ops.utils.cache"):
        raise RuntimeError("kernel configurations must be activated before FLA is imported: its kernels are "
                           "defined at its import")
    os.environ["FLA_CONFIG_DIR"] = os.path.abspath(choice.folder.path)
    os.environ["FLA_CACHE_MODE"] = choice.mode
    cache = _fla_cache_module()
    if cache.FLA_CACHE_MODE.value != choice.mode:
        raise RuntimeError("FLA's cache module was loaded before FLA_CACHE_MODE was set")
    cache.configure_fla_cache_autotune()


def use(setting: str, device: torch.device) -> Choice:
    """Runs ``choose`` and then, on a GPU, ``activate``. A command that runs kernels does this before it loads a model.
    Returns the choice, whose ``message`` the command prints."""
    choice = choose(setting, device)
    if device.type == "cuda":
        activate(choice)
    return choice


def autotuners() -> list:
    """Every Triton Autotuner of this process (FLA's kernels and ours), in a stable order."""
    from triton.runtime.autotuner import Autotuner

    # type(), not isinstance(): isinstance on a dead weakref.proxy among gc's objects raises ReferenceError
    found = [o for o in gc.get_objects() if issubclass(type(o), Autotuner)]
    return sorted(found, key=lambda a: (kernel_name(a), a.base_fn.__module__))


def kernel_name(autotuner) -> str:
    """The name FLA files an autotuner's configurations under: its @triton.jit function's name."""
    return getattr(autotuner, "kernel_name", None) or autotuner.base_fn.__name__


def _autotuned(autotuner) -> bool:
    return len(autotuner.configs) > 1  # Triton runs a lone config without tuning (nothing is kept in .cache)


def autotuned_here(choice: Choice) -> list[str]:
    """The "kernel (module)" of each kernel that Triton autotuned in this process. These are the kernels that met a
    shape ``choice``'s folder has no configuration for. Without a folder, every tuned kernel is listed."""
    tuned = []
    for a in autotuners():
        if not _autotuned(a) or not a.cache:
            continue
        if choice.folder is None:
            tuned.append(f"{kernel_name(a)} ({a.base_fn.__module__})")
            continue
        entries = (choice.folder.kernels.get(kernel_name(a)) or {}).get("autotune_entries") or {}
        keys = [e["autotune_key"] for e in entries.values()]
        if any(not any(_fuzzy_equal(_plain(k), recorded) for recorded in keys) for k in a.cache):
            tuned.append(f"{kernel_name(a)} ({a.base_fn.__module__})")
    return tuned


def _fuzzy_equal(a, b) -> bool:
    """FLA's fuzzy match: the same structure, numeric leaves free, every other leaf equal."""
    numeric = (int, float)
    if isinstance(a, numeric) and not isinstance(a, bool) and isinstance(b, numeric) and not isinstance(b, bool):
        return True
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_fuzzy_equal(x, y) for x, y in zip(a, b))
    return a == b


# ---- recording


def config_entry(config) -> dict[str, Any]:
    """A triton.Config as FLA's loader reads it back."""
    return {"kwargs": dict(config.kwargs), "num_warps": config.num_warps, "num_stages": config.num_stages,
            "num_ctas": getattr(config, "num_ctas", 1), "maxnreg": getattr(config, "maxnreg", None),
            "ir_override": getattr(config, "ir_override", None)}


def chosen_configs() -> dict[str, dict[str, dict[str, Any]]]:
    """What the autotuner chose in this process: kernel name -> key hash -> {autotune_key, config, module}."""
    chosen: dict[str, dict[str, dict[str, Any]]] = {}
    for a in autotuners():
        if not _autotuned(a):
            continue
        for key, config in a.cache.items():
            try:
                key_hash(key)
            except TypeError:  # a key argument JSON cannot hold: FLA could not look it up either
                continue
            chosen.setdefault(kernel_name(a), {})[key_hash(key)] = {
                "autotune_key": _plain(key), "config": config_entry(config), "module": a.base_fn.__module__}
    return chosen


def _default_config(entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The configuration chosen most often. FLA_CACHE_MODE=full falls back to it for a key of another shape."""
    counts: dict[str, tuple[int, dict]] = {}
    for entry in entries.values():
        text = json.dumps(entry["config"], sort_keys=True)
        counts[text] = (counts.get(text, (0, entry["config"]))[0] + 1, entry["config"])
    return max(counts.values(), key=lambda c: c[0])[1]


def save_choices(path: str, gpu: dict[str, str], recorded: dict[str, Any]) -> dict[str, int]:
    """Merges what the autotuner chose in this process into the folder ``path``, making it if missing.

    It writes one kernel file at a time, atomically, under a lock, because the processes of one recording may write at
    once. A key recorded again takes this run's choice. ``gpu`` is ``this_gpu``'s answer for the GPU that ran.
    ``recorded`` says what ran (a recipe, its overrides) and is appended to record.json. A folder of another GPU or
    other versions is refused (KernelConfigError). Returns kernel name -> its number of entries in the folder."""
    versions = these_versions()
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record_path = folder / RECORD
        if record_path.exists():
            record = read_folder(path).record
            why = foreign(record, gpu, versions)
            if why:
                raise KernelConfigError(f"{path}: another machine's configurations ({why}): record into a folder "
                                        "of its own")
        else:
            record = {"format": FORMAT, "gpu": gpu, "versions": versions, "recorded": []}
        written, chosen = {}, chosen_configs()
        for name, fresh in chosen.items():
            file = folder / f"{name}.json"
            old = json.loads(file.read_text()) if file.exists() else {}
            entries = {**(old.get("autotune_entries") or {}), **fresh}
            data = {"kernel_name": name, "triton_version": versions["triton"], "autotune_entries": entries,
                    "default_config": _default_config(entries)}
            _write_atomically(file, data)
            written[name] = len(entries)
        record["recorded"].append({**recorded, "date": datetime.date.today().isoformat(),
                                   "kernels": len(chosen), "entries": sum(len(e) for e in chosen.values())})
        record["versions"]["torch"] = versions["torch"]
        _write_atomically(record_path, record)
    return written


def _write_atomically(path: Path, data) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
