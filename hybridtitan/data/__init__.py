"""Data: tokenizer, document sources (Hugging Face datasets, Megatron .bin/.idx, mock), packing, and the
exactly resumable loader."""

from .config import Data, validate_data_config
from .loader import HeldOut, build_dataloader
from .megatron import MegatronDataset, MegatronWriter
from .packing import cu_seqlens, document_starts
from .tokenizer import build_tokenizer, eos_id

__all__ = [
    "Data",
    "HeldOut",
    "MegatronDataset",
    "MegatronWriter",
    "build_dataloader",
    "build_tokenizer",
    "cu_seqlens",
    "document_starts",
    "eos_id",
    "validate_data_config",
]
