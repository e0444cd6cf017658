"""Reads a job configuration: a TOML recipe and the command line, into a JobConfig (hybridtitan.job_config).

The TOML recipe is the one source of truth. The command line can override any key as ``--section.key value``. Booleans
also take ``--section.flag`` and ``--section.no_flag``, and lists are comma-separated. Each value is checked against its
field's type, and every problem is one ``ConfigError`` line that names the key. torchtitan keys for features hybridtitan
does not implement (tensor, pipeline and expert parallelism, MX formats, ...) are refused when set, not silently
ignored.

This module does not use ``from __future__ import annotations``, because the type checks read real types."""

import dataclasses
import difflib
import importlib.util
import os
import sys
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Literal

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from hybridtitan.cli_help import choices_text, help_text, reference_markdown
from hybridtitan.data.config import Data, local_data_files, looks_local, resolve_path, validate_data_config
from hybridtitan.errors import ConfigError
from hybridtitan.job_config import TITAN_OPTIONS, TITAN_SECTIONS, JobConfig
from hybridtitan.models import ModelArgs, get_flavor
from hybridtitan.models.pattern import pattern_from_ratio

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
        return choices_text(typing.get_args(tp))
    if origin is list and typing.get_origin((typing.get_args(tp) or (Any,))[0]) is Literal:
        return f"a list of {_describe_type(typing.get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(t) for t in typing.get_args(tp))
    if tp is type(None):
        return "none"
    return getattr(tp, "__name__", str(tp))


def _check_toml(data: dict, cls, prefix: str = "") -> None:
    """Reports unknown sections and keys and wrong value types in the TOML, each with its full key. torchtitan options
    that hybridtitan does not implement are checked against their defaults (check_titan_option)."""
    known = _field_map(cls)
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in known:
            if _is_titan(full):
                _check_titan_toml(full, value)
                continue
            candidates = [*known, *(k[len(prefix):].split(".")[0] for k in TITAN_OPTIONS if k.startswith(prefix))]
            hint = difflib.get_close_matches(key, list(dict.fromkeys(candidates)), n=1)
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


def _is_titan(key: str) -> bool:
    """A torchtitan key or section hybridtitan does not implement (TITAN_OPTIONS)."""
    return key in TITAN_OPTIONS or any(k.startswith(key + ".") for k in TITAN_OPTIONS)


def _check_titan_toml(key: str, value: Any) -> None:
    if isinstance(value, dict) and key not in TITAN_OPTIONS:
        for name, inner in value.items():
            full = f"{key}.{name}"
            if not _is_titan(full):
                raise ConfigError(f"unknown key {full!r} in section [{key}]")
            _check_titan_toml(full, inner)
        return
    tp, _ = TITAN_OPTIONS[key]
    if not _type_ok(value, tp):
        raise ConfigError(f"{key} must be {_describe_type(tp)}, got {value!r}")
    if key == "job.custom_config_module" and value:
        raise ConfigError("job.custom_config_module is not used: hybridtitan's sections are built in")
    check_titan_option(key, value)


def check_titan_option(key: str, value: Any) -> None:
    """Checks a torchtitan option that hybridtitan does not implement. Its default is accepted and means nothing here.
    Any other value is refused in one line."""
    if value == TITAN_OPTIONS[key][1]:
        return
    section = key.split(".")[0]
    if section in TITAN_SECTIONS:
        raise ConfigError(f"[{section}] is a torchtitan section that hybridtitan does not support; remove it")
    raise ConfigError(f"{key} is a torchtitan option that hybridtitan does not support; remove it from the recipe")


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
    """Turns the TOML and the command line into a validated JobConfig. Raises ConfigError with one line on any problem.

    ``check_data=False`` skips the [data] checks, because describe needs no data. ``--help`` prints ``usage`` and the
    supported keys, then exits."""
    args = list(sys.argv[1:] if args is None else args)
    if "--help" in args or "-h" in args:
        print(help_text(usage, JobConfig))
        raise SystemExit(0)
    toml = _load_toml(args)
    overrides = parse_overrides(args)  # checked before the recipe's values are applied: all mistakes say the same
    cfg = JobConfig()
    if toml is not None:
        _check_toml(toml, JobConfig)
        _apply_toml(cfg, toml)
    for key, value in overrides:
        if key in TITAN_OPTIONS:
            check_titan_option(key, value)
            continue
        *sections, name = key.split(".")
        target = cfg
        for section in sections:
            target = getattr(target, section)
        _set(target, name, value)
    validate(cfg, check_data=check_data)
    return cfg


