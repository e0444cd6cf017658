"""A Primus experiment YAML as a hybridtitan recipe.

    python -m hybridtitan.from_primus EXP.yaml [--output R.toml] [--primus PRIMUS_CHECKOUT]
    python -m hybridtitan.from_primus --key-tables       # docs/primus.md's key tables, from KEY_TABLE

The experiment is read the way Primus's loader reads it:

1. ``${VAR:default}`` is filled from the environment.
2. ``extends:`` is followed, relative to the file. Later presets win over earlier ones, and the file wins over
   its presets. ``bases:`` is not followed, because Primus does not follow it.
3. The trainer module is built. Its module config (``config:``, under primus/configs/modules/<framework>) comes
   first. The model preset (``model:``, under primus/configs/models/<framework>) adds the keys the module config
   does not set. The module's ``overrides:`` win over both.
4. Keys that no file sets take Megatron-LM's defaults (MEGATRON_DEFAULTS holds the ones the mapping reads).

Every key is then either mapped to a recipe key, as KEY_TABLE says, or listed on one line with the reason it is not. A
value hybridtitan cannot reproduce (LayerNorm, dropout, tensor parallelism) is named as a difference.

The recipe names a flavor where the sizes are one of hybridtitan.models.flavors'. Otherwise it spells out the pattern
and every size. Before it is written, the recipe is checked with hybridtitan.config_manager's own parser. It is also
compared with the shipped recipe whose header cites the same Primus file, if there is one.

Bad input (a missing file, a cycle of extends, YAML that is not a mapping, a model hybridtitan cannot build) gives one
line on stderr and exit code 2, and nothing is written."""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hybridtitan.cli import OneLineParser, fail, one_line_errors
from hybridtitan.errors import UserError

if TYPE_CHECKING:  # (the schema imports torch: a command that only reads recipes stays light)
    from hybridtitan.job_config import JobConfig

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------- the key table


@dataclass(frozen=True)
class Row:
    keys: tuple[str, ...]  # Primus/Megatron keys
    meaning: str
    target: str  # the hybridtitan key it becomes, or "—" and why not
    mapped: bool  # from_primus reads these keys into the recipe (else they are listed as not mapped, with target)


def _r(keys: str, meaning: str, target: str, mapped: bool = False) -> Row:
    return Row(tuple(k.strip() for k in keys.split(",")), meaning, target, mapped)


