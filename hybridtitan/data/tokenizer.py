"""The tokenizer: any Hugging Face fast tokenizer, loaded from a local folder (or the hub when online)."""

from __future__ import annotations

import hashlib
import json
import os

from .config import looks_local, resolve_path


def build_tokenizer(path: str):
    """A transformers PreTrainedTokenizerFast from a local folder or a hub name.
    Raises ValueError("data.tokenizer: ...") in one line if the folder is missing or nothing loads from it."""
    from transformers import AutoTokenizer

    if not path:
        raise ValueError("data.tokenizer: no tokenizer given")
    local = resolve_path(path)
    if looks_local(path) and not os.path.isdir(local):
        raise ValueError(f"data.tokenizer: no such folder: {path}")
    try:
        tok = AutoTokenizer.from_pretrained(local)
    except Exception as e:  # noqa: BLE001 -- any failure is reported as one line naming the field
        reason = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
        if not os.path.isdir(local):  # a hub name, or a mistyped folder: say both were tried
            reason = f"no such local folder, and from the Hugging Face Hub: {reason}"
        raise ValueError(f"data.tokenizer: cannot load a tokenizer from {path}: {reason}") from None
    if not getattr(tok, "is_fast", False):
        # Slow (Python) tokenizers are far too slow to tokenize on the fly during training.
        raise ValueError(f"data.tokenizer: {path} gives a slow tokenizer; a fast (tokenizer.json) one is required")
    eos_id(tok)  # fail now, not in the first batch
    return tok


def vocab_mismatch(tok, vocab_size: int) -> str | None:
    """Why ``tok`` cannot feed a model of ``vocab_size`` token embeddings, or None if it can."""
    if len(tok) > vocab_size:
        return f"tokenizer vocabulary ({len(tok)}) is larger than the model's vocab_size ({vocab_size})"
    return None


def eos_id(tok) -> int:
    """The token packing puts after every document: EOS, else BOS (some tokenizers define only one)."""
    for name in ("eos_token_id", "bos_token_id"):
        token_id = getattr(tok, name, None)
        if token_id is not None:
            return int(token_id)
    raise ValueError("data.tokenizer: the tokenizer has neither an eos nor a bos token; packing needs one "
                     "to mark where each document ends")


def encode_batch(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens (packing adds the EOS). One batched call: the Rust
    tokenizer spreads it over threads."""
    if not texts:
        return []
    return tok(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]


def vocabulary_fingerprint(tokenizer) -> str:
    """A short hash of a tokenizer's token -> id map and special tokens: equal for tokenizers that encode alike (a
    data manifest's, a checkpoint's and a distillation teacher's are compared with data.tokenizer's)."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = {k: v for k, v in sorted(tokenizer.special_tokens_map.items()) if isinstance(v, str)}
    return hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()[:16]