def config_reference() -> str:
    """The Markdown reference of every key (docs/config-reference.md)."""
    return reference_markdown(JobConfig)


def _apply_toml(target, data: dict) -> None:
    for key, value in data.items():
        if not hasattr(target, key):  # a torchtitan option at its default (_check_toml): nothing to apply
            continue
        if isinstance(value, dict) and is_dataclass(getattr(target, key)):
            _apply_toml(getattr(target, key), value)
        else:
            _set(target, key, value)


def _set(section, key: str, value) -> None:
    """Sets a key's value while the configuration is being read. The sections are frozen dataclasses, so a JobConfig is
    a value once parse_config returns it."""
    object.__setattr__(section, key, value)


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _titan_types() -> dict[str, Any]:
    return {key: tp for key, (tp, _) in TITAN_OPTIONS.items()}


def known_keys() -> dict[str, Any]:
    """Every key the command line takes ("section.name", "model.gdn.num_heads"), with its type."""
    return _all_keys(JobConfig)


def parse_overrides(args: list[str]) -> list[tuple[str, Any]]:
    """The command line's (key, typed value) pairs, in order.

    Every key is ``--section.key``, with its value after it or after '='. A boolean may also stand alone (true) or be
    given as ``--section.no_key`` (false). A list is comma-separated. Dashes in names read as underscores."""
    known = known_keys()
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            hint = ""
            option, value = (args[i - 3], args[i - 2]) if i >= 3 else ("", "")
            if os.path.exists(arg) and os.path.exists(value) and option.startswith("--"):
                # `--data.path data/shard_*` unquoted: the shell passed the files, the first as the value
                hint = (f" ({option} {value} {arg} ...: an unquoted glob the shell expanded into files? "
                        f"quote it: {option} 'PATTERN')")
            raise ConfigError(f"bad command-line value: Unrecognized options: {arg}{hint}")
        name, eq, value = arg[2:].partition("=")
        key = name.replace("-", "_")
        negated = False
        if key not in known:
            plain = key[3:] if key.startswith("no_") else key.replace(".no_", ".", 1)
            if plain != key and (known | _titan_types()).get(plain) in (bool, bool | None):
                key, negated = plain, True
            elif key not in TITAN_OPTIONS:
                hint = difflib.get_close_matches(key, [*known, *TITAN_OPTIONS], n=1)
                raise ConfigError(f"unknown option --{key}" + (f" (did you mean --{hint[0]}?)" if hint else ""))
        tp = known.get(key) or TITAN_OPTIONS[key][0]
        if negated:
            out.append((key, False))
            continue
        if not eq:
            follows = i < len(args) and not args[i].startswith("--")
            if follows and args[i].startswith("-") and "." not in args[i] and not _is_number(args[i]):
                # a value that begins with '-' (a pattern such as "-M-*") reads as an option
                raise ConfigError(f"--{key}: a value that begins with '-' reads as an option; give it as "
                                  f"--{key}={args[i]}")
            if tp in (bool, bool | None) and not follows:
                out.append((key, True))
                continue
            if not follows:
                raise ConfigError(f"--{key} needs a value" if key != "job.config_file" else
                                  "--job.config_file needs a path")
            value, i = args[i], i + 1
        out.append((key, _typed(key, value, tp)))
    return out