KEY_TABLE: dict[str, list[Row]] = {
    "Schedule and optimizer": [
        _r("lr", "peak learning rate", "`optimizer.lr`", True),
        _r("min_lr", "floor LR at and after the end of decay", "`lr_scheduler.min_lr_factor = min_lr / lr`", True),
        _r("lr_warmup_iters", "linear warm-up length in iterations (from `lr_warmup_init`)",
           "`lr_scheduler.warmup_steps` (Megatron reaches the peak one step later)", True),
        _r("lr_warmup_fraction", "warm-up as a fraction of `lr_decay_iters` (overrides iters if set)",
           "`warmup_steps = round(fraction · lr_decay_iters)`", True),
        _r("lr_warmup_init", "LR at the start of warm-up (0.0)", "— (torchtitan starts at lr/warmup); a difference "
           "if not 0", True),
        _r("lr_decay_style", "linear / cosine / constant / inverse-square-root / WSD",
           "`lr_scheduler.decay_type` (linear, cosine); constant: `decay_ratio = 0`; others a difference", True),
        _r("lr_decay_iters", "iteration at which decay ends (min_lr after), independent of `train_iters`",
           "`lr_scheduler.total_steps` (where it differs from `training.steps`)", True),
        _r("lr_decay_samples, lr_warmup_samples", "the same in samples", "divided by `global_batch_size`", True),
        _r("train_iters", "number of optimizer steps", "`training.steps`", True),
        _r("train_samples", "run length in samples instead", "`training.steps = train_samples / global_batch_size`",
           True),
        _r("weight_decay", "decoupled weight decay (not applied to biases / 1-D params)", "`optimizer.weight_decay`",
           True),
        _r("adam_beta1, adam_beta2", "Adam betas", "`optimizer.beta1` / `optimizer.beta2`", True),
        _r("adam_eps", "Adam epsilon", "`optimizer.eps`", True),
        _r("optimizer", "`adam` = Adam with decoupled weight decay (AdamW) in Megatron", "`optimizer.name = \"AdamW\"`",
           True),
        _r("clip_grad", "global L2 grad-norm clip", "`training.max_norm`", True),
    ],
    "Batch and data": [
        _r("micro_batch_size", "sequences per GPU per forward/backward", "`training.local_batch_size`", True),
        _r("global_batch_size", "sequences per optimizer step (all DP ranks × accumulation)",
           "`training.global_batch_size`", True),
        _r("seq_length", "training sequence length", "`training.seq_len`", True),
        _r("eod_mask_loss", "no loss where the input token is EOD",
           "`training.eod_mask_loss` (the label after each EOD is not counted)", True),
        _r("reset_position_ids, reset_attention_mask", "restart positions / attention at EOD",
           "≈ `data.document_boundaries` (cu_seqlens); false in all Primus configs", True),
        _r("create_attention_mask_in_dataloader", "build the dense causal mask in the dataloader", "—"),
        _r("tokenizer_model", "the tokenizer's HF id", "`data.tokenizer`; its vocabulary gives `model.vocab_size`",
           True),
        _r("tokenizer_type", "tokenizer class", "— (hybridtitan reads Hugging Face tokenizers)"),
        _r("mock_data", "synthetic data", "`data.source = \"mock\"`", True),
        _r("data_path, train_data_path", "Megatron .bin/.idx prefixes", "`data.source = \"megatron\"`, `data.path`",
           True),
        _r("valid_data_path, test_data_path, split", "held-out prefixes / a split of the training data",
           "— (`validation.data.path`: a held-out set of its own)"),
        _r("num_workers", "dataloader workers", "`data.num_workers`", True),
        _r("use_fla_data, fla_cache_dir", "Primus: read FLA's Arrow data in FLA's sampler order", "—"),
    ],
    "Precision and loss": [
        _r("bf16", "bf16 params/compute, fp32 main params and grads",
           "`training.mixed_precision_param = \"bfloat16\"`, `mixed_precision_reduce = \"float32\"`", True),
        _r("fp16", "fp16 params/compute with loss scaling", "— (a difference if true: hybridtitan trains in bf16 or "
           "fp32)", True),
        _r("calculate_per_token_loss", "normalise by the global token count instead of per micro-batch",
           "always true in hybridtitan: the mean over the counted tokens of the global batch; a difference if false",
           True),
        _r("fused_ce_mode, fused_ce_chunks", "Primus: FLA fused (linear) CE; mode 1/2 ignores the loss mask",
           "— (hybridtitan always uses its own chunked linear CE, `training.loss_chunk_size`)"),
    ],
    "Parallelism and memory": [
        _r("tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size, "
           "context_parallel_size", "TP / PP / EP / CP degrees (all 1 here)",
           "— (hybridtitan is FSDP/DP only); a difference if not 1", True),
        _r("sequence_parallel", "TP sequence parallelism", "—"),
        _r("use_distributed_optimizer", "ZeRO-1 (shard optimizer state)",
           "≈ FSDP, `parallelism.data_parallel_shard_degree = -1`"),
        _r("use_megatron_fsdp, data_parallel_sharding_strategy",
           "Megatron-FSDP: `optim_grads` = ZeRO-2, `optim_grads_params` = ZeRO-3",
           "FSDP2 (`data_parallel_shard_degree`, `fsdp_reshard_after_forward`)"),
        _r("use_torch_fsdp2", "torch FSDP2 path in Megatron (false here)", "—"),
        _r("overlap_grad_reduce, overlap_param_gather", "overlap DP comms with backward / forward",
           "— (FSDP prefetch)"),
        _r("ddp_average_in_collective", "divide grads inside the collective instead of pre-scaling", "—"),
        _r("gradient_accumulation_fusion", "fused wgrad accumulation kernel (off here)", "—"),
        _r("recompute_granularity", "activation recomputation (selective/full)",
           "`activation_checkpoint.mode` (\"none\"/\"selective\"/\"full\")", True),
        _r("recompute_method, recompute_num_layers, recompute_activations", "which layers recompute",
           "— (`activation_checkpoint.selective_ac_option`: every N-th sublayer)"),
        _r("empty_unused_memory_level, empty_cache_interval",
           "call `torch.cuda.empty_cache` (Primus: every N iterations)", "—"),
    ],
    "Run control, checkpoints and logging": [
        _r("seed", "RNG seed", "`debug.seed`", True),
        _r("check_for_nan_in_loss_and_grad", "NaN/Inf validation each step", "— (hybridtitan skips non-finite steps)"),
        _r("save", "checkpoint folder", "`checkpoint.enable` (where set) and `job.dump_folder`", True),
        _r("save_interval", "iterations between checkpoints", "`checkpoint.interval`", True),
        _r("load, finetune, no_load_optim, no_load_rng, auto_continue_train, disable_last_saving, ckpt_format",
           "what to load, and how checkpoints are written",
           "— (`checkpoint.initial_load_path`, `checkpoint.initial_load_model_only`; a Primus checkpoint is "
           "imported first)"),
        _r("log_interval", "iterations between log lines", "`metrics.log_freq`", True),
        _r("tensorboard_log_interval, tensorboard_dir, wandb_project, eval_iters, eval_interval",
           "logging / eval", "— (`metrics.enable_tensorboard`, `metrics.enable_wandb`, `[validation]`)"),
        _r("barrier_with_L1_time, log_avg_skip_iterations, log_avg_reset_interval, stderr_sink_level",
           "timing / log details", "—"),
        _r("enable_primus_turbo, use_turbo_attention", "Primus kernel library toggles (off)", "—"),
        _r("exp_name", "the experiment's name", "`job.dump_folder = ./outputs/<exp_name>` where `save` is not set",
           True),
        _r("work_group, user_name, workspace", "Primus's output folder layout", "— (`job.dump_folder`)"),
    ],
    "Model: stack and embeddings": [
        _r("init_method_std", "std of normal init; output projections use unscaled std via the Primus hybrid patch",
           "`model.init_std`", True),
        _r("spec", "module path + name of the layer-spec object (picks the mixer type and TE vs no-TE layers)",
           "`model.mixer` (gdn/kda/mamba2) and Mamba2's expand (SPECS)", True),
        _r("model_type", "`mamba` → `pretrain_mamba.py` / MambaModel", "—"),
        _r("num_layers", "number of sublayers (mixer + MLP + attention, each counted)", "`model.n_layers`", True),
        _r("hidden_size", "model width", "`model.dim`", True),
        _r("ffn_hidden_size", "MLP hidden size (SwiGLU: fc1 outputs 2×)", "`model.ffn_dim`", True),
        _r("swiglu", "SwiGLU MLP", "always in hybridtitan; a difference if false with MLP sublayers", True),
        _r("is_hybrid_model", "marks a HybridStack model: Primus's `allocate_layers` places the sublayers",
           "the pattern rule (`pattern_from_ratio`, else Megatron's all-mixer stack)", True),
        _r("hybrid_attention_ratio", "Primus-only: fraction of mixer slots that are MLA (`allocate_layers`)",
           "`model.hybrid_attention_ratio` (same rule, `pattern_from_ratio`)", True),
        _r("hybrid_mlp_ratio", "Megatron: fraction of MLP sublayers without an explicit pattern",
           "— (0: none; other values need `hybrid_override_pattern`)", True),
        _r("hybrid_override_pattern, hybrid_layer_pattern",
           "explicit pattern (`*` attention, `M` mixer, `-` MLP); the first a deprecated alias of the second",
           "`model.pattern`", True),
        _r("vocab_size, make_vocab_size_divisible_by", "vocab (from tokenizer) padded to a multiple of 128 × TP",
           "`model.vocab_size` (the tokenizer's, else `vocab_size`, padded)", True),
        _r("untie_embeddings_and_output_weights", "separate LM-head weight", "`model.tie_embeddings = not untie`",
           True),
        _r("max_position_embeddings", "max positions (learned-position table size; unused with "
           "`position_embedding_type: none`)", "—"),
        _r("position_embedding_type", "model-level position embedding (none here; MLA applies its own RoPE)",
           "— (none); a difference if `learned_absolute` or `rope`", True),
        _r("add_position_embedding, use_rotary_position_embeddings",
           "older switches of the model-level position embedding", "—"),
    ],
    "Model: normalization, dropout and biases": [
        _r("normalization", "LayerNorm or RMSNorm for all norm layers built from config",
           "— (hybridtitan is RMSNorm only); a difference if LayerNorm", True),
        _r("layernorm_epsilon", "norm epsilon Megatron actually uses", "`model.norm_eps`", True),
        _r("norm_epsilon", "**not a Megatron arg; ignored**", "—"),
        _r("hidden_dropout, attention_dropout", "dropout", "— (hybridtitan has none); a difference if not 0", True),
        _r("add_bias_linear, add_qkv_bias", "biases in linear layers",
           "— (hybridtitan has none, except KDA's g_proj output bias as in FLA); a difference if true", True),
        _r("no_persist_layer_norm, bias_swiglu_fusion, use_fla_fused_swiglu, use_fla_fused_rmsnorm, "
           "use_fla_fused_gated_norm, use_fla_short_conv, fla_mla_attn", "kernel choices", "— (`compile.components`)"),
    ],
    "Model: Mamba2": [
        _r("mamba_state_dim", "SSM state size N per group", "`model.mamba2.d_state`", True),
        _r("mamba_head_dim", "channels per Mamba head", "`model.mamba2.head_dim`", True),
        _r("mamba_num_groups", "B/C groups", "`model.mamba2.n_groups`", True),
        _r("mamba_num_heads", "explicit head count (null → d_inner/head_dim)", "derived; a difference if it "
           "disagrees", True),
        _r("mamba_expand", "not a Megatron arg; unused (expand comes from the spec)", "—"),
        _r("mamba_d_conv", "short-conv width (spec param `d_conv`)", "`model.mamba2.conv_size`", True),
    ],
    "Model: MLA and RoPE": [
        _r("multi_latent_attention", "use MLA for `*` layers", "— (always MLA); refused if false with `*` layers",
           True),
        _r("num_attention_heads", "MLA heads (unused for pure recurrent models)", "`model.mla.num_heads`", True),
        _r("q_lora_rank", "query latent rank", "`model.mla.q_lora_rank`", True),
        _r("kv_lora_rank", "KV latent rank", "`model.mla.kv_lora_rank`", True),
        _r("qk_head_dim", "non-RoPE q/k dim per head", "`model.mla.qk_nope_head_dim`", True),
        _r("qk_pos_emb_head_dim", "RoPE q/k dim per head", "`model.mla.qk_rope_head_dim`", True),
        _r("v_head_dim", "value dim per head", "`model.mla.v_head_dim`", True),
        _r("group_query_attention, num_query_groups", "GQA (off for MLA)", "—"),
        _r("rotary_base", "RoPE theta", "`model.mla.rope_theta`", True),
        _r("rotary_scaling_factor", "YaRN factor", "`model.mla.rope_scaling_factor`", True),
        _r("mscale, mscale_all_dim", "YaRN temperature terms (no effect at factor 1)",
           "`model.mla.mscale` / `model.mla.mscale_all_dim`", True),
        _r("original_max_position_embeddings",
           "YaRN original context (Primus-only key; read into MLATransformerConfig only if copied, not verified)",
           "`model.mla.original_max_position_embeddings`", True),
    ],
    "Model: GDN / KDA": [
        _r("linear_num_key_heads", "GDN/KDA q/k heads", "`model.gdn.num_heads` / `model.kda.num_heads`", True),
        _r("linear_num_value_heads", "GDN/KDA value heads (GDN: grouped; KDA: equal to key heads in FLA)",
           "`model.gdn.num_v_heads` (KDA: must equal num_heads; a difference if not)", True),
        _r("linear_key_head_dim", "key dim per head", "`model.gdn.head_dim` / `model.kda.head_dim`", True),
        _r("linear_value_head_dim", "value dim per head (KDA: also the gate rank)",
           "`model.gdn.head_v_dim` / `model.kda.head_v_dim`", True),
        _r("linear_conv_kernel_dim", "short-conv kernel", "`model.gdn.conv_size` / `model.kda.conv_size`", True),
        _r("use_short_conv", "Primus GDN short conv on/off (true)", "always on"),
        _r("use_fla_triton_kda, use_fla_kda_in_kernel_gate, use_fla_fused_norm_gated, use_fla_triton_kda_hybrid",
           "Primus KDA kernel paths", "—"),
    ],
}

