"""The job configuration: torchtitan 0.2.2's JobConfig with hybridtitan's sections merged in.

One source of truth: a TOML recipe, any key overridable on the command line as ``--section.key value``
(torchtitan's ConfigManager does the merging). torchtitan leaves value types unchecked and answers an unknown
command-line key with a page of help, so everything is validated here first, and every problem becomes one
``ConfigError`` line naming the key. torchtitan keys for features hybridtitan does not implement (tensor,
pipeline, context parallelism, float8, ...) are refused when set, rather than silently ignored.

(No ``from __future__ import annotations`` here: the dataclass field types must stay real types, tyro and the
type checks below read them.)
"""

import contextlib
import dataclasses
import difflib
import importlib.util
import io
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from torchtitan.config import ConfigManager
from torchtitan.config import JobConfig as TitanJobConfig

from hybridtitan.cli_help import OVERRIDES, help_text
from hybridtitan.data.config import Data, validate_data_config
from hybridtitan.models import GDNArgs, KDAArgs, Mamba2Args, MLAArgs, ModelArgs, get_flavor
from hybridtitan.models.pattern import pattern_from_ratio


class ConfigError(ValueError):
    """A bad recipe or override: reported as one line, exit code 2."""


def _overrides_of(cls, doc: str):
    """A dataclass with the fields of ``cls``, each optional (None: keep the flavor's value)."""
    hints = typing.get_type_hints(cls)
    made = dataclasses.make_dataclass(
        cls.__name__.replace("Args", "Overrides"),
        [(f.name, hints[f.name] | None, field(default=None)) for f in fields(cls)],
    )
    made.__doc__ = doc
    return made


GDNOverrides = _overrides_of(GDNArgs, "Gated DeltaNet sizes; unset keys keep the flavor's")
KDAOverrides = _overrides_of(KDAArgs, "Kimi Delta Attention sizes; unset keys keep the flavor's")
Mamba2Overrides = _overrides_of(Mamba2Args, "Mamba2 sizes; unset keys keep the flavor's")
MLAOverrides = _overrides_of(MLAArgs, "Multi-latent attention sizes and RoPE/YaRN; unset keys keep the flavor's")


@dataclass
class Model:
    name: str = "hybrid"
    """Model family (only 'hybrid')"""

    flavor: str = "debug_hybrid"
    """Named configuration (python -m hybridtitan.describe --list); the keys below override it"""

    pattern: str | None = None
    """Sublayer pattern: '*' MLA attention, 'M' mixer, '-' SwiGLU MLP, e.g. '*-M-M-M-*-M-M-M-*-M-M-M-'"""

    hybrid_attention_ratio: float | None = None
    """Without an explicit pattern: fraction of (mixer, MLP) pairs that become (attention, MLP) (Primus rule)"""

    mixer: str | None = None
    """The 'M' sublayer: gdn, kda or mamba2"""

    n_layers: int | None = None
    """Number of sublayers (the pattern's length)"""

    dim: int | None = None
    """Hidden size"""

    ffn_dim: int | None = None
    """SwiGLU hidden size"""

    vocab_size: int | None = None
    """Vocabulary size (at least the tokenizer's)"""

    tie_embeddings: bool | None = None
    """Share the embedding and the output layer"""

    norm_eps: float | None = None
    """RMSNorm epsilon"""

    init_std: float | None = None
    """Standard deviation of the normal initialisation"""

    gdn: GDNOverrides = field(default_factory=GDNOverrides)
    kda: KDAOverrides = field(default_factory=KDAOverrides)
    mamba2: Mamba2Overrides = field(default_factory=Mamba2Overrides)
    mla: MLAOverrides = field(default_factory=MLAOverrides)


