"""Train the byte-level BPE tokenizer (vocabulary 8192) the repo ships, on the shipped corpus.

    python scripts/build_corpus.py      # if hybridtitan/assets/corpus/ is missing
    python scripts/build_tokenizer.py

Writes a Hugging Face tokenizer folder to hybridtitan/assets/tokenizer/ that
`transformers.AutoTokenizer.from_pretrained` loads offline.
Special tokens: `<|endoftext|>` (id 0) is both BOS and EOS (GPT-2 style: one separator between
documents); `<|pad|>` (id 1) is padding, kept apart from EOS so that masking padding never masks
a real end of document. Nothing is added automatically on encode: the data loader decides.
"""

import argparse
import json
import os
import pathlib

# Determinism: the trainer counts words and pairs on a rayon thread pool. tokenizers 0.23 gave
# byte-identical output with 16 threads too, but training takes ~1 s anyway, and one thread
# rules out scheduling-dependent tie-breaking in other versions. Set before tokenizers loads.
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["TOKENIZERS_PARALLELISM"] = "false"

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

ASSETS = pathlib.Path(__file__).resolve().parent.parent / "hybridtitan" / "assets"
VOCAB_SIZE = 8192  # includes the 2 special tokens and the 256 byte symbols
EOS, PAD = "<|endoftext|>", "<|pad|>"


def texts():
    with open(ASSETS / "corpus" / "train.jsonl", encoding="utf-8") as f:
        for line in f:
            yield json.loads(line)["text"]


def main():
    # No normalizer: byte-level BPE can represent any string, and leaving text untouched keeps
    # decode(encode(x)) == x exactly (NFC or lowercasing would not).
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS, PAD],                          # ids 0 and 1, in this order
        # All 256 bytes, even those the corpus never shows, so no input is ever out of vocabulary.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert tok.token_to_id(EOS) == 0 and tok.token_to_id(PAD) == 1

    out = ASSETS / "tokenizer"
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=PAD)
    hf.save_pretrained(out)
    # transformers 5 records its internal class name "TokenizersBackend", which transformers 4
    # cannot load; "PreTrainedTokenizerFast" is an alias of it in 5 and the real class in 4.
    # It also no longer writes special_tokens_map.json; write it for readers that expect it.
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": PAD}
    for name, obj in (("tokenizer_config.json", config), ("special_tokens_map.json", special)):
        (out / name).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    print(f"saved {len(hf)} tokens to {out}")


if __name__ == "__main__":
    # no options: --help describes what running it overwrites
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