ROWS: dict[str, Row] = {k: row for rows in KEY_TABLE.values() for row in rows for k in row.keys}
MAPPED = frozenset(k for k, row in ROWS.items() if row.mapped)

# Megatron-LM's defaults for the keys the mapping reads, used where no file of the experiment sets them. The
# recipes' headers and docs/primus.md state them. A preset that says `bases:` falls back to these.
MEGATRON_DEFAULTS = {
    "normalization": "LayerNorm", "layernorm_epsilon": 1e-5, "hidden_dropout": 0.1, "attention_dropout": 0.1,
    "add_bias_linear": True, "add_qkv_bias": False, "position_embedding_type": "learned_absolute",
    "untie_embeddings_and_output_weights": False, "init_method_std": 0.02, "swiglu": False,
    "is_hybrid_model": False, "hybrid_attention_ratio": 0.0, "hybrid_mlp_ratio": 0.0,
    "mamba_state_dim": 128, "mamba_head_dim": 64, "mamba_num_groups": 8, "mamba_d_conv": 4,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "multi_latent_attention": False, "q_lora_rank": None, "kv_lora_rank": 32, "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64, "v_head_dim": 128, "rotary_base": 10000, "rotary_scaling_factor": 1.0,
    "mscale": 1.0, "mscale_all_dim": 0.0, "make_vocab_size_divisible_by": 128, "tensor_model_parallel_size": 1,
    "optimizer": "adam", "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_eps": 1e-8, "weight_decay": 0.01,
    "clip_grad": 1.0, "lr_decay_style": "linear", "lr_warmup_iters": 0, "lr_warmup_init": 0.0, "min_lr": 0.0,
    "seed": 1234, "micro_batch_size": 1, "seq_length": None, "eod_mask_loss": False, "bf16": False, "fp16": False,
    "calculate_per_token_loss": False, "mock_data": False, "num_workers": 2, "log_interval": 100,
}

# The layer specs of Primus's hybrids (primus/backends/megatron/core/models/...). Each gives the mixer of its 'M'
# sublayers, Mamba2's expand, and what else of the spec a recipe does not reproduce. Expand is the spec's mixer
# parameter, or MambaMixer's default 2 where the spec sets none, and None for the other mixers.
SPECS = {
    "hybrid_stack_spec": ("mamba2", 1, ""),
    "mamba_hybrid_stack_spec_no_te": ("mamba2", 2, "Primus's no-TE Mamba hybrid spec has no norm before its Mamba "
                                      "sublayers; hybridtitan has an RMSNorm before every sublayer"),
    "mamba_stack_spec": ("mamba2", 2, ""),
    "gdn_hybrid_stack_spec": ("gdn", None, ""),
    "gdn_hybrid_stack_spec_no_te": ("gdn", None, ""),
    "kda_hybrid_stack_spec": ("kda", None, ""),
    "kda_hybrid_stack_spec_no_te": ("kda", None, ""),
}
# The TE specs whose MLA normalises each latent twice (hybridtitan.primus_checkpoint folds the two on import)
TWICE_NORMED_LATENTS = ("hybrid_stack_spec", "gdn_hybrid_stack_spec", "kda_hybrid_stack_spec")

# Vocabulary sizes of the tokenizers Primus's hybrid configurations name (Megatron pads the tokenizer's)
TOKENIZER_VOCAB = {"meta-llama/Llama-3.2-1B": 128256, "meta-llama/Llama-3.2-3B": 128256,
                   "meta-llama/Llama-3.1-8B": 128256, "fla-hub/gla-1.3B-100B": 32000,
                   "EleutherAI/gpt-neox-20b": 50277}

# ----------------------------------------------------------------------------------------------- reading YAML


class PrimusError(UserError):
    """An experiment YAML that cannot be read or turned into a recipe."""


_ENV = re.compile(r"\${([^:{}]+)(?::([^}]*))?}")