@dataclass
class Training:
    expandable_segments: bool = True
    """GPU: the CUDA/HIP caching allocator uses expandable segments (less fragmentation); set by the trainer"""

    loss_chunk_size: int = 4096
    """Tokens per chunk of the fused linear cross-entropy (its extra memory is one chunk of logits)"""

    eod_mask_loss: bool = False
    """No loss where the input token is the end-of-document token (Megatron's eod_mask_loss: the first token of
    the next document is not predicted from the last one's EOD). The loss is the mean over the counted tokens of
    the whole global batch, however it is split into micro-batches and ranks"""

    cuda_graphs: bool = False
    """GPU: replay the recurrent mixers' FLA calls from CUDA graphs captured in the first step (whole sequences;
    packed documents run eagerly). Much less host time per step for more memory (each layer keeps its own
    inputs, outputs and input gradients): for small micro-batches, where the host's kernel launches set the pace"""


@dataclass
class Checkpoint:
    last_save_model_only: bool = False
    """Save only the model at the last step (smaller; the run cannot be extended from it). Off: the last
    checkpoint is a full one, like every other"""


@dataclass
class _Extension:
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    data: Data = field(default_factory=Data)


JobConfig = ConfigManager._merge_configs(TitanJobConfig, _Extension)

# torchtitan keys hybridtitan reads; every other torchtitan key must keep its default value.
SUPPORTED_TITAN_KEYS = {
    "job": {"config_file", "dump_folder", "description", "print_config"},
    "profiling": {"enable_profiling", "save_traces_folder", "profile_freq", "profiler_active", "profiler_warmup"},
    "metrics": {"log_freq", "enable_tensorboard", "save_tb_folder", "enable_wandb"},
    "model": {"name", "flavor"},
    "optimizer": {"name", "lr", "beta1", "beta2", "eps", "weight_decay", "implementation"},
    "lr_scheduler": {"warmup_steps", "total_steps", "decay_ratio", "decay_type", "min_lr_factor"},
    "training": {"local_batch_size", "global_batch_size", "seq_len", "max_norm", "steps", "mixed_precision_param",
                 "mixed_precision_reduce", "gc_freq"},
    "parallelism": {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward"},
    "checkpoint": {"enable", "folder", "interval", "initial_load_path", "initial_load_model_only", "keep_latest_k",
                   "load_step", "async_mode", "exclude_from_loading", "enable_first_step_checkpoint"},
    "activation_checkpoint": {"mode", "selective_ac_option"},
    "compile": {"enable", "components"},
    "comm": {"init_timeout_seconds"},
    "debug": {"seed", "deterministic"},
}


# ----------------------------------------------------------------------------------------------- parsing


def _field_map(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in fields(cls)}


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, t) for t in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if isinstance(tp, type):
        return isinstance(value, tp)
    return True


def _describe_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(t) for t in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _check_toml(data: dict, cls, prefix: str = "") -> None:
    """Unknown sections/keys and wrong value types in the TOML, each reported with its full key."""
    known = _field_map(cls)
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in known:
            hint = difflib.get_close_matches(key, list(known), n=1)
            where = f"section [{prefix[:-1]}]" if prefix else "the recipe"
            kind = "key" if prefix else "section"
            raise ConfigError(
                f"unknown {kind} {full!r} in {where}" + (f" (did you mean '{prefix}{hint[0]}'?)" if hint else "")
            )
        tp = hints[key]
        if is_dataclass(tp):
            if not isinstance(value, dict):
                raise ConfigError(f"{full} must be a section ([{full}]), got {value!r}")
            _check_toml(value, tp, prefix=f"{full}.")
        elif not _type_ok(value, tp):
            raise ConfigError(f"{full} must be {_describe_type(tp)}, got {value!r}")