def _typed(key: str, text: str, tp: Any) -> Any:
    """``text`` as a value of ``tp``. Raises ConfigError in the user's words."""
    union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    optional = union and type(None) in typing.get_args(tp)
    inner = [t for t in typing.get_args(tp) if t is not type(None)] if union else [tp]
    if optional and text.lower() == "none":
        return None
    or_none = " (or None)" if optional else ""
    kind = inner[0] if len(inner) == 1 else float  # float | int: a number
    if kind is bool:
        if text.lower() not in _TRUE + _FALSE:
            raise ConfigError(f"--{key} must be true or false, got {text!r}")
        return text.lower() in _TRUE
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"--{key} must be an integer{or_none}, got {text!r}") from None
    if kind is float:
        try:
            return float(text)
        except ValueError:
            raise ConfigError(f"--{key} must be a number{or_none}, got {text!r}") from None
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if text not in choices:
            raise ConfigError(f"--{key} must be {choices_text(choices)}, got {text!r}")
        return text
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind) or (str,)
        items = [t for t in text.split(",") if t]
        if typing.get_origin(item) is Literal and not set(items) <= set(typing.get_args(item)):
            raise ConfigError(f"--{key} must be a comma-separated list of {choices_text(typing.get_args(item))}, "
                              f"got {text!r}")
        if item in (int, float):  # each item a number, said as the key's own: "--data.document_slice must be ..."
            try:
                return [item(t) for t in items]
            except ValueError:
                what = "integers" if item is int else "numbers"
                raise ConfigError(f"--{key} must be comma-separated {what}, got {text!r}") from None
        return [items] if typing.get_origin(item) is list else items
    return text


# ----------------------------------------------------------------------------------------------- validation


def validate(cfg: JobConfig, check_data: bool = True) -> None:
    """Runs the checks that need more than types. First each key's range (its field's rule, check_ranges), then the
    rules that tie several keys together, then the model arguments and the data."""
    check_ranges(cfg)
    if cfg.metrics.enable_wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("metrics.enable_wandb needs the wandb package: pip install wandb")
    _check_numbers(cfg)
    unknown = set(cfg.checkpoint.exclude_from_loading) - {"optimizer", "lr_scheduler", "dataloader", "train_state"}
    if unknown:
        raise ConfigError(f"checkpoint.exclude_from_loading: unknown part(s) {', '.join(sorted(unknown))}; allowed: "
                          "optimizer, lr_scheduler, dataloader, train_state")
    unknown = set(cfg.model.converters) - {"quantize.linear.float8"}
    if unknown:
        raise ConfigError(f"model.converters: unknown converter(s) {', '.join(sorted(unknown))}; hybridtitan has "
                          "quantize.linear.float8 (float8 training of the linear layers)")
    context_parallel_layout(cfg)
    option = cfg.activation_checkpoint.selective_ac_option
    if cfg.activation_checkpoint.mode == "selective" and not (option.isdigit() and int(option) >= 1):
        raise ConfigError("activation_checkpoint.selective_ac_option must be an integer N >= 1 (checkpoint every "
                          f"N-th sublayer), got {option!r}")
    v = cfg.validation
    d = cfg.distill
    if d.teacher and not any((d.kl_weight, d.ce_weight, d.layer_weight)):
        raise ConfigError("distill: kl_weight, ce_weight and layer_weight are all 0: nothing would be learned")
    if cfg.dpo.path:
        check_dpo(cfg, check_data)
    try:
        if check_data and not cfg.dpo.path:
            validate_data_config(cfg.data)
            if v.data.tokenizer != Data().tokenizer:
                raise ConfigError("validation.data.tokenizer is not used: the held-out set is read with "
                                  "data.tokenizer")
            if v.enable:
                if v.data.source == "mock" and v.steps == -1:
                    raise ConfigError("validation.steps: mock data has no end; give a number of batches")
                if v.data.source != "mock" and not v.data.path:
                    raise ConfigError("validation.data.path: validation.enable needs a held-out set (a path, as "
                                      "data.path; scripts/prepare_data.py --validation writes one)")
                try:
                    validate_data_config(held_out_data(cfg))
                except ValueError as e:
                    raise ConfigError(f"validation.{e}") from None
        model_args(cfg)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_dpo(cfg: JobConfig, check_data: bool = True) -> None:
    """Checks a DPO recipe (one with [dpo] path). Its pairs are all it reads, and it runs one stage at a time. With
    ``check_data`` it also checks that its files exist."""
    d = cfg.dpo
    for refused, what in ((cfg.distill.teacher, "distill.teacher (distillation is another stage)"),
                          (cfg.data.path, "data.path (the pairs are dpo.path; [data] gives the tokenizer alone)"),
                          (cfg.validation.data.path, "validation.data.path (the held-out pairs are "
                                                     "dpo.validation_path)"),
                          (cfg.data.num_workers, "data.num_workers (the pairs are batched in the training process)"),
                          (cfg.data.document_boundaries, "data.document_boundaries (each row is one pair's sequence)"),
                          (cfg.training.eod_mask_loss, "training.eod_mask_loss (the responses' tokens alone count)")):
        if refused:
            raise ConfigError(f"dpo.path: a DPO run does not take {what}; unset it")
    if not cfg.data.tokenizer:
        raise ConfigError("data.tokenizer is required: the pairs are tokenized with it")
    if not check_data:
        return
    def local_files(path: str) -> bool:  # local files, not a folder (a hub dataset or a dataset folder is neither)
        return looks_local(path) and not os.path.isdir(resolve_path(path))

    for key, path in (("dpo.path", d.path), ("dpo.validation_path", d.validation_path)):
        if path and local_files(path) and not local_data_files(path):
            raise ConfigError(f"{key}: no such file or folder: {path}")
    if cfg.validation.enable and local_files(d.path) and not d.validation_path:
        raise ConfigError(f"dpo.validation_path: validation.enable needs held-out pairs, and the local files of "
                          f"dpo.path ({d.path}) are the training pairs: give other files")


