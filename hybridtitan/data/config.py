"""The `[data]` section of a recipe, and its validation (one clear line per mistake, naming the field).

(No `from __future__ import annotations`: the field types must stay real types for the recipe checks.)"""

import glob
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

SOURCES = ("hf", "megatron", "mock")

# Local data files the "hf" source reads, by extension, and the `datasets` builder that reads each.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")
GLOB_CHARS = "*?["


@dataclass(frozen=True)
class Data:
    tokenizer: str = "hybridtitan/assets/tokenizer"
    """Tokenizer: a local Hugging Face tokenizer folder, or a hub name when online"""

    source: str = "hf"
    """Where documents come from: "hf" (datasets.load_dataset), "megatron" (.bin/.idx indexed datasets) or
    "mock" (random tokens, for smoke tests and benchmarks)"""

    path: str = ""
    """hf: a hub dataset name, a local folder, or local files (a file or a glob of .json/.jsonl/.parquet/.txt);
    megatron: one or more comma-separated path prefixes (without .bin/.idx; a prefix may be a glob)"""

    name: str = ""
    """hf: the dataset's config name (e.g. "sample-10BT" for HuggingFaceFW/fineweb-edu)"""

    split: str = "train"
    """hf: the split to read"""

    text_field: str = "text"
    """hf: the column that holds each document's text"""

    streaming: bool = False
    """hf: stream the dataset instead of downloading it whole (resume is exact only with shuffle off)"""

    document_boundaries: bool = False
    """Also return cu_seqlens, so that no recurrent state or attention crosses a document boundary"""

    shuffle: bool = True
    """Visit documents in a seeded random order, reshuffled every epoch"""

    num_workers: int = 0
    """DataLoader worker processes (0: load in the training process); resume needs the same value"""

    document_slice: list[float] = field(default_factory=lambda: [0.0, 1.0])
    """[start, end): the fraction of the documents to read (0 <= start < end <= 1), taken from one permutation of
    them seeded by document_slice_seed, before they are split over ranks and workers: runs given [0.0, 0.2] and
    [0.2, 1.0] read disjoint documents that together are all of them, on any number of ranks. [0.0, 1.0]: all, in
    the files' order (no permutation). Not with data.streaming"""

    document_slice_seed: int = 42
    """Seed of the permutation document_slice takes its fraction of (the same in every stage that shares the
    data; independent of the training seed)"""

    def sliced(self) -> bool:
        """Whether document_slice keeps less than all of the documents."""
        return list(self.document_slice) != [0.0, 1.0]


def recorded_path(path: str) -> str:
    """How a run records a local path (job_config.json), for export and evaluation run from another directory:
    a relative path that exists here made absolute; the package's own ("hybridtitan/assets/...") and hub names
    kept as given (the first resolve to the installed package anywhere, see resolve_path)."""
    if path.startswith("hybridtitan/") or os.path.isabs(path) or not os.path.exists(path):
        return path
    return os.path.abspath(path)


def resolve_path(path: str) -> str:
    """`path` as given if it exists; else, for a path inside the package (the default tokenizer and corpus,
    "hybridtitan/assets/..."), the installed package's copy, so recipes work from any working directory."""
    if os.path.exists(path) or not path.startswith("hybridtitan/"):
        return path
    packaged = Path(__file__).resolve().parents[2] / path
    return str(packaged) if packaged.exists() else path


def looks_local(path: str) -> bool:
    """Whether `path` names local files rather than a hub repository ("owner/name" or "name")."""
    if os.path.exists(path) or any(c in path for c in GLOB_CHARS):
        return True
    if path.startswith(("/", ".", "~")) or path.count("/") > 1:
        return True
    return file_builder(path) is not None


def file_builder(path: str) -> str | None:
    """The `datasets` builder for a data file ("json", "parquet", "text"), from its extension."""
    stem = path
    for compression in COMPRESSIONS:
        if stem.endswith(compression):
            stem = stem[: -len(compression)]
    return FILE_BUILDERS.get(os.path.splitext(stem)[1].lower())


def files_builder(files: list[str], path: str) -> str:
    """The one `datasets` builder of the files that `data.path` (``path``) names; ValueError if a file's type is
    unknown or the files are of more than one type (one builder reads them all)."""
    builders = {}
    for f in files:
        builder = file_builder(f)
        if builder is None:
            raise ValueError(f"data.path: cannot tell the file type of {f} (expected one of "
                             f"{', '.join(FILE_BUILDERS)})")
        builders.setdefault(builder, f)
    if len(builders) > 1:
        raise ValueError(f"data.path: {path} names files of more than one type ({', '.join(builders.values())}): "
                         "give files of one type")
    return next(iter(builders))