def _scalar(text: str):
    """Types a substituted string as Primus's loader does: true/false, an integer, a float, else the string."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    if re.fullmatch(r"-?(?:(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)", text):
        return float(text)
    return text


def _fill_env(value, path: str, env_used: list[str]):
    if isinstance(value, dict):
        return {k: _fill_env(v, path, env_used) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_env(v, path, env_used) for v in value]
    if not isinstance(value, str):
        return value

    def one(m):
        var, default = m.group(1), m.group(2)
        if var in os.environ:
            env_used.append(f"{var} (in {path})")
            return os.environ[var]
        if default is None:
            raise PrimusError(f"{path}: environment variable {var} is required (${{{var}}}) and not set")
        return default

    filled = _ENV.sub(one, value)
    return _scalar(filled) if filled != value else value


@dataclass
class Loaded:
    """A YAML file with its extends resolved. It holds the merged values, the file each top-level key came from, every
    file read, and the `bases:` lists met, which Primus does not follow."""

    values: dict
    origin: dict
    files: list
    bases: list


def _merge(base: Loaded, over: Loaded) -> Loaded:
    values, origin = dict(base.values), dict(base.origin)
    for key, value in over.values.items():
        if isinstance(values.get(key), dict) and isinstance(value, dict):
            values[key] = _deep_merge(values[key], value)
        else:
            values[key] = value
        origin[key] = over.origin[key]
    return Loaded(values, origin, base.files + [f for f in over.files if f not in base.files], base.bases + over.bases)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def load_yaml(path: str, env_used: list[str], chain: tuple[str, ...] = ()) -> Loaded:
    """One YAML file as Primus's loader reads it. Its extends (a list or one name, relative to the file) are merged
    under it, and ${VAR:default} is filled. Raises PrimusError for a missing file, a cycle, or a file that is not a
    mapping."""
    import yaml

    real = os.path.realpath(path)
    if real in chain:
        names = " -> ".join(os.path.basename(p) for p in (*chain[chain.index(real):], real))
        raise PrimusError(f"{path}: a cycle of extends: {names}")
    if not os.path.isfile(path):
        raise PrimusError(f"no such file: {path}" + (f" (extended by {chain[-1]})" if chain else ""))
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise PrimusError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise PrimusError(f"{path}: the file is {type(data).__name__ if data is not None else 'empty'}, "
                          "not a mapping of keys to values")
    data = _fill_env(data, path, env_used)
    own = Loaded({k: v for k, v in data.items() if k != "extends"}, {k: path for k in data if k != "extends"},
                 [path], [])
    if "bases" in data:
        own.bases.append((path, data["bases"]))
    extends = data.get("extends") or []
    if isinstance(extends, str):
        extends = [extends]
    if not isinstance(extends, list) or not all(isinstance(e, str) for e in extends):
        raise PrimusError(f"{path}: extends must name YAML files, got {extends!r}")
    merged = Loaded({}, {}, [], [])
    for name in extends:
        merged = _merge(merged, load_yaml(os.path.join(os.path.dirname(path), name), env_used, (*chain, real)))
    return _merge(merged, own)


def find_configs_root(experiment: str, primus: str | None) -> Path:
    """Primus's primus/configs folder. It is under --primus (a checkout, or the configs folder itself) where given.
    Otherwise it is the first folder above the experiment that holds primus/configs/models."""
    if primus:
        for candidate in (Path(primus) / "primus" / "configs", Path(primus)):
            if (candidate / "models").is_dir():
                return candidate
        raise PrimusError(f"--primus {primus}: no primus/configs/models there (give a Primus checkout)")
    for folder in Path(experiment).resolve().parents:
        if (folder / "primus" / "configs" / "models").is_dir():
            return folder / "primus" / "configs"
    raise PrimusError(f"{experiment}: no Primus checkout above it (primus/configs/models), where its model preset "
                      "is: give --primus PRIMUS_CHECKOUT")


def _preset(root: Path, kind: str, framework: str, name, field: str) -> Path:
    if not isinstance(name, str) or not name:
        raise PrimusError(f"modules: the trainer module's {field} must name a YAML file, got {name!r}")
    filename = name if name.endswith((".yaml", ".yml")) else f"{name}.yaml"
    path = root / kind / framework / filename
    if not path.is_file():
        what = "model preset" if kind == "models" else "module config"
        raise PrimusError(f"unknown {what} {name!r}: no {path}")
    return path


@dataclass
class Experiment:
    """A trainer module's effective values, each with the file it came from, or "Megatron's default"."""

    path: str
    values: dict
    origin: dict
    files: list
    bases: list
    env_used: list
    module: str
    model_file: str

    def get(self, key: str):
        if key in self.values:
            return self.values[key]
        return MEGATRON_DEFAULTS.get(key)

    def where(self, key: str) -> str:
        if key in self.origin:
            return os.path.basename(self.origin[key])
        return "Megatron's default" if key in MEGATRON_DEFAULTS else "unset"


def read_experiment(path: str, primus: str | None = None) -> Experiment:
    """The experiment's trainer module as Primus's parser builds it. The module config comes first, then the model
    preset's keys that the module config does not set, then the module's overrides."""
    env_used: list[str] = []
    exp = load_yaml(path, env_used)
    modules = exp.values.get("modules")
    if not isinstance(modules, dict) or not modules:
        raise PrimusError(f"{path}: no modules: (a Primus experiment names its trainer module under modules:)")
    trainers = [name for name in modules if "trainer" in name]
    if not trainers:
        raise PrimusError(f"{path}: modules: has no trainer module (pre_trainer), only {', '.join(modules)}")
    name = "pre_trainer" if "pre_trainer" in trainers else trainers[0]
    module = modules[name]
    if not isinstance(module, dict):
        raise PrimusError(f"{path}: modules.{name} is not a mapping")
    framework = module.get("framework")
    if framework != "megatron":
        raise PrimusError(f"{path}: modules.{name}.framework is {framework!r}; from_primus reads Megatron "
                          "experiments (framework: megatron)")
    root = find_configs_root(path, primus)
    config_file = _preset(root, "modules", framework, module.get("config"), "config")
    model_file = _preset(root, "models", framework, module.get("model"), "model")
    cfg = load_yaml(str(config_file), env_used)
    model = load_yaml(str(model_file), env_used)
    added = Loaded({k: v for k, v in model.values.items() if k not in cfg.values},
                   {k: o for k, o in model.origin.items() if k not in cfg.values}, model.files, model.bases)
    merged = _merge(cfg, added)
    overrides = module.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise PrimusError(f"{path}: modules.{name}.overrides is not a mapping")
    merged = _merge(merged, Loaded(overrides, {k: path for k in overrides}, [], []))
    values = {k: v for k, v in merged.values.items() if k != "bases"}
    origin = {k: o for k, o in merged.origin.items() if k != "bases"}
    # Primus keeps the experiment's own keys (its names, a platform) and the module's other keys (besides its
    # files and overrides) beside the module's values
    for key in exp.values:
        if key != "modules" and key not in values:
            values[key], origin[key] = exp.values[key], exp.origin[key]
    for key in module:
        if key not in ("framework", "config", "model", "overrides") and key not in values:
            values[key], origin[key] = module[key], path
    return Experiment(path, values, origin, exp.files + merged.files, exp.bases + merged.bases, env_used, name,
                      str(model_file))


