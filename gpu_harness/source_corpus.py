"""A corpus larger than a short run's tokens, made with no network: the Python source files of the packages this
interpreter has installed (site-packages), one document per file. Loss comparisons on it (float8 against bf16)
see each document at most once, where the shipped corpus (about 515k tokens) repeats within a few hundred steps and
is memorised.

    python gpu_harness/source_corpus.py /tmp/source_corpus --megabytes 40
    ... --data.source hf --data.path /tmp/source_corpus --data.tokenizer hybridtitan/assets/tokenizer

Files are read as UTF-8 (others are skipped), exact duplicates dropped, files under 200 bytes or over 1 MB (generated
tables) skipped, and the documents ordered by the SHA-256 of their text, so that one set of installed packages gives
the same files on every machine; a document whose hash is 0 modulo 100 goes to validation.jsonl. The corpus stops at
--megabytes of text. It prints the documents, the characters and, with --tokenizer, the tokens of train.jsonl.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import sysconfig

MIN_BYTES, MAX_BYTES = 200, 1_000_000


def source_files() -> list[pathlib.Path]:
    roots = sorted({pathlib.Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")})
    return sorted(p for root in roots if root.is_dir() for p in root.rglob("*.py"))


def documents(megabytes: float) -> list[tuple[str, str]]:
    docs = {}  # digest -> text: each text once
    for path in source_files():
        try:
            size = path.stat().st_size
            if not MIN_BYTES <= size <= MAX_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        docs.setdefault(hashlib.sha256(text.encode()).hexdigest(), text)
    kept, total = [], 0
    for digest, text in sorted(docs.items()):
        total += len(text.encode())
        if total > megabytes * 1e6:
            break
        kept.append((digest, text))
    return kept


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output", help="folder for train.jsonl and validation.jsonl")
    p.add_argument("--megabytes", type=float, default=40.0,
                   help="at most this much text (default 40: about 20M tokens with the shipped tokenizer)")
    p.add_argument("--tokenizer", default=None, help="count train.jsonl's tokens with this tokenizer folder")
    args = p.parse_args(argv)
    kept = documents(args.megabytes)
    if not kept:
        print("error: no Python source files found in this interpreter's site-packages", file=sys.stderr)
        return 2
    out = pathlib.Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    splits = {"train": [], "validation": []}
    for digest, text in kept:
        splits["validation" if int(digest, 16) % 100 == 0 else "train"].append(text)
    for name, rows in splits.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for text in rows:
                f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        print(f"{name}: {len(rows)} documents, {sum(map(len, rows)):,} characters")
    if args.tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        n = sum(len(ids) for ids in tok(splits["train"], add_special_tokens=False)["input_ids"])
        print(f"train: {n:,} tokens ({args.tokenizer})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
