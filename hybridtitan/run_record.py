"""The run record: what a training run keeps of its tokenizer and data in each checkpoint's job_config.json, and the
comparison a resume makes with it, before anything is written.

    job_dict.update(record(cfg.data, tokenizer))    the trainer: {"tokenizer_fingerprint": ..., "data_identity": ...}
    check_tokenizer(step_dir, cfg.data, tokenizer)   preflight: ConfigError (one line) where the tokenizer differs
    check_data(step_dir, cfg.data)                   preflight: ConfigError (one line) where the data differs

The tokenizer is recorded by its vocabulary's fingerprint and the data by its files' names and sizes, so a moved
folder of the same tokenizer or files is the same. A step folder without a record (an import's or an upcycling's,
which have no job_config.json) is compared by the tokenizer it holds; nothing is compared where nothing was recorded.
"""

from __future__ import annotations

import os

from hybridtitan.checkpoint import read_job_config
from hybridtitan.data import build_tokenizer
from hybridtitan.data.config import local_data_files, looks_local, megatron_prefixes, resolve_path
from hybridtitan.data.tokenizer import vocabulary_fingerprint
from hybridtitan.errors import ConfigError
from hybridtitan.model_folder import read_folder

TOKENIZER_FINGERPRINT = "tokenizer_fingerprint"
DATA_IDENTITY = "data_identity"


def record(data, tokenizer) -> dict:
    """The run record of a run reading the [data] section ``data`` with ``tokenizer`` (None: a run without one,
    such as mock data: no fingerprint)."""
    saved = {TOKENIZER_FINGERPRINT: vocabulary_fingerprint(tokenizer)} if tokenizer is not None else {}
    saved[DATA_IDENTITY] = data_identity(data)
    return saved


def data_files(data) -> list[str]:
    """The files a [data] section reads (Megatron prefixes, or local files of the hf source), absolute; [] for a
    hub dataset or mock data."""
    if data.source == "megatron":
        return [os.path.abspath(p) for p in megatron_prefixes(data.path)]
    if data.source == "hf" and data.path and looks_local(data.path) and not os.path.isdir(resolve_path(data.path)):
        return [os.path.abspath(p) for p in local_data_files(data.path)]
    return []


SLICE = "document_slice"


def data_identity(data) -> list:
    """What a [data] section reads, as a resume compares it: each file's name and size (a Megatron shard's .bin),
    else the source and path (a hub dataset, mock data). A moved folder of the same files is the same data. A
    data.document_slice other than the whole adds ["document_slice", start, end, document_slice_seed]: another
    slice of the same files is other documents."""
    files = data_files(data)
    if not files:
        identity = [data.source, data.path]
    else:
        identity = [[os.path.basename(f), os.path.getsize(f + ".bin" if data.source == "megatron" else f)]
                    for f in files]
    if data.sliced():
        start, end = data.document_slice
        identity.append([SLICE, float(start), float(end), int(data.document_slice_seed)])
    return identity


def _split_slice(identity: list) -> tuple[list, list | None]:
    """(the files part of an identity, its slice entry or None: the whole data)."""
    if identity and isinstance(identity[-1], list) and identity[-1][:1] == [SLICE]:
        return identity[:-1], identity[-1]
    return identity, None


def _saved_record(step_dir: str) -> dict | None:
    """The job config a step folder was saved with, which holds its run record; None where it has none (written by
    other tools, an import) or it cannot be read."""
    try:
        saved = read_job_config(step_dir)
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def check_data(step_dir: str, data) -> None:
    """A resume that loads the data loader's position reads the data that position was taken in: with other files
    it would index other documents, silently. Refused unless the loader's state is left out (the new data then
    starts at its beginning); a checkpoint saved without a record of its data is not compared."""
    saved = (_saved_record(step_dir) or {}).get(DATA_IDENTITY)
    if saved is None:
        return
    now = data_identity(data)
    (saved_files, saved_slice), (now_files, now_slice) = _split_slice(saved), _split_slice(now)
    if saved_files == now_files and saved_slice != now_slice:
        def show_slice(entry):
            return "all of it" if entry is None else f"[{entry[1]}, {entry[2]}) seed {entry[3]}"
        raise ConfigError(f"cannot resume from {step_dir}: data.document_slice takes other documents of the data than "
                          f"the run it continues ({show_slice(saved_slice)} then, {show_slice(now_slice)} now), so "
                          "the loader's saved position would index other documents; to train on the new slice from "
                          "its beginning, say so: --checkpoint.exclude_from_loading dataloader")
    if saved != now:
        saved, now = saved_files, now_files
        def show(identity):
            names = [f[0] if isinstance(f, list) else str(f) for f in identity]
            return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise ConfigError(f"cannot resume from {step_dir}: data.path reads other data than the run it continues "
                          f"({show(saved)} then, {show(now)} now), so the loader's saved position would index other "
                          "documents; to train on the new data from its beginning, say so: "
                          "--checkpoint.exclude_from_loading dataloader")


def check_tokenizer(step_dir: str, data, tokenizer) -> None:
    """The checkpoint was trained (or imported) with a tokenizer of the vocabulary of ``tokenizer``, data.tokenizer:
    its record's fingerprint, else (no record) the tokenizer the folder holds; nothing to compare with, no check."""
    saved = _saved_record(step_dir)
    if saved is not None:
        fingerprint = saved.get(TOKENIZER_FINGERPRINT)
    else:
        fingerprint = _fingerprint_at(read_folder(step_dir).tokenizer)
    if fingerprint is not None and fingerprint != vocabulary_fingerprint(tokenizer):
        raise ConfigError(f"{step_dir} was trained with another tokenizer than data.tokenizer ({data.tokenizer}): the "
                          "same ids would mean other tokens (checkpoint.allow_tokenizer_change = true starts from it "
                          "all the same)")


def _fingerprint_at(path: str | None) -> str | None:
    """The vocabulary fingerprint of the tokenizer at ``path``; None where there is none or it does not load."""
    if not path:
        return None
    try:
        return vocabulary_fingerprint(build_tokenizer(path))
    except ValueError:
        return None