# ----------------------------------------------------------------------------------------------- the mapping


class Mapping:
    """The recipe built from an Experiment: recipe values by section, comments, differences, and the keys read."""

    def __init__(self, exp: Experiment):
        self.exp = exp
        self.read: set[str] = set()
        self.recipe: dict[str, dict] = {}
        self.differences: list[str] = []
        self.notes: list[str] = []
        self.section_comments: dict[str, str] = {
            "optimizer": "implementation: hybridtitan's choice on GPUs (Megatron's Adam is fused too)"}

    def take(self, key: str):
        assert key in MAPPED, f"KEY_TABLE does not mark {key} as mapped"
        self.read.add(key)
        return self.exp.get(key)

    def given(self, key: str) -> bool:
        return key in self.exp.values and self.exp.values[key] is not None

    def put(self, key: str, value) -> None:
        section, _, name = key.rpartition(".")
        self.recipe.setdefault(section, {})[name] = value

    def differ(self, key: str, text: str) -> None:
        self.differences.append(f"{key} = {_show(self.exp.get(key))} ({self.exp.where(key)}): {text}")


def _show(value) -> str:
    text = repr(value) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."


def _pad(vocab: int, multiple: int) -> int:
    return int(math.ceil(vocab / multiple) * multiple)


def _round(x: float) -> float:
    return float(f"{x:.12g}")


def map_model(m: Mapping):
    """The model's arguments (hybridtitan.models.ModelArgs) from the Primus keys. Raises PrimusError where hybridtitan
    cannot build the model."""
    from hybridtitan.models import GDNArgs, KDAArgs, Mamba2Args, MLAArgs, ModelArgs
    from hybridtitan.models.pattern import pattern_from_ratio

    spec = m.take("spec")
    spec_name = spec[-1] if isinstance(spec, list) and spec else spec
    if spec_name not in SPECS:
        raise PrimusError(f"spec {spec!r}: an unknown layer spec; from_primus knows {', '.join(SPECS)}")
    mixer, expand, spec_note = SPECS[spec_name]
    if spec_note:
        m.differ("spec", spec_note)
    n_layers = m.take("num_layers")
    dim = m.take("hidden_size")
    if not isinstance(n_layers, int) or not isinstance(dim, int):
        raise PrimusError(f"num_layers and hidden_size must be integers, got {n_layers!r} and {dim!r}")
    pattern = None
    for key in ("hybrid_layer_pattern", "hybrid_override_pattern"):
        if m.given(key):
            pattern = m.take(key)
    ratio = m.take("hybrid_attention_ratio") or 0.0
    hybrid = m.take("is_hybrid_model")
    mlp_ratio = m.take("hybrid_mlp_ratio") or 0.0
    if pattern is None:
        if hybrid:
            try:
                pattern = pattern_from_ratio(n_layers, ratio)
            except ValueError as e:
                raise PrimusError(str(e)) from None
        elif ratio == 0 and mlp_ratio == 0:
            pattern = "M" * n_layers  # Megatron's MambaModel with no attention or MLP ratio: mixers only
        else:
            raise PrimusError(f"hybrid_attention_ratio {ratio} / hybrid_mlp_ratio {mlp_ratio} without "
                              "is_hybrid_model: Megatron's own placement is not reproduced; give "
                              "hybrid_override_pattern")
    if not isinstance(pattern, str) or set(pattern) - set("*M-"):
        raise PrimusError(f"pattern {pattern!r}: hybridtitan builds '*' (MLA), 'M' (mixer) and '-' (MLP) "
                          "sublayers only (no MoE 'E' or MTP '/')")
    if len(pattern) != n_layers:
        raise PrimusError(f"pattern {pattern!r} has {len(pattern)} sublayers, num_layers is {n_layers}")
    if spec_name in TWICE_NORMED_LATENTS and "*" in pattern:
        m.differ("spec", "its MLA normalises each latent twice (q_layernorm / kv_layernorm, then the norm fused into "
                 "linear_q_up_proj / linear_kv_up_proj); hybridtitan's MLA once")
    ffn = m.take("ffn_hidden_size") if "-" in pattern else None
    if "-" in pattern and not m.take("swiglu"):
        m.differ("swiglu", "Primus's MLPs are GELU; hybridtitan's are SwiGLU")
    tokenizer = m.take("tokenizer_model")
    if not isinstance(tokenizer, str) or not tokenizer:
        raise PrimusError("tokenizer_model is not set: hybridtitan reads a Hugging Face tokenizer by its name")
    multiple = (m.take("make_vocab_size_divisible_by") or 1) * (m.exp.get("tensor_model_parallel_size") or 1)
    vocab = TOKENIZER_VOCAB.get(tokenizer)
    if vocab is None and m.given("vocab_size"):
        vocab = m.take("vocab_size")
        m.notes.append(f"vocabulary: {vocab} (vocab_size), padded to a multiple of {multiple}; Megatron takes the "
                       f"tokenizer's size where its tokenizer type gives one")
    elif vocab is None:
        raise PrimusError(f"tokenizer_model {tokenizer!r}: its vocabulary size is not known offline and no "
                          "vocab_size is given; add vocab_size to the experiment's overrides")
    vocab = _pad(vocab, multiple)
    args = dict(vocab_size=vocab, dim=dim, n_layers=n_layers, ffn_dim=ffn or 4 * dim, pattern=pattern,
                hybrid_attention_ratio=ratio if hybrid else 0.0, mixer=mixer,
                tie_embeddings=not m.take("untie_embeddings_and_output_weights"),
                norm_eps=float(m.take("layernorm_epsilon")), init_std=float(m.take("init_method_std")))
    if m.take("normalization") != "RMSNorm":
        m.differ("normalization", "hybridtitan's norms are RMSNorm (eps layernorm_epsilon)")
    for key in ("hidden_dropout", "attention_dropout"):
        if m.take(key):
            m.differ(key, "hybridtitan has no dropout")
    for key in ("add_bias_linear", "add_qkv_bias"):
        if m.take(key):
            m.differ(key, "hybridtitan's linear layers have no biases (KDA's output gate aside, as FLA's)")
    if m.take("position_embedding_type") not in ("none", None):
        m.differ("position_embedding_type", "hybridtitan adds no position embedding to the stack (MLA has RoPE)")
    if "M" in pattern and mixer == "mamba2":
        d_state, head_dim = m.take("mamba_state_dim"), m.take("mamba_head_dim")
        groups, conv = m.take("mamba_num_groups"), m.take("mamba_d_conv")
        args["mamba2"] = Mamba2Args(d_state=d_state, head_dim=head_dim, n_groups=groups, expand=expand,
                                    conv_size=conv)
        heads = m.take("mamba_num_heads")
        if heads is not None and heads != dim * expand // head_dim:
            m.differ("mamba_num_heads", f"hybridtitan's Mamba2 has hidden_size x expand / mamba_head_dim = "
                     f"{dim * expand // head_dim} heads ({spec_name}: expand {expand})")
    elif "M" in pattern:
        k_heads, v_heads = m.take("linear_num_key_heads"), m.take("linear_num_value_heads")
        k_dim, v_dim = m.take("linear_key_head_dim"), m.take("linear_value_head_dim")
        conv = m.take("linear_conv_kernel_dim")
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim"):
            if key not in m.exp.values:
                m.notes.append(f"{key} = {m.exp.get(key)}: Megatron's default (no file of the experiment sets it)")
        if mixer == "gdn":
            args["gdn"] = GDNArgs(num_heads=k_heads, num_v_heads=v_heads, head_dim=k_dim, head_v_dim=v_dim,
                                  conv_size=conv)
        else:
            if v_heads != k_heads:
                m.differ("linear_num_value_heads", f"hybridtitan's KDA (as FLA's) has one value head per key head: "
                         f"{k_heads} heads of {k_dim} key and {v_dim} value channels")
            args["kda"] = KDAArgs(num_heads=k_heads, head_dim=k_dim, head_v_dim=v_dim, conv_size=conv)
    if "*" in pattern:
        if not m.take("multi_latent_attention"):
            raise PrimusError("the pattern has attention ('*') sublayers but multi_latent_attention is not true: "
                              "from_primus maps Primus's MLA hybrids")
        orig = m.take("original_max_position_embeddings")
        args["mla"] = MLAArgs(
            num_heads=m.take("num_attention_heads"), q_lora_rank=m.take("q_lora_rank") or 0,
            kv_lora_rank=m.take("kv_lora_rank"), qk_nope_head_dim=m.take("qk_head_dim"),
            qk_rope_head_dim=m.take("qk_pos_emb_head_dim"), v_head_dim=m.take("v_head_dim"),
            rope_theta=float(m.take("rotary_base")), rope_scaling_factor=float(m.take("rotary_scaling_factor")),
            mscale=float(m.take("mscale")), mscale_all_dim=float(m.take("mscale_all_dim")),
            **({"original_max_position_embeddings": orig} if orig is not None else {}))
    try:
        return ModelArgs(**args)
    except (TypeError, ValueError) as e:
        raise PrimusError(f"the model of {os.path.basename(m.exp.model_file)} cannot be built: {e}") from None


