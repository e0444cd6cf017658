"""Preference pairs for DPO (hybridtitan.dpo). They are read, rendered through the chat template, tokenized and checked
whole before anything is written, then batched by an exactly resumable loader.

    pairs = read_pairs(cfg.dpo, tokenizer, max_length=seq_len)    ValueError (one line, naming the row and field)
    loader = preference_loader(pairs, local_batch_size=4, dp_rank=r, dp_world_size=w, seed=42)
    batch = next(iter(loader))   {"input_ids": [2B, T], "labels": [2B, T]}: rows [0, B) chosen, [B, 2B) rejected

A row holds a prompt, a chosen response and a rejected response (dpo.prompt_field, chosen_field, rejected_field). The
prompt is a text (the user's turn) or a list of {role, content} messages. A response is a text, or a list of messages.
In a list, the last message is the response (the assistant's), and the others, if any, are the prompt. Hugging Face's
ultrafeedback_binarized holds its pairs that way.

The template renders the prompt with the generation prompt, and the conversation with the response. The response's
tokens are what the second adds to the first. Each sequence is the prompt's tokens and then the response's, at most
``max_length`` (training.seq_len) in all. A longer response is cut to fit; the cuts are counted and the log says so. A
prompt that leaves no room for a response token is refused. The labels count only the response's tokens (IGNORE_INDEX
elsewhere). The rows are padded with EOS to ``max_length``.

Local .jsonl files are read here, line by line, and a line that is not JSON is refused with its number. Other files,
folders and hub datasets are read through datasets. The order is that of hybridtitan.data.sources: ShardedDocuments over
the pairs, a permutation seeded by (seed, epoch), with rank r of n taking positions r, r + n, .... The checkpointed
cursor is the same too, a few integers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from .chat import is_conversation, read_template, render
from .config import Data, local_data_files, looks_local, resolve_path
from .loader import IGNORE_INDEX
from .sources import ShardedDocuments, load_hf_dataset
from .tokenizer import encode_batch, eos_id, vocab_mismatch

STATE_VERSION = 1
BLOCK = 1000  # rows rendered and tokenized per call


@dataclasses.dataclass(frozen=True)
class Pairs:
    """Tokenized preference pairs: per pair the prompt's tokens and each response's."""

    prompts: list[np.ndarray]
    chosen: list[np.ndarray]
    rejected: list[np.ndarray]
    max_length: int
    pad: int  # the id the rows are padded with (EOS)
    truncated: int  # pairs whose response(s) were cut to max_length
    fingerprint: str  # what a checkpoint's loader state is checked against

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [2, T], labels [2, T]) of pair i: chosen then rejected."""
        ids = torch.full((2, self.max_length + 1), self.pad, dtype=torch.int64)
        labels = torch.full((2, self.max_length), IGNORE_INDEX, dtype=torch.int64)
        prompt = self.prompts[i]
        for row, response in enumerate((self.chosen[i], self.rejected[i])):
            n = len(prompt) + len(response)
            ids[row, :len(prompt)] = torch.from_numpy(prompt)
            ids[row, len(prompt):n] = torch.from_numpy(response)
            # position t predicts token t + 1: the response's tokens are predicted from len(prompt) - 1 on
            labels[row, len(prompt) - 1:n - 1] = ids[row, len(prompt):n]
        return ids[:, :-1], labels


def _local_jsonl(path: str) -> list[str] | None:
    """The .jsonl files ``path`` names, where it names only local .jsonl files (read here). Otherwise None."""
    if not looks_local(path) or os.path.isdir(resolve_path(path)):
        return None
    files = local_data_files(path)
    return files if files and all(f.endswith(".jsonl") for f in files) else None