def check_ranges(cfg: JobConfig) -> None:
    """Checks every key whose field in job_config carries a range rule (``ruled``). Raises ConfigError, in one line, for
    the first value outside its range, in the schema's order."""
    for section in fields(cfg):
        value = getattr(cfg, section.name)
        if not is_dataclass(value):
            continue
        for f in fields(value):
            rule, got = f.metadata.get("rule"), getattr(value, f.name)
            if rule and not rule[1](got):
                raise ConfigError(f"{section.name}.{f.name} must be {rule[0]}, got "
                                  f"{repr(got) if isinstance(got, str) else got}")


def _check_numbers(cfg: JobConfig) -> None:
    """Checks the profiler's counts when profiling is on. Otherwise a recipe may leave them at any value."""
    checks = []
    if cfg.profiling.enable_profiling:
        p = cfg.profiling
        checks += [("profiling.profiler_active", p.profiler_active, p.profiler_active >= 1, "1 or more"),
                   ("profiling.profiler_warmup", p.profiler_warmup, p.profiler_warmup >= 0, "0 or more"),
                   ("profiling.profile_freq", p.profile_freq, p.profile_freq >= 1, "1 or more")]
    for key, value, ok, wanted in checks:
        if not ok:
            raise ConfigError(f"{key} must be {wanted}, got {value}")


FROM_CHECKPOINT = "checkpoint"  # model.flavor: the model arguments saved with checkpoint.initial_load_path


def model_args(cfg: JobConfig) -> ModelArgs:
    """The model arguments of a recipe, validated, with the pattern parsed once.

    For a named flavor, they are the flavor's with the recipe's [model] keys applied. For flavor "checkpoint", they are
    the ones checkpoint.initial_load_path holds, and the keys given must agree with them."""
    m = cfg.model
    if m.flavor == FROM_CHECKPOINT:
        return _saved_model_args(cfg)
    base = get_flavor(m.flavor)
    changes = {name: getattr(m, name) for name in
               ("mixer", "attention", "n_layers", "dim", "ffn_dim", "vocab_size", "tie_embeddings", "norm_eps",
                "init_std", "hybrid_attention_ratio") if getattr(m, name) is not None}
    for sub in ("gdn", "kda", "mamba2", "mla", "gqa"):
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


def _saved_model_args(cfg: JobConfig) -> ModelArgs:
    """The model arguments of checkpoint.initial_load_path, with the recipe's [model] keys checked against them.

    They come from a step folder's model_args.json or a Hugging Face folder's config. A model of any shape then trains
    without its sizes copied into the recipe. A recipe that disagrees is refused, not silently overruled."""
    from hybridtitan.model_folder import read_folder

    path = cfg.checkpoint.initial_load_path
    if not path:
        raise ConfigError(f"model.flavor {FROM_CHECKPOINT!r} takes the model arguments saved with the checkpoint "
                          "the run starts from: give checkpoint.initial_load_path")
    try:
        held = read_folder(path)
    except Exception as e:  # noqa: BLE001 -- CheckpointError, ConversionError: one line
        raise ConfigError(f"model.flavor {FROM_CHECKPOINT!r}: checkpoint.initial_load_path: {e}") from None
    saved, m = held.args, cfg.model
    given = {name: getattr(m, name) for name in
             ("mixer", "attention", "n_layers", "dim", "ffn_dim", "vocab_size", "tie_embeddings", "norm_eps",
              "init_std", "pattern") if getattr(m, name) is not None}
    for sub in ("gdn", "kda", "mamba2", "mla", "gqa"):
        given.update({f"{sub}.{k}": v for k, v in dataclasses.asdict(getattr(m, sub)).items() if v is not None})
    for key, value in given.items():
        held_value = saved
        for part in key.split("."):
            held_value = getattr(held_value, part)
        if value != held_value:
            raise ConfigError(f"model.{key} = {value!r}, but {held.source} holds a model with {held_value!r}: "
                              f"leave it out (model.flavor {FROM_CHECKPOINT!r} takes the checkpoint's) or name a "
                              "flavor")
    if m.hybrid_attention_ratio is not None:
        raise ConfigError(f"model.hybrid_attention_ratio with model.flavor {FROM_CHECKPOINT!r}: the checkpoint's "
                          f"pattern is {saved.pattern}")
    return saved


