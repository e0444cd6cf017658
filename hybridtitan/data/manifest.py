"""What scripts/prepare_data.py wrote, beside its shards: ``PREFIX.manifest.json``, and the checks the trainer makes
of Megatron shards against it before anything is written.

The manifest names the tokenizer (its path and a fingerprint of its vocabulary), the EOD id, the source, and every
shard with its documents and tokens. It is written when a preparation starts (``complete: false``), rewritten as
each shard is finished, and marked complete last: a preparation that was cut short is recognisable, and
``prepare_data.py --resume`` goes on from its finished shards. Shards made by other tools (Primus's, Megatron's)
have no manifest: they load, with a warning that nothing of them can be checked.
"""

from __future__ import annotations

import glob
import json
import os
import re

FORMAT = "hybridtitan data manifest"
VERSION = 1
SUFFIX = ".manifest.json"


def manifest_path(output: str) -> str:
    """The manifest of a preparation whose --output is ``output`` (shards ``output_00000``, ...)."""
    return output + SUFFIX


def owner_prefix(prefix: str) -> str:
    """The --output a shard prefix came from: ``data/x/shard_00003`` and ``data/x/shard-validation`` ->
    ``data/x/shard``."""
    return re.sub(r"(_\d{5}|-validation)$", "", prefix)


def read(path: str) -> dict | None:
    """A manifest, or None where the file is missing; ValueError for a damaged one."""
    try:
        with open(path) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"data.path: cannot read {path}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"data.path: {path} is not a hybridtitan data manifest")
    return manifest


def write(path: str, manifest: dict) -> None:
    """Written whole and renamed into place: a reader never sees half of one."""
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, **manifest}, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def shard_entry(manifest: dict, prefix: str) -> dict | None:
    """The manifest's entry for a shard prefix (a training shard or the validation one), None if it lists none."""
    name = os.path.basename(prefix)
    entries = list(manifest.get("shards") or []) + ([manifest["validation"]] if manifest.get("validation") else [])
    return next((e for e in entries if e.get("prefix") == name), None)


def bins_without_index(path_item: str) -> list[str]:
    """The .bin files a data.path item (a prefix or a glob) names whose .idx is missing."""
    item = path_item[:-4] if path_item.endswith((".bin", ".idx")) else path_item
    bins = glob.glob(item + ".bin") if any(c in item for c in "*?[") else [item + ".bin"]
    return sorted(b for b in bins if os.path.isfile(b) and not os.path.isfile(b[:-4] + ".idx"))


def check_shards(prefixes: list[str], fingerprint: str | None, what: str = "data.path") -> list[str]:
    """Megatron shards against their manifests: ValueError (one line) for a shard of an interrupted preparation,
    one its manifest does not list, or one tokenized with another tokenizer than ``fingerprint`` (None: not
    compared); returns the warnings to log (shards without a manifest)."""
    unchecked = []
    for prefix in prefixes:
        path = manifest_path(owner_prefix(prefix))
        manifest = read(path)
        if manifest is None:
            unchecked.append(prefix)
            continue
        if not manifest.get("complete"):
            raise ValueError(f"{what}: {prefix} is from a preparation that did not finish ({path} says incomplete):"
                             " run scripts/prepare_data.py again with --resume, or give the finished shards alone")
        if shard_entry(manifest, prefix) is None:
            raise ValueError(f"{what}: {prefix} is not a shard that {path} lists: a stale file of another "
                             "preparation?")
        made_with = (manifest.get("tokenizer") or {}).get("fingerprint")
        if fingerprint is not None and made_with is not None and made_with != fingerprint:
            raise ValueError(f"{what}: {prefix} was tokenized with {manifest['tokenizer'].get('name')} "
                             f"(vocabulary {made_with}), not with data.tokenizer (vocabulary {fingerprint}): the same "
                             "ids would mean other tokens")
    if not unchecked:
        return []
    shown = ", ".join(unchecked[:2]) + (f" and {len(unchecked) - 2} more" if len(unchecked) > 2 else "")
    return [f"{what}: {shown} ha{'s' if len(unchecked) == 1 else 've'} no manifest of scripts/prepare_data.py "
            "(made by another tool?): their tokenizer and completeness cannot be checked"]
