"""The Hugging Face configuration of hybridtitan's own model class (``model_type: hybridtitan``).

One source of truth: ``model_args`` holds the ModelArgs exactly as ``model_args.json`` does in a DCP step folder;
the usual Hugging Face names (vocab_size, hidden_size, num_hidden_layers) are derived from it for tools that read
them, and are never read back.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from hybridtitan.models import ModelArgs


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

    @classmethod
    def from_model_args(cls, args: ModelArgs, **kwargs) -> "HybridTitanConfig":
        from hybridtitan.checkpoint import model_args_to_dict

        return cls(model_args=model_args_to_dict(args), **kwargs)
