"""Weights and configs between hybridtitan and Hugging Face folders.

Three layouts are written and read:

* transformers' LlamaForCausalLM, for a pure grouped-query-attention stack (pattern ``*-`` repeated). See
  hybridtitan.hf.llama.

* FLA's own (``GatedDeltaNetForCausalLM``, ``KDAForCausalLM``), for a pure GDN or KDA stack (pattern ``M-``
  repeated). FLA block i holds our sublayers 2i (mixer) and 2i+1 (MLP)::

      layers.{2i}.norm.weight     <-> model.layers.{i}.attn_norm.weight
      layers.{2i}.mixer.<name>    <-> model.layers.{i}.attn.<name>        (same names and shapes as FLA's)
      layers.{2i+1}.norm.weight   <-> model.layers.{i}.mlp_norm.weight
      layers.{2i+1}.mlp.<name>    <-> model.layers.{i}.mlp.<name>
      embeddings.weight, norm.weight  <-> model.embeddings.weight, model.norm.weight
      lm_head.weight (untied only)    <-> lm_head.weight (FLA ties it to the embedding otherwise)

* hybridtitan's own (``model_type: hybridtitan``), for everything else. Its tensors are HybridLM's names under
  ``model.``, exactly the keys of a DCP checkpoint.

Every failure a person can cause (a missing or foreign folder, a config FLA's layout cannot express) raises
ConversionError with one line that says what is wrong."""

from __future__ import annotations

import json
import os
import re
import shutil

import torch

from hybridtitan.checkpoint import model_args_from_dict
from hybridtitan.errors import ConversionError, first_error_line
from hybridtitan.models import GDNArgs, HybridLM, KDAArgs, ModelArgs, build_model

from .llama import LLAMA_MODEL_TYPE, from_llama_key, model_args_from_llama_config

FLA_MODEL_TYPES = {"gdn": "gated_deltanet", "kda": "kda"}
FLA_ARCHITECTURES = {"gdn": "GatedDeltaNetForCausalLM", "kda": "KDAForCausalLM"}
OWN_MODEL_TYPE = "hybridtitan"
SAFE_INDEX = "model.safetensors.index.json"
SAFE_SINGLE = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # Hugging Face's "5GB"


# ------------------------------------------------------------------------------------------ FLA names and configs


