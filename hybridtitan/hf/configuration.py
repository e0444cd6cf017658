"""The Hugging Face configuration of hybridtitan's own model class (``model_type: hybridtitan``).

One source of truth: ``model_args`` holds the ModelArgs exactly as ``model_args.json`` does in a DCP step folder;
the usual Hugging Face names (vocab_size, hidden_size, num_hidden_layers) are derived from it for tools that read
them, and are never read back.
"""

from __future__ import annotations

import contextlib
import os

from transformers import PreTrainedConfig

from hybridtitan.models import ModelArgs

# For trust_remote_code: a saved folder's auto_map names these two files, which import hybridtitan (it must be
# installed). Importing hybridtitan registers the classes with the Auto classes instead.
REMOTE_CODE = {
    "configuration_hybridtitan.py": (
        '"""hybridtitan\'s Hugging Face config, for trust_remote_code. Requires hybridtitan to be installed."""\n\n'
        "from hybridtitan.hf.configuration import HybridTitanConfig  # noqa: F401\n"),
    "modeling_hybridtitan.py": (
        '"""hybridtitan\'s Hugging Face model class, for trust_remote_code. Requires hybridtitan to be installed."""'
        "\n\nfrom hybridtitan.hf.modeling import HybridCache, HybridTitanForCausalLM  # noqa: F401\n"),
}
AUTO_MAP = {
    "AutoConfig": "configuration_hybridtitan.HybridTitanConfig",
    "AutoModelForCausalLM": "modeling_hybridtitan.HybridTitanForCausalLM",
}


def write_remote_code(folder: str) -> None:
    for name, text in REMOTE_CODE.items():
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


@contextlib.contextmanager
def without_auto_class(obj):
    """transformers' save_pretrained copies the source file of a class loaded through trust_remote_code (here
    hybridtitan's own module, under its own name) and points auto_map at it, which then fails to load: saving
    with ``_auto_class`` unset skips that, and REMOTE_CODE / AUTO_MAP are written instead."""
    own = "_auto_class" in vars(obj)
    saved = vars(obj).get("_auto_class")
    obj._auto_class = None
    try:
        yield
    finally:
        if own:
            obj._auto_class = saved
        else:
            del obj._auto_class


class HybridTitanConfig(PreTrainedConfig):
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
        **kwargs,
    ):
        self.model_args = dict(model_args or {})
        self.max_position_embeddings = max_position_embeddings
        self.use_cache = use_cache
        if self.model_args:
            args = self.to_model_args()  # validates
            self.vocab_size = args.vocab_size
            self.hidden_size = args.dim
            self.num_hidden_layers = args.n_layers
            self.pattern = args.pattern
            self.mixer = args.mixer
            kwargs["tie_word_embeddings"] = args.tie_embeddings
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)

    def to_model_args(self) -> ModelArgs:
        from hybridtitan.checkpoint import model_args_from_dict

        if not self.model_args:
            raise ValueError("this hybridtitan config has no model_args")
        return model_args_from_dict(self.model_args)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """Also writes the two files that auto_map names, so that the folder loads with trust_remote_code."""
        self.auto_map = dict(AUTO_MAP)
        if self.model_args and getattr(self, "vocab_size", None) not in (None, self.model_args.get("vocab_size")):
            # resize_token_embeddings sets vocab_size: the folder's model is the resized one
            self.model_args["vocab_size"] = self.vocab_size
        with without_auto_class(self):
            super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        write_remote_code(save_directory)

    @classmethod
    def from_model_args(cls, args: ModelArgs, **kwargs) -> "HybridTitanConfig":
        from hybridtitan.checkpoint import model_args_to_dict

        return cls(model_args=model_args_to_dict(args), **kwargs)