def _used_fields(args) -> dict:
    """The fields of ModelArgs that shape the model: the sizes of the sublayer kinds its pattern has."""
    d = dataclasses.asdict(args)
    kinds = set(args.pattern)
    keep = {k: d[k] for k in ("vocab_size", "dim", "n_layers", "pattern", "tie_embeddings", "norm_eps", "init_std")}
    if "-" in kinds:
        keep["ffn_dim"] = d["ffn_dim"]
    if "M" in kinds:
        keep["mixer"] = d["mixer"]
        keep[args.mixer] = d[args.mixer]
    if "*" in kinds:
        keep["attention"] = d["attention"]
        keep[args.attention] = d[args.attention]
    return keep


def match_flavor(args) -> str | None:
    """The flavor whose model this is, ignoring the vocabulary, norm epsilon and init std, which are written as
    overrides."""
    from hybridtitan.models import FLAVORS

    want = _used_fields(args)
    for name, flavor in FLAVORS.items():
        have = _used_fields(flavor)
        if all(have.get(k) == v for k, v in want.items() if k not in ("vocab_size", "norm_eps", "init_std")) \
                and set(have) == set(want):
            return name
    return None


def model_section(m: Mapping, args) -> None:
    from hybridtitan.models import get_flavor

    flavor = match_flavor(args)
    m.put("model.name", "hybrid")
    if flavor:
        base = get_flavor(flavor)
        m.put("model.flavor", flavor)
        m.put("model.init_std", args.init_std)
        for key in ("vocab_size", "norm_eps"):
            if getattr(args, key) != getattr(base, key):
                m.put(f"model.{key}", getattr(args, key))
        m.notes.append(f"model: flavor {flavor} (its pattern and sizes are the experiment's)")
        return
    m.notes.append("model: no flavor has these sizes: the pattern and every size are written out")
    m.section_comments["model"] = ("no flavor has these sizes: the flavor is only the base that the keys below "
                                   "replace, all of them")
    m.put("model.flavor", {"gdn": "gdn_300M", "kda": "kda_300M", "mamba2": "zebra_mamba2_300M"}[args.mixer])
    used = _used_fields(args)
    for key, value in used.items():
        if isinstance(value, dict):
            for name, inner in value.items():
                m.put(f"model.{key}.{name}", inner)
        else:
            m.put(f"model.{key}", value)


