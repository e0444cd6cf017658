"""Hugging Face integration: hybridtitan's own model class (``model_type: hybridtitan``) and its cache.

Importing this package registers HybridTitanConfig and HybridTitanForCausalLM with transformers' AutoConfig
and AutoModelForCausalLM, so ``AutoModelForCausalLM.from_pretrained(export_dir)`` loads an export once
hybridtitan is imported; without that import, ``trust_remote_code=True`` finds the classes through the export's
``auto_map`` (whose two small files import hybridtitan: it must be installed). Pure GDN and KDA models are
exported in FLA's own layouts instead (see hybridtitan.hf.convert).
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration import HybridTitanConfig
from .modeling import HybridCache, HybridTitanForCausalLM, HybridTitanPreTrainedModel

AutoConfig.register(HybridTitanConfig.model_type, HybridTitanConfig, exist_ok=True)
AutoModelForCausalLM.register(HybridTitanConfig, HybridTitanForCausalLM, exist_ok=True)

__all__ = ["HybridTitanConfig", "HybridTitanForCausalLM", "HybridTitanPreTrainedModel", "HybridCache"]