def _all_keys(cls, prefix: str = "") -> dict[str, Any]:
    keys = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        if is_dataclass(tp):
            keys.update(_all_keys(tp, f"{prefix}{f.name}."))
        else:
            keys[f"{prefix}{f.name}"] = tp
    return keys


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _check_cli(args: list[str]) -> None:
    """Unknown command-line keys get one line instead of tyro's help page."""
    known = _all_keys(JobConfig)
    for i, arg in enumerate(args):
        option = args[i - 1] if i and args[i - 1].startswith("--") and "=" not in args[i - 1] else None
        if option and arg.startswith("-") and "." not in arg and arg not in ("-h", "--help") and not _is_number(arg):
            # a value that begins with '-' (a pattern such as "-M-*") reads as an option
            raise ConfigError(f"{option}: a value that begins with '-' reads as an option; give it as {option}={arg}")
        if not arg.startswith("--"):
            continue
        key = arg[2:].split("=", 1)[0].replace("-", "_")
        if key.startswith("no_"):  # tyro's --section.no_flag form
            key = key[3:]
        key = key.replace(".no_", ".")
        if key not in known:
            hint = difflib.get_close_matches(key, list(known), n=1)
            raise ConfigError(f"unknown option --{key}" + (f" (did you mean --{hint[0]}?)" if hint else ""))


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _normalize_bools(args: list[str]) -> list[str]:
    """``--section.flag true|false`` (and ``=false``) into the flag forms tyro expects, so that every key is
    overridable as ``--section.key value``; the bare ``--section.flag`` / ``--section.no_flag`` work as well."""
    kinds = _all_keys(JobConfig)
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        key = key.replace("-", "_")
        tp = kinds.get(key)
        if tp in (bool, bool | None):
            # the CLI has no positional arguments: a word after a flag is its value, right or wrong
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value, eq, i = args[i + 1], "=", i + 1
            if eq:
                v = value.lower()
                if v not in _TRUE + _FALSE + (("none",) if tp is not bool else ()):
                    raise ConfigError(f"--{key} must be true or false, got {value!r}")
                if tp is bool:
                    section, name = key.rsplit(".", 1)
                    out.append(f"--{key}" if v in _TRUE else f"--{section}.no_{name}")
                else:
                    out += [f"--{key}", "None" if v == "none" else str(v in _TRUE)]
                i += 1
                continue
        out.append(arg)
        i += 1
    return out


def _load_toml(args: list[str]) -> dict | None:
    path = None
    for i, arg in enumerate(args):
        if arg.startswith("--job.config_file=") or arg.startswith("--job.config-file="):
            path = arg.split("=", 1)[1]
        elif arg in ("--job.config_file", "--job.config-file"):
            if i + 1 >= len(args):
                raise ConfigError("--job.config_file needs a path")
            path = args[i + 1]
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ConfigError(f"job.config_file: no such file: {path}")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None


TRAIN_USAGE = """usage: python -m hybridtitan.train --job.config_file RECIPE.toml [--section.key VALUE ...]
       torchrun --nproc_per_node N -m hybridtitan.train --job.config_file RECIPE.toml [--section.key VALUE ...]"""


def parse_config(args: list[str] | None = None, check_data: bool = True, usage: str = TRAIN_USAGE):
    """TOML + command line -> a validated JobConfig. Raises ConfigError with one line on any problem.
    ``check_data=False`` skips the [data] checks (describe needs no data). ``--help`` prints ``usage`` and the
    supported keys, and exits."""
    args = list(sys.argv[1:] if args is None else args)
    if "--help" in args or "-h" in args:
        print(help_text(usage, JobConfig, TitanJobConfig, _Extension, SUPPORTED_TITAN_KEYS))
        raise SystemExit(0)
    toml = _load_toml(args)
    if toml is not None:
        _check_toml(toml, JobConfig)
        if toml.get("job", {}).get("custom_config_module"):
            raise ConfigError("job.custom_config_module is not used: hybridtitan's sections are built in")
    _check_cli(args)
    args = _normalize_bools(args)
    manager = _Manager(JobConfig)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            cfg = manager.parse_args(args)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise ConfigError(_tyro_error_line(captured.getvalue())) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    validate(cfg, check_data=check_data)
    return cfg


class _Manager(ConfigManager):
    """torchtitan's ConfigManager without its own checks, which concern torchtitan's models (a tokenizer at
    model.hf_assets_path): validate() below checks what hybridtitan uses."""

    def _validate_config(self) -> None:
        pass