def local_data_files(path: str) -> list[str]:
    """The files a local file path or glob names (sorted), [] if none."""
    path = os.path.expanduser(resolve_path(path))
    if os.path.isfile(path):
        return [path]
    return sorted(p for p in glob.glob(path) if os.path.isfile(p))


def megatron_prefixes(path: str) -> list[str]:
    """Expand `data.path` for the megatron source into path prefixes: comma-separated, each a prefix or a glob
    matched against the .idx files. Raises ValueError naming the first prefix that has no .bin/.idx pair."""
    from .manifest import bins_without_index

    prefixes = []
    for item in (p.strip() for p in path.split(",")):
        if not item:
            continue
        item = os.path.expanduser(resolve_path(item))
        lonely = bins_without_index(item)
        if lonely:
            raise ValueError(f"data.path: {lonely[0]} has no .idx beside it (an interrupted preparation?): finish it "
                             "(scripts/prepare_data.py --resume) or remove the file")
        if item.endswith((".bin", ".idx")):
            item = item[:-4]
        if any(c in item for c in GLOB_CHARS):
            matched = sorted(p[:-4] for p in glob.glob(item + ".idx"))
            if not matched:
                raise ValueError(f"data.path: no Megatron .idx file matches {item}.idx")
        else:
            matched = [item]
        for prefix in matched:
            if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
                raise ValueError(f"data.path: no Megatron dataset at prefix {prefix} "
                                 f"(expected {prefix}.bin and {prefix}.idx)")
        prefixes.extend(matched)
    if not prefixes:
        raise ValueError("data.path: the megatron source needs one or more .bin/.idx path prefixes")
    return prefixes


def check_document_slice(cfg: Data) -> None:
    """data.document_slice is two fractions 0 <= start < end <= 1, data.document_slice_seed an integer >= 0;
    ValueError with one line otherwise."""
    bounds = cfg.document_slice
    numbers = isinstance(bounds, (list, tuple)) and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
    if not (numbers and len(bounds) == 2 and all(math.isfinite(b) for b in bounds)):
        raise ValueError(f"data.document_slice must be two fractions [start, end], got {bounds!r}")
    start, end = bounds
    if not 0 <= start < end <= 1:
        raise ValueError(f"data.document_slice must be [start, end] with 0 <= start < end <= 1, got {list(bounds)}")
    seed = cfg.document_slice_seed
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"data.document_slice_seed must be an integer >= 0, got {seed!r}")


def validate_data_config(cfg: Data) -> None:
    """Check the `[data]` section before anything is loaded; raises ValueError with one line naming the field."""
    if cfg.source not in SOURCES:
        raise ValueError(f"data.source must be one of {', '.join(SOURCES)} (got {cfg.source!r})")
    if cfg.num_workers < 0:
        raise ValueError(f"data.num_workers must be >= 0 (got {cfg.num_workers})")
    check_document_slice(cfg)
    if cfg.tokenizer and looks_local(cfg.tokenizer) and not os.path.isdir(resolve_path(cfg.tokenizer)):
        raise ValueError(f"data.tokenizer: no such folder: {cfg.tokenizer}")
    if not cfg.tokenizer and cfg.source != "mock":
        raise ValueError(f"data.tokenizer is required for the {cfg.source} source")
    if cfg.source == "hf":
        if not cfg.path:
            raise ValueError("data.path is required for the hf source (a hub dataset name, a folder or local files)")
        if not cfg.text_field:
            raise ValueError("data.text_field must name the column that holds the text")
        if looks_local(cfg.path):
            local = resolve_path(cfg.path)
            if not os.path.isdir(local):
                files = local_data_files(local)
                if not files:
                    raise ValueError(f"data.path: no such file or folder: {cfg.path}")
                files_builder(files, cfg.path)
        if cfg.streaming and cfg.sliced():
            raise ValueError(f"data.document_slice {list(cfg.document_slice)}: a slice needs random access to the "
                             "documents, which a stream has not (data.streaming = false)")
        if cfg.streaming and cfg.num_workers > 0:
            # datasets would shard the stream again inside each worker, by its own rules; one process keeps the
            # order (and the resume) ours.
            raise ValueError("data.num_workers must be 0 with data.streaming")
    elif cfg.source == "megatron":
        megatron_prefixes(cfg.path)