def map_training(m: Mapping) -> None:
    gbs = m.take("global_batch_size")
    mbs = m.take("micro_batch_size")
    if not isinstance(gbs, int) or gbs <= 0:
        raise PrimusError(f"global_batch_size must be a positive integer, got {gbs!r}")
    steps = m.take("train_iters")
    if steps is None and m.given("train_samples"):
        steps = m.take("train_samples") // gbs
    if not isinstance(steps, int) or steps <= 0:
        raise PrimusError(f"train_iters must be a positive integer (or train_samples given), got {steps!r}")
    decay = m.take("lr_decay_iters")
    if decay is None and m.given("lr_decay_samples"):
        decay = m.take("lr_decay_samples") // gbs
    decay = decay or steps
    warmup = m.take("lr_warmup_iters") or 0
    if m.given("lr_warmup_fraction"):
        warmup = round(m.take("lr_warmup_fraction") * decay)
    elif m.given("lr_warmup_samples"):
        warmup = m.take("lr_warmup_samples") // gbs or warmup
    lr = float(m.take("lr"))
    m.put("training.local_batch_size", mbs)
    m.put("training.global_batch_size", gbs)
    seq = m.take("seq_length")
    if not isinstance(seq, int) or seq <= 0:
        raise PrimusError(f"seq_length must be a positive integer, got {seq!r}")
    m.put("training.seq_len", seq)
    m.put("training.max_norm", float(m.take("clip_grad")))
    m.put("training.steps", steps)
    m.put("training.eod_mask_loss", bool(m.take("eod_mask_loss")))
    if m.take("fp16"):
        m.differ("fp16", "hybridtitan trains in bf16 (or fp32) without loss scaling: bf16 written")
    bf16 = m.take("bf16") or m.exp.get("fp16")
    m.put("training.mixed_precision_param", "bfloat16" if bf16 else "float32")
    m.put("training.mixed_precision_reduce", "float32")
    if not m.take("calculate_per_token_loss"):
        m.differ("calculate_per_token_loss", "hybridtitan's loss is the mean over the counted tokens of the global "
                 "batch; Primus's averages per micro-batch, which differs only where eod_mask_loss leaves "
                 "micro-batches with different token counts")
    if steps < decay:
        m.differ("train_iters", f"training.steps {steps} is shorter than the schedule's lr_decay_iters {decay} "
                 f"(lr_scheduler.total_steps): Primus's released YAMLs run 50-100 benchmark iterations of the full "
                 f"schedule; for the whole run give --training.steps {decay}")
    if warmup > steps:
        m.notes.append(f"warm-up: {warmup} steps, longer than the run's {steps}")
    name = m.take("optimizer")
    if name != "adam":
        raise PrimusError(f"optimizer {name!r}: from_primus maps Megatron's adam (AdamW); hybridtitan has no other")
    m.put("optimizer.name", "AdamW")
    m.put("optimizer.lr", lr)
    m.put("optimizer.beta1", float(m.take("adam_beta1")))
    m.put("optimizer.beta2", float(m.take("adam_beta2")))
    m.put("optimizer.eps", float(m.take("adam_eps")))
    m.put("optimizer.weight_decay", float(m.take("weight_decay")))
    m.put("optimizer.implementation", "fused")
    style = m.take("lr_decay_style")
    m.put("lr_scheduler.warmup_steps", int(warmup))
    if style in ("cosine", "linear"):
        m.put("lr_scheduler.decay_type", style)
    elif style == "constant":
        m.put("lr_scheduler.decay_type", "linear")
        m.put("lr_scheduler.decay_ratio", 0.0)
    else:
        m.put("lr_scheduler.decay_type", "cosine")
        m.differ("lr_decay_style", "hybridtitan decays linearly, by 1 - sqrt or by a cosine (with decay_ratio for "
                 "a warm-up-stable-decay shape): cosine written")
    m.put("lr_scheduler.min_lr_factor", _round(float(m.take("min_lr")) / lr))
    if decay != steps:
        m.put("lr_scheduler.total_steps", int(decay))
    if m.take("lr_warmup_init"):
        m.differ("lr_warmup_init", "torchtitan's warm-up starts at lr / warmup_steps, not at lr_warmup_init")
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                "context_parallel_size"):
        if (m.take(key) or 1) != 1:
            m.differ(key, "hybridtitan is data-parallel (FSDP2/HSDP) only: the model is not split")
    m.put("parallelism.data_parallel_replicate_degree", 1)
    m.put("parallelism.data_parallel_shard_degree", -1)
    granularity = m.take("recompute_granularity")
    m.put("activation_checkpoint.mode", {"full": "full", "selective": "selective"}.get(granularity, "none"))
    seed = m.take("seed")
    if seed is not None:
        m.put("debug.seed", int(seed))
    m.put("metrics.log_freq", int(m.take("log_interval")))


def map_data(m: Mapping) -> None:
    m.put("data.tokenizer", m.exp.get("tokenizer_model"))
    if m.take("mock_data"):
        m.put("data.source", "mock")
    else:
        path = m.take("train_data_path") or m.take("data_path")
        if not path:
            raise PrimusError("no training data: mock_data is false and neither data_path nor train_data_path "
                              "is set")
        m.put("data.source", "megatron")
        paths = path if isinstance(path, list) else str(path).split()
        if any(_is_number(p) for p in paths):
            m.notes.append("data: Megatron's blend weights in data_path are dropped: hybridtitan reads the prefixes "
                           "in turn")
        m.put("data.path", ",".join(p for p in map(str, paths) if not _is_number(p)))
    m.put("data.document_boundaries", bool(m.take("reset_position_ids") or m.take("reset_attention_mask")))
    workers = m.take("num_workers")
    if workers is not None:
        m.put("data.num_workers", int(workers))
    m.put("validation.enable", False)
    save = m.take("save")
    exp_name = m.take("exp_name") or Path(m.exp.path).stem
    m.put("job.dump_folder", str(save) if save else f"./outputs/{exp_name}")
    m.put("job.description", f"from Primus's {os.path.basename(m.exp.path)}")
    m.put("checkpoint.enable", bool(save))
    interval = m.take("save_interval")
    if interval:
        m.put("checkpoint.interval", int(interval))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


# ----------------------------------------------------------------------------------------------- the recipe

SECTION_ORDER = ("job", "model", "model.gdn", "model.kda", "model.mamba2", "model.mla", "data", "optimizer",
                 "lr_scheduler", "training", "parallelism", "checkpoint", "validation", "activation_checkpoint",
                 "metrics", "debug")


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _comment(text: str, width: int = 118) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width - 2, initial_indent="# ", subsequent_indent="#   ") or ["#"]


def unmapped(m: Mapping) -> list[str]:
    """Each key of the experiment that the recipe does not take, with the reason, one line each."""
    lines = []
    for key in sorted(m.exp.values):
        if key in m.read:
            continue
        row = ROWS.get(key)
        target = row.target.replace("`", "") if row else ""
        if row is None:
            reason = "not a key from_primus knows: no hybridtitan equivalent known"
        elif row.mapped:
            reason = f"not used by this model or run ({row.meaning}: {target})"
        else:
            reason = f"{row.meaning}: " + re.sub(r"^—", "no hybridtitan equivalent", target)
        lines.append(f"{key} = {_show(m.exp.values[key])} ({m.exp.where(key)}): {reason}")
    return lines


def render(m: Mapping, source: str, comparison: list[str]) -> str:
    exp = m.exp
    out = _comment(f"A hybridtitan recipe from Primus's experiment {source} (python -m hybridtitan.from_primus), "
                   f"its trainer module {exp.module} with the model preset {os.path.basename(exp.model_file)}.")
    out.append("#")
    out += _comment("Files read, as Primus's loader reads them (extends: followed): " +
                    ", ".join(_rel(f) for f in exp.files) + ".")
    for path, bases in exp.bases:
        out += _comment(f"{_rel(path)} says `bases: {bases}`, which Primus's loader does not follow: not read, as "
                        "in Primus's runs (Megatron's defaults apply where no other file sets a key).")
    for line in m.notes:
        out += _comment(line)
    if m.differences:
        out.append("#")
        out.append("# Where this recipe differs from Primus's run (hybridtitan does not have the feature):")
        for line in m.differences:
            out += _comment("- " + line)
    if comparison:
        out.append("#")
        for line in comparison:
            out += _comment(line)
    sections = sorted(m.recipe, key=lambda s: SECTION_ORDER.index(s) if s in SECTION_ORDER else len(SECTION_ORDER))
    for section in sections:
        out.append("")
        out.append(f"[{section}]")
        if section in m.section_comments:
            out += _comment(m.section_comments[section])
        for key, value in m.recipe[section].items():
            out.append(f"{key} = {_toml_value(value)}")
    rest = unmapped(m)
    if rest:
        out.append("")
        out.append(f"# Not mapped ({len(rest)} keys; the reason after each):")
        out += ["#   " + line for line in rest]
    return "\n".join(out) + "\n"