def _tyro_error_line(text: str) -> str:
    """tyro prints a boxed error; keep its informative lines as one."""
    lines = []
    for raw in text.splitlines():
        line = raw.strip(" │╭╮╰╯─━┃┏┓┗┛-\u2502\u256d\u256e\u2570\u256f\u2500")
        if line and "--help" not in line and not line.startswith("For full helptext") and line not in (
                "Value error", "Invalid choice", "Unrecognized options", "Parsing error"):
            lines.append(line)
    if not lines:
        return "bad command-line arguments"
    text = " ".join(lines[:3]).split(" Argument helptext:")[0]
    # tyro spells keys with dashes (--lr-scheduler.decay-type): give them back as the user wrote them
    text = re.sub(r"--[a-z0-9_-]+(?:\.[a-z0-9_-]+)+", lambda m: m.group(0)[:2] + m.group(0)[2:].replace("-", "_"),
                  text)
    # tyro's wording for the common mistakes, in the words of the boolean check (_normalize_bools)
    choice = re.search(r"invalid choice '(.*)' for argument '(--[a-z0-9_.]+)'", text)
    if choice:
        allowed = OVERRIDES.get(choice.group(2)[2:], (None,))[0]  # where hybridtitan accepts fewer than tyro lists
        if allowed:
            return f"{choice.group(2)} must be {allowed}, got '{choice.group(1)}'"
    missing = re.search(r"Missing value for argument '(--[a-z0-9_.]+)'", text)
    if missing:
        return f"{missing.group(1)} needs a value"
    unparsed = re.search(r"Error parsing (--[a-z0-9_.]+): (invalid literal for int\(\)|could not convert string to "
                         r"float).*?: (['\"].*['\"])", text)
    if unparsed:
        kind = "an integer" if unparsed.group(2).startswith("invalid literal") else "a number"
        return f"{unparsed.group(1)} must be {kind}, got {unparsed.group(3)}"
    # the same for a key that may also be unset (int | None, float | None)
    optional = re.search(r"Error parsing (--[a-z0-9_.]+): no type matching \{None\}\|(INT|FLOAT) could be "
                         r"instantiated from \[(.*)\]", text)
    if optional:
        kind = "an integer" if optional.group(2) == "INT" else "a number"
        return f"{optional.group(1)} must be {kind} (or None), got {optional.group(3)}"
    return "bad command-line value: " + text


# ----------------------------------------------------------------------------------------------- validation


