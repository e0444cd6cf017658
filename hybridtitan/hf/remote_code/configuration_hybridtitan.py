"""Configuration of a hybridtitan export (``model_type: hybridtitan``), standalone.

This file travels inside an exported folder and is loaded by ``trust_remote_code=True``: it needs transformers
and nothing else (it never imports hybridtitan). It reads the same ``config.json`` that hybridtitan writes:

* ``model_args``: the trainer's model arguments, exactly as a checkpoint's ``model_args.json`` holds them --
  the one source of truth::

      vocab_size, dim, n_layers, ffn_dim, pattern, mixer, tie_embeddings, norm_eps, init_std,
      gdn {num_heads, num_v_heads, head_dim, head_v_dim, conv_size},
      kda {num_heads, head_dim, head_v_dim, conv_size},
      mamba2 {d_state, head_dim, n_groups, expand, conv_size},
      mla {num_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_theta,
           rope_scaling_factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, mscale_all_dim}

* the usual Hugging Face names (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``pattern``, ``mixer``,
  ``tie_word_embeddings``), derived from ``model_args`` for tools that read them; of these only ``vocab_size`` is
  read back (``resize_token_embeddings`` changes it, and saving writes it into ``model_args``).

The pattern has one symbol per pre-norm residual sublayer: ``*`` MLA attention, ``M`` the mixer (Gated DeltaNet,
KDA or Mamba2, chosen by ``mixer``), ``-`` SwiGLU MLP.
"""

from __future__ import annotations

import os
import shutil

from transformers import PretrainedConfig
from transformers.utils import logging

logger = logging.get_logger(__name__)

# What an export's config.json names for trust_remote_code: this file and the modeling file beside it.
CODE_FILES = ("configuration_hybridtitan.py", "modeling_hybridtitan.py")
AUTO_MAP = {
    "AutoConfig": "configuration_hybridtitan.HybridTitanConfig",
    "AutoModelForCausalLM": "modeling_hybridtitan.HybridTitanForCausalLM",
}

SUBLAYER_KINDS = {"*": "attention", "M": "mixer", "-": "mlp"}
MIXERS = ("gdn", "kda", "mamba2")
# The keys of model_args this code reads. A key outside them is a field of a newer hybridtitan that this copy
# of the code does not know: it is warned about, since the model might then compute something else.
KNOWN_KEYS = {"vocab_size", "dim", "n_layers", "ffn_dim", "pattern", "hybrid_attention_ratio", "mixer",
              "tie_embeddings", "norm_eps", "init_std", *MIXERS, "mla"}
SUBLAYER_KEYS = {
    "gdn": {"num_heads", "num_v_heads", "head_dim", "head_v_dim", "conv_size"},
    "kda": {"num_heads", "head_dim", "head_v_dim", "conv_size"},
    "mamba2": {"d_state", "head_dim", "n_groups", "expand", "conv_size"},
    "mla": {"num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "rope_theta", "rope_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
            "mscale", "mscale_all_dim"},
}


class HybridTitanConfig(PretrainedConfig):
    model_type = "hybridtitan"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(
        self,
        model_args: dict | None = None,
        max_position_embeddings: int = 2048,
        use_cache: bool = True,
        pad_token_id: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        use_fla_kernels: bool = True,
        **kwargs,
    ):
        self.model_args = dict(model_args or {})
        # the mixers' recurrences in FLA's Triton kernels when FLA imports and the tensors are on a GPU; False keeps
        # a GPU on the PyTorch forms (from_pretrained(..., use_fla_kernels=False))
        self.use_fla_kernels = use_fla_kernels
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        if self.model_args:
            self._validate()
            a = self.model_args
            self.vocab_size = a["vocab_size"]
            self.hidden_size = a["dim"]
            self.num_hidden_layers = a["n_layers"]
            self.pattern = a["pattern"]
            self.mixer = a["mixer"]
            kwargs["tie_word_embeddings"] = bool(a["tie_embeddings"])
        # a vocab_size among kwargs (a saved config.json's) is set by the base class and wins: the model is built
        # with config.vocab_size, which resize_token_embeddings changes and save_pretrained writes into model_args
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    # ---------------------------------------------------------------------------------------- reading model_args

    @property
    def sublayer_kinds(self) -> list[str]:
        """'attention', 'mixer' or 'mlp' for each sublayer, from the pattern."""
        return [SUBLAYER_KINDS[ch] for ch in self.model_args["pattern"]]

    @property
    def mixer_args(self) -> dict:
        return dict(self.model_args[self.model_args["mixer"]])

    @property
    def mla_args(self) -> dict:
        return dict(self.model_args["mla"])

    def _validate(self) -> None:
        a = self.model_args
        missing = sorted({"vocab_size", "dim", "n_layers", "ffn_dim", "pattern", "mixer", "tie_embeddings",
                          "norm_eps"} - set(a))
        if missing:
            raise ValueError(f"hybridtitan config: model_args lacks {', '.join(missing)}")
        bad = [ch for ch in a["pattern"] if ch not in SUBLAYER_KINDS]
        if bad or not a["pattern"]:
            raise ValueError(f"hybridtitan config: pattern {a['pattern']!r} must consist of '*', 'M' and '-'")
        if len(a["pattern"]) != a["n_layers"]:
            raise ValueError(f"hybridtitan config: pattern {a['pattern']!r} has {len(a['pattern'])} sublayers, "
                             f"n_layers is {a['n_layers']}")
        needed = {"mla"} if "*" in a["pattern"] else set()
        if "M" in a["pattern"]:
            if a["mixer"] not in MIXERS:
                raise ValueError(f"hybridtitan config: mixer {a['mixer']!r} is not one of {', '.join(MIXERS)}")
            needed.add(a["mixer"])
        for name in sorted(needed):
            sub = a.get(name) or {}
            lacking = sorted(SUBLAYER_KEYS[name] - set(sub))
            if lacking:
                raise ValueError(f"hybridtitan config: model_args.{name} lacks {', '.join(lacking)}")
            unknown = sorted(set(sub) - SUBLAYER_KEYS[name])
            if unknown:
                logger.warning(f"hybridtitan config: model_args.{name} has fields this code does not know "
                               f"({', '.join(unknown)}); they are ignored")
        unknown = sorted(set(a) - KNOWN_KEYS)
        if unknown:
            logger.warning(f"hybridtitan config: model_args has fields this code does not know ({', '.join(unknown)}); "
                           "they are ignored")

    # ---------------------------------------------------------------------------------------- saving

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """As transformers', and the saved folder always loads with ``trust_remote_code=True``: auto_map names both
        classes and the two code files are copied beside config.json, however this class was imported."""
        if self.model_args and getattr(self, "vocab_size", None) not in (None, self.model_args["vocab_size"]):
            # resize_token_embeddings sets vocab_size: the folder's model is the resized one
            self.model_args["vocab_size"] = self.vocab_size
        self.auto_map = dict(AUTO_MAP)
        super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        copy_code_files(save_directory)


def copy_code_files(folder: str, source: str | None = None) -> None:
    """Copies the two code files from ``source`` (default: this file's folder) into ``folder``, where present."""
    source = source or os.path.dirname(os.path.abspath(__file__))
    for name in CODE_FILES:
        src, dst = os.path.join(source, name), os.path.join(folder, name)
        if os.path.isfile(src) and not (os.path.exists(dst) and os.path.samefile(src, dst)):
            shutil.copyfile(src, dst)
