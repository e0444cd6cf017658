"""The Hugging Face configuration of hybridtitan's own model class (``model_type: hybridtitan``).

One source of truth: ``model_args`` holds the ModelArgs exactly as ``model_args.json`` does in a DCP step folder;
the usual Hugging Face names (vocab_size, hidden_size, num_hidden_layers) are derived from it for tools that read
them, and are never read back.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil

from transformers import PreTrainedConfig

from hybridtitan.models.args import ModelArgs, model_args_from_dict, model_args_to_dict

# For trust_remote_code: a saved folder's auto_map names these two files, and they and the files they import are
# this package's own modules written flat into the folder (hybridtitan.hf.remote): it loads without hybridtitan.
# Where hybridtitan is imported, its registration gives the classes of this package instead.
AUTO_MAP = {
    "AutoConfig": "configuration_hybridtitan.HybridTitanConfig",
    "AutoModelForCausalLM": "modeling_hybridtitan.HybridTitanForCausalLM",
}
ENTRY_FILES = ("configuration_hybridtitan.py", "modeling_hybridtitan.py")


def is_model_code(name: str) -> bool:
    """Whether a file name is one of an export's code files (the entry points or a flat hybridtitan module)."""
    return name in ENTRY_FILES or (name.startswith("hybridtitan_") and name.endswith(".py"))


def write_model_code(folder: str) -> None:
    """The model's code into ``folder``: written from the package's modules, or, where this module is itself an
    export's copy (loaded by trust_remote_code), copied from the folder it came from."""
    if __name__.startswith("hybridtitan."):  # the package (imported by name: an export's copy cannot import it)
        importlib.import_module("hybridtitan.hf.remote").write_model_code(folder)
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if is_model_code(name) and not os.path.samefile(here, folder):
            shutil.copyfile(os.path.join(here, name), os.path.join(folder, name))


@contextlib.contextmanager
def without_auto_class(obj):
    """transformers' save_pretrained copies the source file of a class registered for an Auto class
    (``register_for_auto_class``, as a trust_remote_code load does) and points auto_map at it: for this package's
    classes that would be a module importing hybridtitan, under its own name. Saving with ``_auto_class`` unset
    skips that, and the model's code (write_model_code) and AUTO_MAP are written instead."""
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
        use_fla_kernels: bool = True,
        **kwargs,
    ):
        self.model_args = dict(model_args or {})
        # the model's recurrences, norms and convolutions in FLA's Triton kernels where FLA imports and the tensors
        # are on a GPU; False keeps a GPU on the PyTorch forms (from_pretrained(..., use_fla_kernels=False))
        self.use_fla_kernels = use_fla_kernels
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
        if not self.model_args:
            raise ValueError("this hybridtitan config has no model_args")
        return model_args_from_dict(self.model_args)

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        """Also writes the model's code that auto_map names (write_model_code), so that the folder loads with
        trust_remote_code where hybridtitan is not installed."""
        self.auto_map = dict(AUTO_MAP)
        if self.model_args and getattr(self, "vocab_size", None) not in (None, self.model_args.get("vocab_size")):
            # resize_token_embeddings sets vocab_size: the folder's model is the resized one
            self.model_args["vocab_size"] = self.vocab_size
        with without_auto_class(self):
            super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        write_model_code(save_directory)

    @classmethod
    def from_model_args(cls, args: ModelArgs, **kwargs) -> HybridTitanConfig:
        return cls(model_args=model_args_to_dict(args), **kwargs)