def validate(cfg, check_data: bool = True) -> None:
    """Checks that need more than types: refused torchtitan features, positive sizes, the model arguments."""
    defaults = JobConfig()
    for section, supported in SUPPORTED_TITAN_KEYS.items():
        titan_section = getattr(TitanJobConfig(), section)
        ours = {f.name for f in fields(getattr(_Extension(), section))} if hasattr(_Extension(), section) else set()
        for f in fields(titan_section):
            if f.name in supported or f.name in ours:
                continue
            if getattr(getattr(cfg, section), f.name) != getattr(getattr(defaults, section), f.name):
                raise ConfigError(f"{section}.{f.name} is a torchtitan option that hybridtitan does not support; "
                                  "remove it from the recipe")
    for section in ("quantize", "memory_estimation", "fault_tolerance", "experimental", "validation"):
        if getattr(cfg, section) != getattr(defaults, section):
            raise ConfigError(f"[{section}] is a torchtitan section that hybridtitan does not support; remove it")

    t = cfg.training
    for name in ("steps", "seq_len", "local_batch_size", "loss_chunk_size"):
        if getattr(t, name) <= 0:
            raise ConfigError(f"training.{name} must be positive, got {getattr(t, name)}")
    if t.global_batch_size != -1 and t.global_batch_size <= 0:
        raise ConfigError(f"training.global_batch_size must be positive (or -1: local x data-parallel), "
                          f"got {t.global_batch_size}")
    if cfg.metrics.log_freq <= 0:
        raise ConfigError(f"metrics.log_freq must be positive, got {cfg.metrics.log_freq}")
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.enable_wandb needs the wandb package: pip install wandb")
    if cfg.checkpoint.interval <= 0:
        raise ConfigError(f"checkpoint.interval must be positive, got {cfg.checkpoint.interval}")
    if cfg.checkpoint.keep_latest_k < 0:
        raise ConfigError(f"checkpoint.keep_latest_k must be 0 (keep all) or more, got {cfg.checkpoint.keep_latest_k}")
    if cfg.optimizer.name not in ("AdamW", "Adam"):
        raise ConfigError(f"optimizer.name must be AdamW or Adam, got {cfg.optimizer.name!r}")
    _check_numbers(cfg)
    if cfg.checkpoint.async_mode not in ("disabled", "async"):
        raise ConfigError(f"checkpoint.async_mode must be disabled or async, got {cfg.checkpoint.async_mode!r}")
    unknown = set(cfg.checkpoint.exclude_from_loading) - {"optimizer", "lr_scheduler", "dataloader", "train_state"}
    if unknown:
        raise ConfigError(f"checkpoint.exclude_from_loading: unknown part(s) {', '.join(sorted(unknown))}; allowed: "
                          "optimizer, lr_scheduler, dataloader, train_state")
    if set(cfg.compile.components) - {"model", "loss", "norm", "swiglu"}:
        raise ConfigError("compile.components must name some of model, loss, norm and swiglu, got "
                          f"{cfg.compile.components}")
    if cfg.activation_checkpoint.mode not in ("none", "selective", "full"):
        raise ConfigError("activation_checkpoint.mode must be none, selective or full")
    option = cfg.activation_checkpoint.selective_ac_option
    if cfg.activation_checkpoint.mode == "selective" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError("activation_checkpoint.selective_ac_option must be an integer N >= 1 (checkpoint every "
                          f"N-th sublayer), got {option!r}")
    if cfg.model.name != "hybrid":
        raise ConfigError(f"model.name must be 'hybrid', got {cfg.model.name!r}")
    try:
        if check_data:
            validate_data_config(cfg.data)
        model_args(cfg)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _check_numbers(cfg) -> None:
    """Values that the optimizer, the schedule or the loop would take and then train wrongly with (a negative
    clipping norm ascends the gradient), or fail on only after the run's folders exist."""
    o, s, t = cfg.optimizer, cfg.lr_scheduler, cfg.training
    checks = [
        ("optimizer.lr", o.lr, math.isfinite(o.lr) and o.lr > 0, "a positive number"),
        ("optimizer.eps", o.eps, math.isfinite(o.eps) and o.eps > 0, "a positive number"),
        ("optimizer.beta1", o.beta1, 0 <= o.beta1 < 1, "in [0, 1)"),
        ("optimizer.beta2", o.beta2, 0 <= o.beta2 < 1, "in [0, 1)"),
        ("optimizer.weight_decay", o.weight_decay, math.isfinite(o.weight_decay) and o.weight_decay >= 0,
         "0 or more"),
        ("training.max_norm", t.max_norm, math.isfinite(t.max_norm) and t.max_norm > 0, "a positive number"),
        ("training.gc_freq", t.gc_freq, t.gc_freq >= 1, "1 or more"),
        ("lr_scheduler.warmup_steps", s.warmup_steps, s.warmup_steps >= 0, "0 or more"),
        ("lr_scheduler.min_lr_factor", s.min_lr_factor, 0 <= s.min_lr_factor <= 1, "in [0, 1]"),
        ("lr_scheduler.decay_ratio", s.decay_ratio, s.decay_ratio is None or 0 <= s.decay_ratio <= 1,
         "in [0, 1] (or unset)"),
        ("lr_scheduler.total_steps", s.total_steps, s.total_steps is None or s.total_steps >= 1,
         "1 or more (or unset)"),
        ("debug.seed", cfg.debug.seed, cfg.debug.seed is None or 0 <= cfg.debug.seed < 2**32,
         "in [0, 2**32) (or unset)"),
    ]
    if cfg.profiling.enable_profiling:
        p = cfg.profiling
        checks += [("profiling.profiler_active", p.profiler_active, p.profiler_active >= 1, "1 or more"),
                   ("profiling.profiler_warmup", p.profiler_warmup, p.profiler_warmup >= 0, "0 or more"),
                   ("profiling.profile_freq", p.profile_freq, p.profile_freq >= 1, "1 or more")]
    for key, value, ok, wanted in checks:
        if not ok:
            raise ConfigError(f"{key} must be {wanted}, got {value}")


