"""The model zoo: HybridLM built from a pattern string, its sublayers and the named flavors."""

from .args import GDNArgs, GQAArgs, KDAArgs, Mamba2Args, MLAArgs, ModelArgs
from .flavors import FLAVORS, get_flavor
from .model import HybridLM, InferenceCache, build_model

__all__ = [
    "GDNArgs", "GQAArgs", "KDAArgs", "Mamba2Args", "MLAArgs", "ModelArgs", "FLAVORS", "get_flavor", "HybridLM",
    "InferenceCache", "build_model",
]
