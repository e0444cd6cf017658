"""Llama folders (transformers' LlamaForCausalLM) to and from hybridtitan's HybridLM.

A Llama is a pattern of grouped-query attention and MLP sublayers, '*-' per Llama layer: Llama layer i holds our
sublayers 2i (attention) and 2i+1 (MLP), with the same tensors under other names::

    model.embed_tokens.weight                    <-> embeddings.weight
    model.layers.{i}.input_layernorm.weight      <-> layers.{2i}.norm.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj    <-> layers.{2i}.attn.{q,k,v,o}_proj
    model.layers.{i}.post_attention_layernorm    <-> layers.{2i+1}.norm.weight
    model.layers.{i}.mlp.{gate,up,down}_proj     <-> layers.{2i+1}.mlp.{gate,up,down}_proj
    model.norm.weight, lm_head.weight            <-> norm.weight, lm_head.weight (untied only)

Both use the rotate-half RoPE layout, so no weight is permuted. A config.json gives RoPE either as transformers 5
writes it (``rope_parameters``) or as Meta's folders do (``rope_theta`` and ``rope_scaling``); Llama 3.1's
"llama3" frequency scaling is read and written, other scalings are refused.
"""

from __future__ import annotations

import re

from hybridtitan.errors import ConversionError
from hybridtitan.models import GQAArgs, ModelArgs

LLAMA_MODEL_TYPE = "llama"


def llama_layout_problem(args: ModelArgs) -> str | None:
    """Why transformers' LlamaForCausalLM cannot hold this model, or None if it can."""
    if args.attention != "gqa" or args.pattern != "*-" * (args.n_layers // 2):
        return f"a Llama folder holds grouped-query attention and MLPs ('*-' per layer), not pattern {args.pattern!r}"
    return None


def _rope(cfg: dict) -> dict:
    """theta and the llama3 scaling, from either spelling of a config.json."""
    params = dict(cfg.get("rope_parameters") or {})
    if not params:
        params = dict(cfg.get("rope_scaling") or {})
        params["rope_theta"] = cfg.get("rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ConversionError(f"config.json: RoPE scaling {kind!r} is not supported (only Llama 3's 'llama3')")
    return {"rope_theta": float(params.get("rope_theta", 10000.0)), "llama3": kind == "llama3", **params}


def model_args_from_llama_config(cfg: dict) -> ModelArgs:
    """ModelArgs of a LlamaForCausalLM config.json; ConversionError naming the first unsupported field."""

    def want(field, ok, default=None):
        value = cfg.get(field, default)
        if not ok(value):
            raise ConversionError(f"config.json: {field}={value!r} is not supported by hybridtitan's Llama")

    want("attention_bias", lambda v: not v, False)
    want("mlp_bias", lambda v: not v, False)
    want("hidden_act", lambda v: v in ("silu", "swish"), "silu")
    want("pretraining_tp", lambda v: v in (None, 1), 1)
    missing = [k for k in ("num_attention_heads", "hidden_size", "num_hidden_layers", "intermediate_size",
                           "vocab_size") if k not in cfg]
    if missing:
        raise ConversionError(f"config.json: a Llama config needs {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    rope = _rope(cfg)
    scaling = dict(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                   low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                   high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                   original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192))
                   ) if rope["llama3"] else {}
    gqa = GQAArgs(num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                  head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, rope_theta=rope["rope_theta"],
                  **scaling)
    layers = cfg["num_hidden_layers"]
    try:
        return ModelArgs(vocab_size=cfg["vocab_size"], dim=cfg["hidden_size"], n_layers=2 * layers,
                         ffn_dim=cfg["intermediate_size"], pattern="*-" * layers, attention="gqa",
                         tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                         norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), init_std=cfg.get("initializer_range", 0.02),
                         gqa=gqa)
    except ValueError as e:
        raise ConversionError(f"config.json: {e}") from None


def llama_config(args: ModelArgs, *, max_position_embeddings: int, bos_token_id=None, eos_token_id=None,
                 pad_token_id=None, dtype=None):
    """transformers' LlamaConfig of a pure grouped-query-attention model."""
    from transformers import LlamaConfig

    problem = llama_layout_problem(args)
    if problem:
        raise ConversionError(problem)
    g = args.gqa
    rope = {"rope_type": "default", "rope_theta": g.rope_theta}
    if g.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=g.rope_scaling_factor, low_freq_factor=g.low_freq_factor,
                    high_freq_factor=g.high_freq_factor,
                    original_max_position_embeddings=g.original_max_position_embeddings)
    config = LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers // 2, num_attention_heads=g.num_heads, num_key_value_heads=g.num_kv_heads,
        head_dim=g.head_dim, hidden_act="silu", max_position_embeddings=max_position_embeddings,
        rms_norm_eps=args.norm_eps, rope_parameters=rope, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=args.tie_embeddings, initializer_range=args.init_std, bos_token_id=bos_token_id,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    config.architectures = ["LlamaForCausalLM"]
    if dtype is not None:
        config.dtype = dtype
    return config


_SUBLAYER = {"input_layernorm.weight": (0, "norm.weight"), "post_attention_layernorm.weight": (1, "norm.weight")}


def from_llama_key(key: str) -> str:
    """A LlamaForCausalLM tensor name -> ours."""
    if key == "model.embed_tokens.weight":
        return "embeddings.weight"
    if key in ("model.norm.weight", "lm_head.weight"):
        return key.removeprefix("model.")
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", key)
    if m:
        i, rest = int(m.group(1)), m.group(2)
        if rest in _SUBLAYER:
            slot, name = _SUBLAYER[rest]
            return f"layers.{2 * i + slot}.{name}"
        if re.fullmatch(r"self_attn\.[qkvo]_proj\.weight", rest):
            return f"layers.{2 * i}.attn.{rest.removeprefix('self_attn.')}"
        if re.fullmatch(r"mlp\.(gate|up|down)_proj\.weight", rest):
            return f"layers.{2 * i + 1}.{rest}"
    raise ConversionError(f"unexpected tensor {key} in a Llama checkpoint")


def to_llama_key(key: str) -> str:
    """Our name -> LlamaForCausalLM's (pure grouped-query-attention models only)."""
    if key == "embeddings.weight":
        return "model.embed_tokens.weight"
    if key == "norm.weight":
        return "model.norm.weight"
    if key == "lm_head.weight":
        return key
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
    if m:
        j, rest = int(m.group(1)), m.group(2)
        i, attention_slot = j // 2, j % 2 == 0
        if rest == "norm.weight":
            return f"model.layers.{i}.{'input_layernorm' if attention_slot else 'post_attention_layernorm'}.weight"
        if attention_slot and rest.startswith("attn."):
            return f"model.layers.{i}.self_attn.{rest.removeprefix('attn.')}"
        if not attention_slot and rest.startswith("mlp."):
            return f"model.layers.{i}.{rest}"
    raise ConversionError(f"parameter {key} is not where a Llama's layout expects it")