def _rows(path: str, name: str, split: str, fields: tuple[str, ...], key: str):
    """(where, row) of every row: a .jsonl line ("FILE line N") or a dataset's row ("row N")."""
    files = _local_jsonl(path)
    if files is not None:
        for file in files:
            with open(file, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    where = f"{os.path.basename(file)} line {n}"
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{key}: {where}: not JSON ({e.msg} at column {e.colno})") from None
                    if not isinstance(row, dict):
                        raise ValueError(f"{key}: {where}: not a JSON object but {type(row).__name__}")
                    yield where, row
        return
    data = Data(path=path, name=name, split=split, text_field=fields[1], shuffle=False)
    try:
        ds = load_hf_dataset(data)
    except ValueError as e:
        raise ValueError(f"{key}:{str(e).partition(':')[2].replace('data.text_field', 'a field')}") from None
    missing = [f for f in fields if f and f not in ds.column_names]
    if missing:
        raise ValueError(f"{key}: no column {missing[0]!r} in {path} (columns: {', '.join(ds.column_names)})")
    for i, row in enumerate(ds):
        yield f"row {i}", row


def _split_row(where: str, row: dict, fields: tuple[str, str, str], key: str):
    """(prompt messages or text, chosen response, rejected response) of one row. Raises ValueError naming the row and
    field for a missing field, an empty response, or responses that continue different conversations."""
    prompt_field, chosen_field, rejected_field = fields
    responses, contexts = [], []
    for field in (chosen_field, rejected_field):
        value = row.get(field)
        if value is None:
            raise ValueError(f"{key}: {where}: no {field!r} field")
        if isinstance(value, list):
            if not is_conversation(value) or value[-1]["role"] != "assistant":
                raise ValueError(f"{key}: {where}: {field!r} must be a text or a list of {{\"role\", \"content\"}} "
                                 f"messages ending with the assistant's, got {str(value)[:80]!r}")
            contexts.append(value[:-1])
            value = value[-1]["content"]
        elif not isinstance(value, str):
            raise ValueError(f"{key}: {where}: {field!r} holds {type(value).__name__}, not a text or messages")
        else:
            contexts.append([])
        if not value.strip():
            raise ValueError(f"{key}: {where}: {field!r} is an empty response")
        responses.append(value)
    if contexts[0] != contexts[1]:
        raise ValueError(f"{key}: {where}: {chosen_field!r} and {rejected_field!r} continue different conversations")
    prompt = contexts[0] or row.get(prompt_field)
    if prompt is None:
        raise ValueError(f"{key}: {where}: no {prompt_field!r} field")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError(f"{key}: {where}: {prompt_field!r} is an empty prompt")
    elif not is_conversation(prompt):
        raise ValueError(f"{key}: {where}: {prompt_field!r} must be a text or a list of {{\"role\", \"content\"}} "
                         f"messages, got {str(prompt)[:80]!r}")
    return prompt, responses[0], responses[1]


def _texts(tok, template, where: str, prompt, response: str, key: str, field: str) -> tuple[str, str]:
    """(the prompt's text, the response's text), through the template, or as they are when template is False."""
    if template is False:
        if not isinstance(prompt, str):
            raise ValueError(f"{key}: {where}: dpo.chat_template none takes a prompt text, not messages")
        return prompt, response
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    head = render(tok, template, messages, where, key, field, add_generation_prompt=True)
    whole = render(tok, template, messages + [{"role": "assistant", "content": response}], where, key, field)
    if not whole.startswith(head):
        raise ValueError(f"{key}: {where}: the chat template does not render the prompt as the start of the "
                         "conversation with its response (its generation prompt differs)")
    return head, whole[len(head):]


def read_pairs(d, tokenizer, *, max_length: int, vocab_size: int, validation: bool = False) -> Pairs:
    """Every pair of the [dpo] section ``d``, tokenized and checked; with ``validation``, its validation set. Raises a
    one-line ValueError naming the row and field of the first malformed pair (see the module docstring)."""
    key = "dpo.validation_path" if validation else "dpo.path"
    path = (d.validation_path or d.path) if validation else d.path
    split = d.validation_split if validation else d.split
    template = False if d.chat_template == "none" else read_template(d.chat_template, tokenizer, "dpo.chat_template")
    problem = vocab_mismatch(tokenizer, vocab_size)
    if problem:
        raise ValueError(problem)
    eos = eos_id(tokenizer)
    ends = [eos] if template is False else []  # without a template, an EOS ends each response
    fields = (d.prompt_field, d.chosen_field, d.rejected_field)
    prompts, chosen, rejected, truncated = [], [], [], 0
    digest = hashlib.sha256()
    block: list[tuple[str, str, str, str]] = []

    def flush():
        nonlocal truncated
        heads = encode_batch(tokenizer, [b[1] for b in block])
        goods = encode_batch(tokenizer, [b[2] for b in block])
        bads = encode_batch(tokenizer, [b[3] for b in block])
        for (where, *_), head, good, bad in zip(block, heads, goods, bads):
            good, bad = good + ends, bad + ends
            if len(head) >= max_length:
                raise ValueError(f"{key}: {where}: the prompt alone is {len(head)} tokens, training.seq_len (the "
                                 f"pair's max length) {max_length}: no token of the response would be counted")
            room = max_length - len(head)
            truncated += len(good) > room or len(bad) > room
            if not good or not bad:
                raise ValueError(f"{key}: {where}: a response renders to no token")
            prompts.append(np.asarray(head, dtype=np.int32))
            chosen.append(np.asarray(good[:room], dtype=np.int32))
            rejected.append(np.asarray(bad[:room], dtype=np.int32))
            for ids in (prompts[-1], chosen[-1], rejected[-1]):
                digest.update(ids.tobytes() + b"|")
        block.clear()

    for where, row in _rows(path, d.name, split, fields, key):
        prompt, good, bad = _split_row(where, row, fields, key)
        head, good_text = _texts(tokenizer, template, where, prompt, good, key, d.chosen_field)
        _, bad_text = _texts(tokenizer, template, where, prompt, bad, key, d.rejected_field)
        block.append((where, head, good_text, bad_text))
        if len(block) == BLOCK:
            flush()
    flush()
    if not prompts:
        raise ValueError(f"{key}: {path} holds no preference pairs")
    return Pairs(prompts, chosen, rejected, max_length, eos, truncated,
                 f"pairs:{len(prompts)}:{max_length}:{digest.hexdigest()[:16]}")


class PairIndices:
    """The pairs as a random-access source of hybridtitan.data.sources: "document" i is the index i itself."""

    random_order = False

    def __init__(self, pairs: Pairs):
        self.n, self.fingerprint = len(pairs), pairs.fingerprint

    def __len__(self) -> int:
        return self.n

    def documents(self, indices) -> list[np.ndarray]:
        return [np.asarray([int(i)], dtype=np.int64) for i in indices]


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Pairs into one batch: the chosen rows first, then the rejected ones in the same order."""
    ids, labels = (torch.cat([s[k][0:1] for s in samples] + [s[k][1:2] for s in samples]) for k in (0, 1))
    return {"input_ids": ids, "labels": labels}


class PreferenceDataset(IterableDataset):
    """This rank's pairs, epoch after epoch, in the seeded order. It is Stateful, so its cursor is in every checkpoint.
    """

    def __init__(self, pairs: Pairs, *, dp_rank: int, dp_world_size: int, seed: int, shuffle: bool = True):
        self.pairs = pairs
        self.cursor = ShardedDocuments(PairIndices(pairs), shard=dp_rank, num_shards=dp_world_size, seed=seed,
                                       shuffle=shuffle)

    def __iter__(self):
        while True:
            yield self.pairs.rows(int(self.cursor.next_document()[0]))

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "cursor": self.cursor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"dpo: unknown preference loader state version {state.get('version')!r}")
        self.cursor.load_state_dict(state["cursor"])


def preference_loader(pairs: Pairs, *, local_batch_size: int, dp_rank: int, dp_world_size: int,
                      seed: int) -> StatefulDataLoader:
    """The infinite, exactly resumable loader of this rank's batches of ``local_batch_size`` pairs."""
    if len(pairs) < dp_world_size:
        raise ValueError(f"dpo.path: {len(pairs)} pairs, fewer than the {dp_world_size} data-parallel ranks")
    dataset = PreferenceDataset(pairs, dp_rank=dp_rank, dp_world_size=dp_world_size, seed=seed)
    return StatefulDataLoader(dataset, batch_size=local_batch_size, collate_fn=collate, num_workers=0)


class HeldOutPairs:
    """One rank's shard of the held-out pairs as batches, read in order from its start on every pass (validation)."""

    def __init__(self, pairs: Pairs, *, local_batch_size: int, dp_rank: int, dp_world_size: int):
        if len(pairs) < dp_world_size:
            raise ValueError(f"dpo.validation_path: {len(pairs)} pairs, fewer than the {dp_world_size} "
                             "data-parallel ranks")
        self.pairs, self.local_batch_size = pairs, local_batch_size
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.length = len(range(dp_rank, len(pairs), dp_world_size))  # this rank's pairs

    def batches(self):
        """(batch, whether this rank's shard ended with it), forever. The shard starts over after its end."""
        cursor = ShardedDocuments(PairIndices(self.pairs), shard=self.dp_rank, num_shards=self.dp_world_size,
                                  seed=0, shuffle=False)
        taken = 0
        while True:
            samples = [self.pairs.rows(int(cursor.next_document()[0])) for _ in range(self.local_batch_size)]
            taken += self.local_batch_size
            yield collate(samples), taken >= self.length