# The mixer and attention sections' defaults are the 300M flavors' sizes (dim 1024). A sublayer kind that a flavor
# does not have (attention added by model.pattern, or another model.mixer) would silently get them at any width.
# Such a kind is refused unless some of its model.<section>.* keys are given.
DEFAULT_SIZES_DIM = 1024


def _refuse_default_sizes(m, base: ModelArgs, args: ModelArgs) -> None:
    new = []
    if "*" in args.pattern and ("*" not in base.pattern or args.attention != base.attention):
        new.append((args.attention, "attention" if args.attention == "mla" else f"{args.attention} attention"))
    if "M" in args.pattern and (args.mixer != base.mixer or "M" not in base.pattern):
        new.append((args.mixer, f"{args.mixer} mixers"))
    for section, what in new:
        sizes = getattr(args, section)
        given = any(v is not None for v in dataclasses.asdict(getattr(m, section)).values())
        if args.dim != DEFAULT_SIZES_DIM and sizes == type(sizes)() and not given:
            raise ConfigError(f"model.flavor {m.flavor!r} has no {what}, so model.{section}.* would be the "
                              f"defaults, the 300M flavors' sizes for dim {DEFAULT_SIZES_DIM}, at dim {args.dim}: "
                              f"give them (e.g. --model.{section}.num_heads), or start from a flavor with {what}")


def held_out_data(cfg: JobConfig) -> Data:
    """The validation set's [data], with the training data's tokenizer."""
    return dataclasses.replace(cfg.validation.data, tokenizer=cfg.data.tokenizer)


# torchtitan's context_parallel_load_balancer values -> the layouts of hybridtitan.ops.context_parallel
LOAD_BALANCER_LAYOUTS = {"headtail": "zigzag", None: "contiguous", "none": "contiguous"}


def context_parallel_layout(cfg: JobConfig) -> str:
    """The layout of a context-parallel sequence, from parallelism.context_parallel_load_balancer.

    "headtail" gives "zigzag": rank r holds chunks r and 2W - 1 - r. None (TOML: "none") gives "contiguous". Any other
    value raises ConfigError."""
    balancer = cfg.parallelism.context_parallel_load_balancer
    key = balancer.lower() if balancer in ("none", "None", "NONE") else balancer
    if key not in LOAD_BALANCER_LAYOUTS:
        raise ConfigError(f"parallelism.context_parallel_load_balancer must be headtail or none (contiguous "
                          f"slices), got {balancer!r}: hybridtitan's context parallelism has no other layout")
    return LOAD_BALANCER_LAYOUTS[key]


def selective_ac_interval(cfg: JobConfig) -> int:
    """Selective activation checkpointing wraps every N-th sublayer. Returns N, or 1 for the other modes."""
    if cfg.activation_checkpoint.mode != "selective":
        return 1
    return int(cfg.activation_checkpoint.selective_ac_option)


def compiles(cfg: JobConfig, component: str) -> bool:
    """Whether torch.compile covers ``component``. The components are "model" (each sublayer), "loss" (the cross-entropy
    chunks), "norm" (the RMSNorms with their residual adds) and "swiglu" (the MLPs' elementwise passes)."""
    return cfg.compile.enable and component in cfg.compile.components


def to_dict(cfg: JobConfig) -> dict:
    return dataclasses.asdict(cfg)