def fla_layout_problem(args: ModelArgs) -> str | None:
    """Why FLA's GatedDeltaNet/KDA layout cannot hold this model, or None if it can."""
    if args.mixer not in FLA_MODEL_TYPES:
        return f"FLA's layouts hold pure GDN or KDA models, not mixer {args.mixer!r}"
    if args.pattern != "M-" * (args.n_layers // 2):
        return f"FLA's layouts hold a plain 'M-' repeated stack, not pattern {args.pattern!r}"
    m = getattr(args, args.mixer)
    if int(m.head_dim * (m.head_v_dim / m.head_dim)) != m.head_v_dim:  # FLA: head_v_dim = int(head_dim * expand_v)
        return f"head_v_dim {m.head_v_dim} is not expressible as head_dim {m.head_dim} * expand_v"
    return None


def to_fla_key(key: str) -> str:
    """Our HybridLM name -> FLA's name (pure GDN/KDA stacks only)."""
    if key in ("embeddings.weight", "norm.weight"):
        return "model." + key
    if key == "lm_head.weight":
        return key
    m = re.fullmatch(r"layers\.(\d+)\.(norm\.weight|mixer\.(.+)|mlp\.(.+))", key)
    if not m:
        raise ConversionError(f"no FLA name for parameter {key}")
    j = int(m.group(1))
    block, mixer_slot = j // 2, j % 2 == 0
    if m.group(2) == "norm.weight":
        return f"model.layers.{block}.{'attn_norm' if mixer_slot else 'mlp_norm'}.weight"
    if m.group(3) is not None and mixer_slot:
        return f"model.layers.{block}.attn.{m.group(3)}"
    if m.group(4) is not None and not mixer_slot:
        return f"model.layers.{block}.mlp.{m.group(4)}"
    raise ConversionError(f"parameter {key} is not where FLA's layout expects it")


def from_fla_key(key: str) -> str | None:
    """FLA's name -> ours; None for FLA's tied lm_head copy."""
    if key in ("model.embeddings.weight", "model.norm.weight"):
        return key[len("model."):]
    if key == "lm_head.weight":
        return key
    m = re.fullmatch(r"model\.layers\.(\d+)\.(attn_norm\.weight|mlp_norm\.weight|attn\.(.+)|mlp\.(.+))", key)
    if not m:
        raise ConversionError(f"unexpected tensor {key} in an FLA checkpoint (not a GDN/KDA block)")
    i = int(m.group(1))
    if m.group(2) == "attn_norm.weight":
        return f"layers.{2 * i}.norm.weight"
    if m.group(2) == "mlp_norm.weight":
        return f"layers.{2 * i + 1}.norm.weight"
    if m.group(3) is not None:
        return f"layers.{2 * i}.mixer.{m.group(3)}"
    return f"layers.{2 * i + 1}.mlp.{m.group(4)}"


def fla_config(args: ModelArgs, *, bos_token_id=None, eos_token_id=None, pad_token_id=None,
               max_position_embeddings: int = 2048, dtype: torch.dtype | None = None):
    """FLA's GatedDeltaNetConfig / KDAConfig for a pure GDN/KDA model (built with FLA's own classes)."""
    problem = fla_layout_problem(args)
    if problem:
        raise ConversionError(problem)
    try:
        from fla.models import GatedDeltaNetConfig, KDAConfig  # imported here: FLA takes seconds to import
    except ModuleNotFoundError as e:  # FLA's package imports Triton, which a plain `pip install hybridtitan` lacks
        if e.name != "triton":
            raise
        raise ConversionError("FLA's layout needs FLA's config classes, which import Triton: pip install "
                              "'hybridtitan[cpu]' ('[cuda]' or '[rocm]' on GPUs), or export with --format "
                              "hybridtitan") from None

    m = getattr(args, args.mixer)
    common = dict(
        hidden_size=args.dim, num_hidden_layers=args.n_layers // 2, num_heads=m.num_heads, head_dim=m.head_dim,
        expand_v=m.head_v_dim / m.head_dim, conv_size=m.conv_size, use_short_conv=True, attn_mode="chunk",
        intermediate_size=args.ffn_dim, hidden_ratio=args.ffn_dim // args.dim if args.ffn_dim % args.dim == 0 else None,
        hidden_act="swish", norm_eps=args.norm_eps, vocab_size=args.vocab_size,
        tie_word_embeddings=args.tie_embeddings, initializer_range=args.init_std,
        max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, use_cache=True,
    )
    if args.mixer == "gdn":
        config = GatedDeltaNetConfig(num_v_heads=m.num_v_heads, use_gate=True, allow_neg_eigval=False,
                                     output_gate_activation="swish", **common)
    else:
        config = KDAConfig(num_v_heads=None, allow_neg_eigval=False, safe_gate=False, **common)
    config.architectures = [FLA_ARCHITECTURES[args.mixer]]
    if dtype is not None:
        config.dtype = dtype
    return config


def model_args_from_fla_config(cfg: dict) -> ModelArgs:
    """ModelArgs of an FLA GatedDeltaNet/KDA config.json; ConversionError naming the first unsupported field."""
    model_type = cfg.get("model_type")
    mixer = {v: k for k, v in FLA_MODEL_TYPES.items()}.get(model_type)
    if mixer is None:
        raise ConversionError(f"model_type {model_type!r} is none of llama, gated_deltanet, kda and {OWN_MODEL_TYPE}")

    def want(field, ok, default=None):
        value = cfg.get(field, default)
        if not ok(value):
            raise ConversionError(f"config.json: {field}={value!r} is not supported by hybridtitan's {mixer.upper()}")
        return value

    want("attn", lambda v: not v)  # FLA's interleaved softmax attention: not an MLA, not ours
    want("attnres_block_size", lambda v: v is None)
    want("use_short_conv", lambda v: v is True, True)
    want("allow_neg_eigval", lambda v: not v, False)
    want("hidden_act", lambda v: v == "swish", "swish")
    if mixer == "gdn":
        want("use_gate", lambda v: v is True, True)
        want("output_gate_activation", lambda v: v in ("swish", "silu"), "swish")
    else:
        want("safe_gate", lambda v: not v, False)
        # FLA's KDA switches to a sigmoid gate bounded below by lower_bound whenever it is set
        want("lower_bound", lambda v: v is None, None)
    hidden, heads, head_dim = cfg["hidden_size"], cfg["num_heads"], cfg["head_dim"]
    expand_v = cfg.get("expand_v", 2.0 if mixer == "gdn" else 1.0)
    head_v_dim = int(head_dim * expand_v)
    v_heads = cfg.get("num_v_heads") or heads
    ffn = cfg.get("intermediate_size")
    if ffn is None:  # FLA's GatedMLP rule
        ffn = int(hidden * (cfg.get("hidden_ratio") or 4) * 2 / 3)
        ffn = 256 * ((ffn + 255) // 256)
    conv = cfg.get("conv_size", 4)
    if mixer == "gdn":
        mixer_args = dict(gdn=GDNArgs(num_heads=heads, num_v_heads=v_heads, head_dim=head_dim, head_v_dim=head_v_dim,
                                      conv_size=conv))
    else:
        if v_heads != heads:
            raise ConversionError(f"config.json: num_v_heads={v_heads} != num_heads={heads} is not supported by "
                                  "hybridtitan's KDA")
        mixer_args = dict(kda=KDAArgs(num_heads=heads, head_dim=head_dim, head_v_dim=head_v_dim, conv_size=conv))
    L = cfg["num_hidden_layers"]
    try:
        return ModelArgs(vocab_size=cfg["vocab_size"], dim=hidden, n_layers=2 * L, ffn_dim=ffn, pattern="M-" * L,
                         mixer=mixer, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                         norm_eps=cfg.get("norm_eps", 1e-6), init_std=cfg.get("initializer_range", 0.02), **mixer_args)
    except ValueError as e:
        raise ConversionError(f"config.json: {first_error_line(e)}") from None


# ------------------------------------------------------------------------------------------ reading a DCP folder


def model_from_state(args: ModelArgs, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                     device: str | torch.device = "cpu", source: str = "") -> HybridLM:
    model = build_model(args, "meta")
    model.to_empty(device=device)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())
        of = f" of {source}" if source else ""
        raise ConversionError(f"the weights{of} do not fit the model: {detail[:300]}") from None
    return model.to(dtype)


# ------------------------------------------------------------------------------------------ Hugging Face folders


def write_safetensors(tensors: dict[str, torch.Tensor], folder: str,
                      max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[str]:
    """model.safetensors, or shards model-0000i-of-0000n.safetensors and an index once past max_shard_size."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append({})
            size = 0
        shards[-1][key] = t.contiguous()
        size += nbytes
    umask = os.umask(0)
    os.umask(umask)

    def save(shard, name):
        path = os.path.join(folder, name)
        save_file(shard, path, metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~umask)  # safetensors creates its files private (0600)

    if len(shards) == 1:
        save(shards[0], SAFE_SINGLE)
        return [SAFE_SINGLE]
    names, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save(shard, name)
        names.append(name)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(folder, SAFE_INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names + [SAFE_INDEX]


def is_hf_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json"))


def read_hf_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder: model.safetensors, sharded safetensors, or pytorch_model.bin."""
    from safetensors.torch import load_file

    index = os.path.join(folder, SAFE_INDEX)
    try:
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            tensors = {}
            for name in files:
                path = os.path.join(folder, name)
                if not os.path.isfile(path):
                    raise ConversionError(f"{folder}: shard {name} named in {SAFE_INDEX} is missing")
                tensors.update(load_file(path))
            return tensors
        if os.path.isfile(os.path.join(folder, SAFE_SINGLE)):
            return load_file(os.path.join(folder, SAFE_SINGLE))
        if os.path.isfile(os.path.join(folder, "pytorch_model.bin")):
            return torch.load(os.path.join(folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    except ConversionError:
        raise
    except Exception as e:  # noqa: BLE001 -- a truncated or foreign file: one line
        raise ConversionError(f"cannot read the weights in {folder}: {first_error_line(e)}") from None
    raise ConversionError(f"{folder} has a config.json but no weights (model.safetensors, {SAFE_INDEX} or "
                          "pytorch_model.bin)")


def read_hf_config(folder: str) -> dict:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConversionError(f"cannot read {folder}/config.json: {first_error_line(e)}") from None


def model_args_from_hf_config(cfg: dict, folder: str) -> ModelArgs:
    """ModelArgs of a Hugging Face folder's config.json: a Llama, an FLA GDN/KDA model or a hybridtitan export."""
    model_type = cfg.get("model_type")
    if model_type == LLAMA_MODEL_TYPE:
        return model_args_from_llama_config(cfg)
    if model_type != OWN_MODEL_TYPE:
        return model_args_from_fla_config(cfg)
    if not cfg.get("model_args"):
        raise ConversionError(f"{folder}/config.json has model_type hybridtitan but no model_args")
    try:
        return model_args_from_dict(cfg["model_args"])
    except (TypeError, ValueError) as e:
        raise ConversionError(f"{folder}/config.json: bad model_args: {first_error_line(e)}") from None


def read_hf_model(folder: str) -> tuple[ModelArgs, dict[str, torch.Tensor], str]:
    """(ModelArgs, the state under HybridLM's names, model_type) of a Llama folder (LlamaForCausalLM), an FLA GDN/KDA
    folder or a hybridtitan export."""
    args, model_type, rename = _hf_naming(folder)
    state = {}
    for key, t in read_hf_tensors(folder).items():
        ours = rename(key)
        if ours is not None:
            state[ours] = t
    return args, state, model_type


def hf_tensor_files(folder: str) -> tuple[ModelArgs, dict[str, tuple[str, str]]]:
    """(ModelArgs, HybridLM name -> (safetensors file, its name there)) of a safetensors folder.

    It says where each tensor lies, so that a rank can read only the rows it holds (model_loader.load_into_shards).
    Raises ConversionError for a folder with only pytorch_model.bin, which allows no partial reads."""
    from safetensors import safe_open

    args, _, rename = _hf_naming(folder)
    index = os.path.join(folder, SAFE_INDEX)
    try:
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.isfile(os.path.join(folder, SAFE_SINGLE)):
            files = [SAFE_SINGLE]
        else:
            raise ConversionError(f"{folder} has no safetensors weights ({SAFE_SINGLE} or {SAFE_INDEX})")
        where = {}
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise ConversionError(f"{folder}: shard {name} named in {SAFE_INDEX} is missing")
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    ours = rename(key)
                    if ours is not None:
                        where[ours] = (path, key)
    except ConversionError:
        raise
    except Exception as e:  # noqa: BLE001 -- a truncated or foreign file: one line
        raise ConversionError(f"cannot read the weights in {folder}: {first_error_line(e)}") from None
    return args, where


def _hf_naming(folder: str):
    """(ModelArgs, model_type, a function from the folder's tensor names to HybridLM's). The function returns None for a
    tied copy."""
    if not os.path.isdir(folder):
        raise ConversionError(f"model folder not found: {folder}")
    if not is_hf_folder(folder):
        dcp_like = (os.path.isfile(os.path.join(folder, ".metadata"))
                    or os.path.isdir(os.path.join(folder, "checkpoint")))
        hint = " -- it looks like a DCP checkpoint, which needs no import" if dcp_like else ""
        raise ConversionError(f"{folder} is not a Hugging Face model folder (no config.json){hint}")
    cfg = read_hf_config(folder)
    model_type = cfg.get("model_type")
    args = model_args_from_hf_config(cfg, folder)

    def own(key: str) -> str:
        if not key.startswith("model."):
            raise ConversionError(f"unexpected tensor {key} in {folder} (hybridtitan exports keep 'model.' names)")
        return key[len("model."):]

    def other(key: str) -> str | None:
        ours = (from_llama_key if model_type == LLAMA_MODEL_TYPE else from_fla_key)(key)
        return None if ours == "lm_head.weight" and args.tie_embeddings else ours  # a tied copy of the embedding

    return args, model_type, own if model_type == OWN_MODEL_TYPE else other


def load_tokenizer(path: str, vocab_size: int | None = None):
    """A tokenizer from a folder or hub name. Raises ConversionError in one line if nothing loads, or if the tokenizer
    has ids past ``vocab_size``. Otherwise the model's embedding would fail on those ids, far from the cause."""
    from transformers.utils import logging as hf_logging

    from hybridtitan.data import build_tokenizer
    from hybridtitan.data.tokenizer import vocab_mismatch

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # a model folder's config.json of an unregistered model_type is no concern here
    try:
        tok = build_tokenizer(path)
    except ValueError as e:
        raise ConversionError(first_error_line(e).replace("data.tokenizer: ", "tokenizer: ", 1)) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    problem = vocab_size is not None and vocab_mismatch(tok, vocab_size)
    if problem:
        raise ConversionError(f"{problem} ({path})")
    return tok


def load_hf_model(folder: str, dtype: torch.dtype = torch.float32, device="cpu") -> HybridLM:
    """A HybridLM (our model code) from an FLA GDN/KDA folder or a hybridtitan export."""
    args, state, _ = read_hf_model(folder)
    return model_from_state(args, state, dtype, device, source=folder)


def _only_an_export(folder: str, entries: list[str]) -> bool:
    """Whether every entry is a file an export writes: config and tokenizer JSONs, weights, our remote code, and
    tokenizer files of other kinds."""
    from hybridtitan.hf.configuration import is_model_code

    def ours(name: str) -> bool:
        return (name.endswith((".json", ".safetensors", ".jinja")) or is_model_code(name)
                or name in ("merges.txt", "vocab.txt", "tokenizer.model"))

    return all(os.path.isfile(os.path.join(folder, n)) and ours(n) for n in entries)


def _only_an_import(folder: str, entries: list[str]) -> bool:
    """Whether the folder is a model-only DCP step folder, as an import writes it, with at most its tokenizer beside it.
    A training checkpoint is not (its optimizer and data position would be lost), and nor is a folder of step folders.
    """
    from hybridtitan.checkpoint import is_model_only

    subfolders = [n for n in entries if os.path.isdir(os.path.join(folder, n))]
    return ".metadata" in entries and subfolders in ([], ["tokenizer"]) and is_model_only(folder)


OVERWRITABLE = {
    "export": (_only_an_export, "an earlier export (only the files an export writes)"),
    "import": (_only_an_import, "an earlier import (a model-only step folder)"),
}


def output_problem(output: str, overwrite: bool, kind: str) -> str | None:
    """Why ``kind`` ("export" or "import") may not write ``output``, or None if it may.

    A missing or empty folder may be written. An existing one may be written only with ``overwrite``, and only when it
    holds nothing but what that tool writes. So --overwrite replaces an earlier result, never a folder of other things
    such as a training run or a project."""
    if not os.path.exists(output):
        return None
    if not os.path.isdir(output):
        return f"output exists and is not a folder: {output}"
    entries = sorted(os.listdir(output))
    if not entries:
        return None
    if not overwrite:
        return f"output folder exists: {output} (pass --overwrite to replace it)"
    only_ours, what = OVERWRITABLE[kind]
    if not only_ours(output, entries):
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        return (f"--overwrite replaces only {what} or an empty folder: {output} holds {shown}; choose another "
                "folder")
    return None


def publish_folder(tmp: str, output: str) -> None:
    """Moves a completely written folder into place. An existing ``output``, already allowed to be replaced, is swapped
    out first and removed afterwards, so ``output`` is never half-written."""
    if os.path.exists(output):
        old = tmp + ".old"
        os.rename(output, old)
        os.rename(tmp, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, output)
