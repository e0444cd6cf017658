"""scripts/prepare_data.py --chat-template: each row's `messages` rendered to text through Zebra-Llama's template,
the tokenizer's own or a Jinja file, then tokenized; a missing column, malformed messages or a bad template are
refused in one line (exit 2) before anything is written. The script runs as a subprocess, on a tiny tokenizer
built here (Llama 3's header tokens as special tokens) and a small jsonl."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

from hybridtitan.data.sources import MegatronSource  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SPECIAL = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# the tokenizer's own template (ChatML-like, unlike Zebra-Llama's: the `tokenizer` case must not pass by accident)
OWN_TEMPLATE = "{% for m in messages %}<|start_header_id|>{{ m['role'] }}\n{{ m['content'] }}<|eot_id|>\n{% endfor %}"
CONVERSATIONS = [
    [{"role": "user", "content": "What is two plus two? "}, {"role": "assistant", "content": "\nFour.\n"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."},
     {"role": "assistant", "content": "The quick brown one."}],
]


@pytest.fixture(scope="module")
def chat_tok_dir(tmp_path_factory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([m["content"] for c in CONVERSATIONS for m in c] * 20, trainer)
    path = tmp_path_factory.mktemp("chat_tokenizer")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    tok.chat_template = OWN_TEMPLATE
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def chat_tok(chat_tok_dir):
    from hybridtitan.data.tokenizer import build_tokenizer

    return build_tokenizer(chat_tok_dir)


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def argv(tmp_path: Path, dataset: str, tok_dir: str, out: Path, *extra: str) -> list[str]:
    return [str(REPO / "scripts" / "prepare_data.py"), "--dataset", dataset, "--tokenizer", tok_dir, "--output",
            str(out), "--cache-dir", str(tmp_path / "hf"), "--workers", "1", *extra]


def documents(out: Path) -> list[list[int]]:
    source = MegatronSource([f"{out}_00000"])
    return [d.tolist() for d in source.documents(range(len(source)))]


def test_chat_templates_render(tmp_path, chat_tok_dir, chat_tok):
    """zebra (as read and streamed), tokenizer and a Jinja file: the shards hold the rendered texts' tokens."""
    from helpers import start

    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c, "text": "unused"} for c in CONVERSATIONS])
    jinja = tmp_path / "plain.jinja"
    jinja.write_text("{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}")
    out = {name: tmp_path / name / "train" for name in ("zebra", "zebra_streaming", "tokenizer", "file")}
    runs = {"zebra": ["--chat-template", "zebra"], "zebra_streaming": ["--chat_template", "zebra", "--streaming"],
            "tokenizer": ["--chat-template", "tokenizer"], "file": ["--chat-template", str(jinja)]}
    procs = {name: start(argv(tmp_path, chat, chat_tok_dir, out[name], *extra)) for name, extra in runs.items()}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name}: {stderr[-2000:]}"
        assert f'path = "{out[name]}_*"' in stdout

    def tokens(text: str) -> list[int]:
        return chat_tok(text, add_special_tokens=False)["input_ids"]

    # Zebra-Llama's: BOS before the first message only, Llama 3 headers, each content trimmed, no system or date
    # block added (a system message is a turn like the others), no generation prompt
    zebra = ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is two plus two?<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\nFour.<|eot_id|>",
             "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
             "<|start_header_id|>user<|end_header_id|>\n\nName a fox.<|eot_id|>"
             "<|start_header_id|>assistant<|end_header_id|>\n\nThe quick brown one.<|eot_id|>"]
    for name in ("zebra", "zebra_streaming"):
        got = documents(out[name])
        assert got == [tokens(t) for t in zebra], name
        assert [chat_tok.decode(ids) for ids in got] == zebra
    assert chat_tok.convert_tokens_to_ids("<|begin_of_text|>") == documents(out["zebra"])[0][0]  # one token

    own = [chat_tok.apply_chat_template(c, tokenize=False) for c in CONVERSATIONS]
    assert own[0] == ("<|start_header_id|>user\nWhat is two plus two? <|eot_id|>\n"
                      "<|start_header_id|>assistant\n\nFour.\n<|eot_id|>\n")
    assert documents(out["tokenizer"]) == [tokens(t) for t in own]

    assert [chat_tok.decode(ids) for ids in documents(out["file"])] == [
        "USER: What is two plus two? \nASSISTANT: \nFour.\n\n",
        "SYSTEM: Be brief.\nUSER: Name a fox.\nASSISTANT: The quick brown one.\n"]

    record = json.loads((tmp_path / "zebra" / "train.manifest.json").read_text())
    assert record["complete"] and record["source"]["chat_template"]["name"] == "zebra"
    assert len(record["source"]["chat_template"]["sha256"]) == 16


def test_chat_template_refused(tmp_path, chat_tok_dir):
    """One line on stderr, exit code 2, and no file written, for each fault; the processes run side by side."""
    from helpers import start

    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CONVERSATIONS])
    text = write_jsonl(tmp_path / "text.jsonl", [{"text": "no conversation here"}])
    # the third row's message has no content: found by the rendering of every row, before the first write
    malformed = write_jsonl(tmp_path / "malformed.jsonl",
                            [{"messages": c} for c in CONVERSATIONS] + [{"messages": [{"role": "user"}]}])
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    shipped = str(REPO / "hybridtitan" / "assets" / "tokenizer")  # a tokenizer without a chat template
    cases = {
        "--chat-template: no column 'messages'": (text, chat_tok_dir, "zebra"),
        f"--chat-template: {bad} is not a valid Jinja template: line 1": (chat, chat_tok_dir, str(bad)),
        f"--chat-template: cannot read {tmp_path / 'nope.jinja'}": (chat, chat_tok_dir, str(tmp_path / "nope.jinja")),
        "--chat-template: row 2: 'messages' must be a non-empty list": (malformed, chat_tok_dir, "zebra"),
        "--chat-template tokenizer: the tokenizer has no chat template": (chat, shipped, "tokenizer"),
    }
    outs = {expected: tmp_path / f"out{i}" / "train" for i, expected in enumerate(cases)}
    procs = {expected: start(argv(tmp_path, dataset, tok_dir, outs[expected], "--chat-template", template))
             for expected, (dataset, tok_dir, template) in cases.items()}
    # streamed, a malformed row past the first is met while writing: one line too, and the manifest says incomplete
    streamed = tmp_path / "streamed" / "train"
    stream = start(argv(tmp_path, malformed, chat_tok_dir, streamed, "--chat-template", "zebra", "--streaming"))
    _, stderr = stream.communicate(timeout=300)
    lines = [line for line in stderr.splitlines() if line.strip() and "doc/s]" not in line]  # tqdm's bar
    assert stream.returncode == 2 and len(lines) == 1 and "row 2: 'messages' must be" in lines[0], stderr
    assert "says incomplete" in lines[0]
    assert not json.loads((tmp_path / "streamed" / "train.manifest.json").read_text())["complete"]
    for expected, proc in procs.items():
        _, stderr = proc.communicate(timeout=300)
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {expected}"), stderr
        folder = outs[expected].parent
        assert not folder.exists() or not any(folder.iterdir()), f"{expected}: {list(folder.iterdir())}"
