"""Hugging Face integration: hybridtitan's own model class (``model_type: hybridtitan``) and its cache.

Importing this package registers HybridTitanConfig and HybridTitanForCausalLM with transformers' AutoConfig
and AutoModelForCausalLM, so ``AutoModelForCausalLM.from_pretrained(export_dir)`` loads an export with these
classes once hybridtitan is imported, also with ``trust_remote_code=True`` (transformers 5.24, the release of
constraints-cpu.txt, prefers a class registered outside transformers to a folder's code). Without that import,
``trust_remote_code=True`` loads the export's own copy of this package's model code (``auto_map``; written by
hybridtitan.hf.remote, it needs no hybridtitan). Pure GDN and KDA models are exported in FLA's own layouts instead (see
hybridtitan.hf.convert).
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration import HybridTitanConfig
from .modeling import HybridCache, HybridTitanForCausalLM, HybridTitanPreTrainedModel

AutoConfig.register(HybridTitanConfig.model_type, HybridTitanConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridTitanConfig, HybridTitanForCausalLM, exist_ok=True)

__all__ = ["HybridTitanConfig", "HybridTitanForCausalLM", "HybridTitanPreTrainedModel", "HybridCache"]