def _rel(path: str) -> str:
    p = Path(path).resolve()
    for parent in p.parents:
        if (parent / "primus" / "configs").is_dir() or (parent / "examples").is_dir():
            return str(p.relative_to(parent))
    return str(path)


# ----------------------------------------------------------------------------------------------- comparison

COMPARED = ("training.local_batch_size", "training.global_batch_size", "training.steps", "training.seq_len",
            "training.max_norm", "training.eod_mask_loss", "training.mixed_precision_param", "optimizer.name",
            "optimizer.lr", "optimizer.beta1", "optimizer.beta2", "optimizer.eps", "optimizer.weight_decay",
            "lr_scheduler.warmup_steps", "lr_scheduler.decay_type", "lr_scheduler.min_lr_factor",
            "lr_scheduler.decay_ratio", "lr_scheduler.total_steps", "data.tokenizer", "debug.seed")


def compared_values(cfg: JobConfig) -> dict:
    """The values two recipes for one configuration are compared on. They are the model (the sizes of the sublayers it
    has) and the COMPARED keys. The schedule's length is taken as it runs: total_steps, else training.steps."""
    from hybridtitan.config_manager import model_args

    values = {}
    for key in COMPARED:
        section, name = key.split(".")
        values[key] = getattr(getattr(cfg, section), name)
    values["lr_scheduler.total_steps"] = cfg.lr_scheduler.total_steps or cfg.training.steps
    values["lr_scheduler.min_lr_factor"] = _round(values["lr_scheduler.min_lr_factor"])
    for key, value in _used_fields(model_args(cfg)).items():
        if isinstance(value, dict):
            values.update({f"model.{key}.{k}": v for k, v in value.items()})
        else:
            values[f"model.{key}"] = value
    return values


def differences(a, b) -> dict:
    """{key: (a's value, b's value)} where two parsed recipes differ in compared_values."""
    va, vb = compared_values(a), compared_values(b)
    return {k: (va.get(k), vb.get(k)) for k in sorted(set(va) | set(vb)) if va.get(k) != vb.get(k)}


def shipped_recipe(experiment: str) -> Path | None:
    """The recipe in train_configs/ whose header says it follows this Primus file, matched by platform folder and name.
    """
    folder = REPO / "train_configs"
    if not folder.is_dir():
        return None
    p = Path(experiment).resolve()
    tail = f"{p.parent.name}/{p.name}"
    for recipe in sorted(folder.glob("*.toml")):
        header = []
        for line in recipe.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line[1:].strip())
        cited = re.findall(r"examples/\S+?\.yaml", " ".join(header))
        if cited and cited[0].endswith(tail):
            return recipe
    return None


def compare_with_shipped(experiment: str, cfg: JobConfig) -> list[str]:
    from hybridtitan.config_manager import parse_config

    recipe = shipped_recipe(experiment)
    if recipe is None:
        return []
    theirs = parse_config(["--job.config_file", str(recipe)], check_data=False)
    diff = differences(cfg, theirs)
    rel = f"train_configs/{recipe.name}"
    if not diff:
        return [f"Compared with {rel}, which follows this Primus file: the same model, batch, schedule, optimizer, "
                "EOD mask and sequence length."]
    lines = [f"Compared with {rel}, which follows this Primus file (its header gives the reason for each "
             f"difference): {len(diff)} differ."]
    lines += [f"- {key}: {_show(a)} here, {_show(b)} in {rel}" for key, (a, b) in diff.items()]
    return lines


# ----------------------------------------------------------------------------------------------- the command


def map_experiment(exp: Experiment):
    """(the Mapping, the model's ModelArgs) of an experiment."""
    m = Mapping(exp)
    args = map_model(m)
    model_section(m, args)
    map_training(m)
    map_data(m)
    return m, args


def convert(experiment: str, primus: str | None = None) -> tuple[str, list[str]]:
    """The recipe's TOML text and the report's lines for an experiment YAML. Raises PrimusError on bad input. The recipe
    is parsed by hybridtitan.config_manager before it is returned."""
    import tempfile

    from hybridtitan.config_manager import parse_config

    exp = read_experiment(experiment, primus)
    m, args = map_experiment(exp)
    text = render(m, experiment, [])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "recipe.toml")
        Path(path).write_text(text)
        try:
            cfg = parse_config(["--job.config_file", path], check_data=False)
        except UserError as e:
            raise PrimusError(f"the recipe made of {experiment} does not parse: {e}") from None
    from hybridtitan.config_manager import model_args

    if _used_fields(model_args(cfg)) != _used_fields(args):
        raise PrimusError(f"the recipe made of {experiment} builds another model than the experiment's")
    comparison = compare_with_shipped(experiment, cfg)
    text = render(m, experiment, comparison)
    report = [f"read: {_rel(f)}" for f in exp.files]
    report += [f"not followed: {_rel(p)} says bases: {b}; Primus's loader follows extends: only, so its values are "
               "not read (as in Primus's runs)" for p, b in exp.bases]
    report += [f"environment: {v}" for v in exp.env_used]
    report += [f"note: {n}" for n in m.notes]
    report += [f"difference: {d}" for d in m.differences]
    report += [f"not mapped: {line}" for line in unmapped(m)]
    report += [f"shipped: {line}" for line in comparison]
    return text, report


def key_tables() -> str:
    """docs/primus.md's key tables, from KEY_TABLE."""
    out = []
    for title, rows in KEY_TABLE.items():
        out += [f"**{title}**", "", "| Primus/Megatron key | meaning | hybridtitan key / note |", "|---|---|---|"]
        for row in rows:
            keys = " / ".join(f"`{k}`" for k in row.keys)
            out.append(f"| {keys} | {row.meaning} | {row.target} |")
        out.append("")
    return "\n".join(out)


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="python -m hybridtitan.from_primus", description=__doc__.split("\n\n")[0])
    p.add_argument("experiment", nargs="?", help="a Primus experiment YAML (examples/megatron/configs/.../*.yaml)")
    p.add_argument("--output", help="write the recipe here (else it is printed on stdout, the report on stderr)")
    p.add_argument("--primus", help="a Primus checkout (or its primus/configs folder), where the experiment's model "
                   "preset and module config are; default: the checkout the experiment lies in")
    p.add_argument("--key-tables", action="store_true", help="print docs/primus.md's key tables and exit")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.key_tables:
        print(key_tables(), end="")
        return
    if not args.experiment:
        fail("give a Primus experiment YAML: python -m hybridtitan.from_primus EXP.yaml [--output R.toml]")
    if args.output and os.path.isdir(args.output):
        fail(f"--output {args.output} is a folder; give a file name (R.toml)")
    if args.output and not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        fail(f"--output {args.output}: no folder {os.path.dirname(os.path.abspath(args.output))}")
    with one_line_errors():
        text, report = convert(args.experiment, args.primus)
    stream = sys.stdout if args.output else sys.stderr
    for line in report:
        print(line, file=stream)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: python -m hybridtitan.describe --job.config_file {args.output}")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
