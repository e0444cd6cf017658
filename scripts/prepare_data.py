"""Tokenize a text dataset once into Megatron .bin/.idx shards, for `data.source = "megatron"`.

    # FineWeb-Edu, 10B-token sample (online):
    python scripts/prepare_data.py --dataset HuggingFaceFW/fineweb-edu --name sample-10BT \\
        --tokenizer hybridtitan/assets/tokenizer --output data/fineweb_edu/train --workers 32
    # local files (offline):
    python scripts/prepare_data.py --dataset "corpus/*.jsonl" --tokenizer hybridtitan/assets/tokenizer \\
        --output data/corpus/train

writes PREFIX_00000.bin/.idx, PREFIX_00001.bin/.idx, ... (a new shard every --shard-size-tokens tokens) and
PREFIX.manifest.json (the tokenizer and a fingerprint of its vocabulary, the EOD id, the source, each shard's
documents and tokens; marked complete last: the trainer refuses an unfinished preparation and shards of another
tokenizer, and --resume goes on from the finished shards of one cut short), then prints the `data.path` to train
on; with --validation N (a count, or a fraction below 1) the held-out documents
go to PREFIX-validation.bin/.idx instead, the `validation.data.path`. Each document is one sequence of its tokens,
with NO EOS: packing
(hybridtitan/data/packing.py) appends EOS after every document, for this data and for text tokenized on the
fly alike. Empty documents are left out. Without --streaming the dataset is downloaded (FineWeb-Edu sample-10BT:
about 30 GB) and its tokens are cached by datasets (4 bytes a token) before the shards (2 bytes a token for
vocabularies under 65500) are written.

With --chat-template (zebra: Zebra-Llama's template, shipped in hybridtitan/assets/chat_templates/; tokenizer: the
tokenizer's own; or a .jinja file) each row's `messages` column, a list of {"role", "content"}, is rendered to text
through the template (as tokenizer.apply_chat_template(messages, tokenize=False) renders it) and that text is
tokenized instead of --text-field.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from hybridtitan.cli import fail as _fail  # noqa: E402
from hybridtitan.data import manifest  # noqa: E402
from hybridtitan.data.chat import read_template  # noqa: E402
from hybridtitan.data.chat import render as render_chat  # noqa: E402
from hybridtitan.data.config import Data  # noqa: E402
from hybridtitan.data.megatron import MegatronWriter  # noqa: E402
from hybridtitan.data.sources import load_hf_dataset  # noqa: E402
from hybridtitan.data.tokenizer import build_tokenizer, encode_batch, eos_id, vocabulary_fingerprint  # noqa: E402

BATCH = 1000
MESSAGES = "messages"  # the column --chat-template renders
KEY = "--chat-template"  # how its errors start


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", required=True,
                   help="hub dataset name, local folder, or local file/glob (.json/.jsonl/.parquet/.txt)")
    p.add_argument("--name", default="", help="dataset config name (e.g. sample-10BT)")
    p.add_argument("--split", default="train")
    p.add_argument("--text-field", "--text_field", dest="text_field", default="text")
    p.add_argument("--tokenizer", required=True, help="tokenizer folder or hub name")
    p.add_argument("--output", required=True, help="output path prefix: PREFIX_00000.bin/.idx, ...")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                   help="tokenizer processes (datasets .map num_proc)")
    # each option also takes the underscore spelling of the trainer, export_hf and eval
    p.add_argument("--shard-size-tokens", "--shard_size_tokens", dest="shard_size_tokens", type=int,
                   default=1_000_000_000, help="tokens per output shard")
    p.add_argument("--limit-docs", "--limit_docs", dest="limit_docs", type=int, default=0,
                   help="only the first N documents (0: all)")
    p.add_argument("--validation", type=_held_out, default=0,
                   help="hold out documents for validation into PREFIX-validation.bin/.idx: a count (the first N) "
                        "or a fraction below 1 (spread evenly over the dataset)")
    p.add_argument("--resume", action="store_true",
                   help="go on from an interrupted preparation of the same --output (its manifest says incomplete): "
                        "its finished shards are kept, the rest written again")
    p.add_argument("--streaming", action="store_true",
                   help="stream the dataset (no full download; tokenizes in this process, with threads)")
    p.add_argument("--chat-template", "--chat_template", dest="chat_template", default=None,
                   help="render each row's `messages` column (a list of {role, content}) to text through a chat "
                        "template before tokenizing: zebra (Zebra-Llama's: Llama 3 headers, no system block), "
                        "tokenizer (the tokenizer's own), or a .jinja file")
    p.add_argument("--cache-dir", "--cache_dir", dest="cache_dir", default=None,
                   help="datasets' cache of the download and of the tokens (4 bytes a token) until the shards are "
                        "written (default: datasets' own, under HF_HOME)")
    return p.parse_args(argv)


def _held_out(text: str) -> float:
    value = float(text)
    if value < 0 or (value >= 1 and value != int(value)):
        raise argparse.ArgumentTypeError(f"must be a count of documents or a fraction below 1, got {text}")
    return value


def held_out(index: int, validation: float) -> bool:
    """Whether document ``index`` (among the non-empty ones) goes to the validation set."""
    if validation >= 1:
        return index < validation
    return int((index + 1) * validation) > int(index * validation)


def chat_template(spec: str, tok) -> str | None:
    """The Jinja text of --chat-template ``spec`` (hybridtitan.data.chat.read_template)."""
    return read_template(spec, tok, KEY)


def render(tok, template: str | None, messages, row) -> str:
    """The text of one conversation through the template (hybridtitan.data.chat.render), naming the row."""
    return render_chat(tok, template, messages, f"row {row}", KEY, MESSAGES)


def texts_of(tok, template, field, batch: dict, start: int) -> list[str]:
    """The texts of one batch of rows: the text field, or each conversation rendered."""
    if template is False:
        return [t or "" for t in batch[field]]
    return [render(tok, template, m, start + i) for i, m in enumerate(batch[MESSAGES])]


def tokenized_batches(args, tok, template=False):
    """(number of documents or None, iterator over lists of token-id lists). ``template``: False (the text field),
    else chat_template()'s answer, rendered from the messages column; its first row is rendered here, before
    anything is written."""
    chat = template is not False
    cfg = Data(tokenizer=args.tokenizer, source="hf", path=args.dataset, name=args.name, split=args.split,
               text_field=MESSAGES if chat else args.text_field, streaming=args.streaming)
    try:
        ds = load_hf_dataset(cfg, cache_dir=args.cache_dir)
    except ValueError as e:
        if chat and str(e).startswith("data.text_field:"):
            raise ValueError("--chat-template:" + str(e).partition(":")[2]) from None
        raise
    field = args.text_field
    if chat:
        first = next(iter(ds.take(1) if args.streaming else ds.select(range(min(1, len(ds))))), None)
        if first is None:
            raise ValueError(f"--dataset: {args.dataset} has no rows")
        if MESSAGES not in first:  # a streamed dataset whose columns are known only from its rows
            raise ValueError(f"--chat-template: no column {MESSAGES!r} in {args.dataset} "
                             f"(columns: {', '.join(first)})")
        render(tok, template, first[MESSAGES], 0)
    if args.streaming:
        if args.limit_docs:
            ds = ds.take(args.limit_docs)
        batches = (encode_batch(tok, texts_of(tok, template, field, b, i * BATCH))
                   for i, b in enumerate(ds.iter(batch_size=BATCH)))
        return args.limit_docs or None, batches
    if args.limit_docs:
        ds = ds.select(range(min(args.limit_docs, len(ds))))
    if args.workers > 1:
        # Each .map process tokenizes on its own; Rust threads inside forked processes would only contend.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import datasets

    # int32 ids in the map's cache (datasets would store int64): 4 bytes a token on disk until the shards are written.
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))})
    # with a template every row is rendered here, before the first write, with its index for a malformed one's error
    ds = ds.map(lambda b, rows: {"input_ids": encode_batch(tok, texts_of(tok, template, field, b, rows[0]))},
                batched=True, with_indices=True, batch_size=BATCH,
                num_proc=args.workers if args.workers > 1 else None, remove_columns=ds.column_names,
                features=features, desc="rendering and tokenizing" if chat else "tokenizing")
    return len(ds), (b["input_ids"] for b in ds.iter(batch_size=BATCH))


# the trainer's keys that begin the data module's messages, as this script's options
_OPTION_OF = {"data.path": "--dataset", "data.tokenizer": "--tokenizer", "data.text_field": "--text-field",
              "data.name": "--name", "data.split": "--split"}


def fail(message: str) -> None:
    """One line on stderr and exit status 2 (export_hf's fail, as the other tools), in this script's options."""
    key, colon, rest = message.partition(":")
    if colon and key in _OPTION_OF:
        message = _OPTION_OF[key] + colon + rest
    _fail(message)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.shard_size_tokens < 1:
        fail("--shard-size-tokens must be positive")
    path = manifest.manifest_path(args.output)
    try:
        earlier = manifest.read(path)
    except ValueError as e:
        fail(str(e))
    existing = sorted(glob.glob(glob.escape(args.output) + "_[0-9][0-9][0-9][0-9][0-9].*"))
    if args.resume and (earlier is None or earlier.get("complete")):
        fail(f"--resume: {path} is {'complete' if earlier else 'missing'}: nothing to resume")
    if existing and not args.resume:
        # A stale shard from an earlier run would be picked up by the PREFIX_* glob and mixed into training.
        hint = " (--resume goes on from an interrupted one)" if earlier is not None and not earlier.get("complete") \
            else ""
        fail(f"{existing[0]} already exists: remove the old shards or choose another --output{hint}")
    try:
        tok = build_tokenizer(args.tokenizer)
        # the template read and parsed, the messages column found and its first row rendered: before any output
        template = chat_template(args.chat_template, tok) if args.chat_template else False
        total, batches = tokenized_batches(args, tok, template)
    except ValueError as e:
        fail(str(e))
    source = {"dataset": args.dataset, "name": args.name, "split": args.split, "text_field": args.text_field,
              "limit_docs": args.limit_docs, "validation": args.validation, "shard_size_tokens": args.shard_size_tokens}
    if args.chat_template:  # which template, and a hash of its text: a --resume with another one is refused
        text = tok.chat_template if template is None else template
        source["chat_template"] = {"name": args.chat_template,
                                   "sha256": hashlib.sha256(str(text).encode()).hexdigest()[:16]}
    record = {"complete": False, "source": source,
              "tokenizer": {"name": args.tokenizer, "fingerprint": vocabulary_fingerprint(tok), "vocab_size": len(tok),
                            "eod_id": eos_id(tok)},
              "shards": [], "validation": None, "documents": 0, "tokens": 0, "empty_documents": 0}
    done_docs = 0
    if args.resume:
        if earlier["source"] != source or earlier["tokenizer"]["fingerprint"] != record["tokenizer"]["fingerprint"]:
            fail(f"--resume: {path} was started with other options or another tokenizer; start again elsewhere")
        record["shards"] = earlier["shards"]
        done_docs = sum(s["documents"] for s in record["shards"])
        finished = {os.path.join(os.path.dirname(args.output), s["prefix"]) for s in record["shards"]}
        for f in existing:  # the shard that was being written, and the held-out one, start again
            if f.rsplit(".", 1)[0] not in finished:
                os.remove(f)
        print(f"resuming: {len(finished)} finished shard(s), {done_docs} documents, kept")
    manifest.write(path, record)

    from tqdm import tqdm

    start, docs, empty, tokens = time.time(), 0, 0, 0
    writer, validation, seen = None, None, 0
    shards = [s["prefix"] for s in record["shards"]]
    shard_docs = shard_tokens = 0

    def finish(w) -> None:
        w.finalize()
        record["shards"].append({"prefix": os.path.basename(w.prefix), "documents": shard_docs, "tokens": shard_tokens})
        manifest.write(path, record)  # a shard finished: a resume keeps it

    stopped = []  # with --streaming a conversation is rendered as it is read: the error of a malformed one

    def rendered(batches):
        try:
            yield from batches
        except ValueError as e:
            stopped.append(str(e))

    if args.chat_template and args.streaming:
        batches = rendered(batches)
    with tqdm(total=total, unit="doc", desc="writing", dynamic_ncols=True) as bar:
        for batch in batches:
            for ids in batch:
                if not ids:
                    empty += 1
                    continue
                seen += 1
                if args.validation and held_out(seen - 1, args.validation):
                    if validation is None:
                        validation = MegatronWriter(f"{args.output}-validation", vocab_size=len(tok))
                    validation.add_document(ids)
                    continue
                docs, tokens = docs + 1, tokens + len(ids)
                if docs <= done_docs:  # in a shard a resumed preparation keeps
                    continue
                if writer is None:
                    writer = MegatronWriter(f"{args.output}_{len(shards):05d}", vocab_size=len(tok))
                    shards.append(os.path.basename(writer.prefix))
                    shard_docs = shard_tokens = 0
                writer.add_document(ids)
                shard_docs, shard_tokens = shard_docs + 1, shard_tokens + len(ids)
                if writer.num_tokens >= args.shard_size_tokens:
                    finish(writer)
                    writer = None
            bar.update(len(batch))
            bar.set_postfix(tokens=f"{tokens / 1e6:.1f}M", shards=len(shards))
    if stopped:  # in one line, after the progress bar's; the shard being written is left unfinished
        fail(f"{stopped[0]} (the preparation stopped there: {path} says incomplete)")
    if writer is not None:
        finish(writer)
    if not shards:
        fail("no non-empty documents: nothing written")
    if validation is not None:
        validation.finalize()
        record["validation"] = {"prefix": os.path.basename(validation.prefix), "documents": seen - docs,
                                "tokens": validation.num_tokens}
    record.update(complete=True, documents=docs, tokens=tokens, empty_documents=empty)
    manifest.write(path, record)  # last: the preparation is complete
    print(f"{docs} documents, {tokens} tokens ({empty} empty documents left out) in {len(shards)} shard(s), "
          f"{time.time() - start:.0f} s; manifest {path}")
    print(f'train on them with:  [data] source = "megatron"  path = "{args.output}_*"')
    if validation is not None:
        print(f"{seen - docs} documents held out in {validation.prefix}.bin/.idx; validate on them with:  "
              f'[validation.data] source = "megatron"  path = "{validation.prefix}"')


if __name__ == "__main__":
    main()