def model_args(cfg) -> ModelArgs:
    """The flavor with the recipe's [model] keys applied, validated (pattern parsed once)."""
    m = cfg.model
    base = get_flavor(m.flavor)
    changes = {name: getattr(m, name) for name in
               ("mixer", "n_layers", "dim", "ffn_dim", "vocab_size", "tie_embeddings", "norm_eps", "init_std",
                "hybrid_attention_ratio") if getattr(m, name) is not None}
    for sub in ("gdn", "kda", "mamba2", "mla"):
        sub_over = {k: v for k, v in dataclasses.asdict(getattr(m, sub)).items() if v is not None}
        if sub_over:
            changes[sub] = dataclasses.replace(getattr(base, sub), **sub_over)
    if m.pattern is not None:
        if not m.pattern.strip():
            raise ConfigError("model.pattern is empty: give one symbol per sublayer ('*' attention, 'M' mixer, "
                              "'-' MLP), or leave it out for the flavor's")
        changes["pattern"] = m.pattern
        changes.setdefault("n_layers", len(m.pattern))
    elif "n_layers" in changes or "hybrid_attention_ratio" in changes:
        if base.pattern != pattern_from_ratio(base.n_layers, base.hybrid_attention_ratio):
            raise ConfigError(f"model.flavor {m.flavor!r} has a hand-written pattern ({base.pattern}) that "
                              "hybrid_attention_ratio does not give: to change its depth, give model.pattern")
        changes["pattern"] = ""  # rebuilt from the ratio
    args = dataclasses.replace(base, **changes)
    _refuse_default_sizes(m, base, args)
    return args


# The mixer and attention sections' defaults are the 300M flavors' sizes (dim 1024). A sublayer kind that a flavor
# does not have (attention added by model.pattern, or another model.mixer) would be built with them at any width,
# silently: refused unless some of its model.<section>.* keys are given.
DEFAULT_SIZES_DIM = 1024


def _refuse_default_sizes(m, base: ModelArgs, args: ModelArgs) -> None:
    new = []
    if "*" in args.pattern and "*" not in base.pattern:
        new.append(("mla", "attention"))
    if "M" in args.pattern and (args.mixer != base.mixer or "M" not in base.pattern):
        new.append((args.mixer, f"{args.mixer} mixers"))
    for section, what in new:
        sizes = getattr(args, section)
        given = any(v is not None for v in dataclasses.asdict(getattr(m, section)).values())
        if args.dim != DEFAULT_SIZES_DIM and sizes == type(sizes)() and not given:
            raise ConfigError(f"model.flavor {m.flavor!r} has no {what}, so model.{section}.* would be the "
                              f"defaults, the 300M flavors' sizes for dim {DEFAULT_SIZES_DIM}, at dim {args.dim}: "
                              f"give them (e.g. --model.{section}.num_heads), or start from a flavor with {what}")


def selective_ac_interval(cfg) -> int:
    """Selective activation checkpointing wraps every N-th sublayer; 1 for the other modes."""
    if cfg.activation_checkpoint.mode != "selective":
        return 1
    return int(cfg.activation_checkpoint.selective_ac_option)


def compiles(cfg, component: str) -> bool:
    """Whether torch.compile covers ``component`` ("model": each sublayer, "loss": the cross-entropy chunks,
    "norm": the RMSNorms with their residual adds, "swiglu": the MLPs' elementwise passes)."""
    return cfg.compile.enable and component in cfg.compile.components


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
