"""Text generation from a DCP checkpoint or an exported Hugging Face folder, streamed as it is decoded.

    python -m hybridtitan.generate --checkpoint outputs/quickstart --prompt "Return the number of"
    python -m hybridtitan.generate --checkpoint outputs/quickstart/hf --temperature 0      # interactive, greedy

hybridtitan.model_loader reads the model, as for evaluation: HybridLM, our own code, on CPU or GPU. The prompt is fed
once (the prefill). Then one token per step goes through the recurrent and MLA caches, until --max_new_tokens or the
end-of-text token.

--temperature 0 is greedy. Otherwise tokens are drawn from softmax(logits / T), restricted to the smallest set of tokens
whose probability reaches --top_p (nucleus sampling). --seed makes a draw repeatable.

Without --prompt, lines are read from a "> " prompt, and each is answered from a fresh cache. Ctrl-D, Ctrl-C or "exit"
ends the loop; Ctrl-C during an answer stops only that answer. The text goes to stdout and the model's description to
stderr. Bad input gives one "error: ..." line on stderr and exit code 2."""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from collections.abc import Callable

from hybridtitan.cli import OneLineParser, fail, one_line_errors

DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_P = 0.95


def next_token(logits, temperature: float, top_p: float, generator) -> int:
    """One token from a [V] row of logits: the argmax at temperature 0, else a draw from the nucleus."""
    import torch

    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    probs, order = probs.sort(descending=True)
    probs = probs * ((probs.cumsum(0) - probs) < top_p)  # keep tokens until top_p is reached (the first always)
    return int(order[torch.multinomial(probs, 1, generator=generator)])


def generate(model, tokenizer, prompt_ids: list[int], *, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             temperature: float = DEFAULT_TEMPERATURE, top_p: float = DEFAULT_TOP_P, generator=None,
             on_token: Callable[[str], None] | None = None) -> list[int]:
    """The generated token ids, without the end-of-text token that stops generation.

    ``on_token`` gets each new piece of text as soon as it is complete. The whole continuation is decoded at every step
    and only its new suffix is handed on. The suffix is held back while it ends inside a multi-byte character. An empty
    prompt starts from the end-of-text token, which precedes every document in training."""
    import torch

    from hybridtitan.data.tokenizer import eos_id
    from hybridtitan.models import InferenceCache

    device = next(model.parameters()).device
    eot = eos_id(tokenizer)
    vocab = min(len(tokenizer), model.args.vocab_size)  # never draw an id the tokenizer cannot decode
    cache = InferenceCache(len(model.layers))
    out: list[int] = []
    shown = ""

    def emit(final: bool = False) -> None:
        nonlocal shown
        if on_token is None:
            return
        text = tokenizer.decode(out, skip_special_tokens=False)
        if len(text) > len(shown) and (final or not text.endswith("\ufffd")):
            on_token(text[len(shown):])
            shown = text

    with torch.no_grad():
        logits = model(torch.tensor([list(prompt_ids) or [eot]], device=device), cache=cache)[0, -1]
        while len(out) < max_new_tokens:
            token = next_token(logits[:vocab], temperature, top_p, generator)
            if token == eot:
                break
            out.append(token)
            emit()
            if len(out) < max_new_tokens:
                logits = model(torch.tensor([[token]], device=device), cache=cache)[0, -1]
    emit(final=True)
    return out


def build_parser():
    p = OneLineParser(prog="python -m hybridtitan.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a DCP step/checkpoint/dump folder, or a Hugging Face folder")
    p.add_argument("--prompt", default=None, help="the text to continue (default: read prompts from stdin)")
    p.add_argument("--max_new_tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS,
                   help=f"tokens to generate at most (default {DEFAULT_MAX_NEW_TOKENS})")
    p.add_argument("--temperature", type=float, default=DEFAULT_TEMPERATURE,
                   help=f"sampling temperature, 0 for greedy decoding (default {DEFAULT_TEMPERATURE})")
    p.add_argument("--top_p", type=float, default=DEFAULT_TOP_P,
                   help=f"nucleus sampling: the probability mass to draw from, in (0, 1] (default {DEFAULT_TOP_P})")
    p.add_argument("--seed", type=int, default=None, help="seed of the draws (default: a fresh one each run)")
    p.add_argument("--step", type=int, default=None, help="the DCP step (default: the latest complete one)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the checkpoint's)")
    p.add_argument("--kernel_configs", default="shipped",
                   help="tuned Triton kernel configurations on a GPU: shipped (the package's for this GPU and "
                        "versions, else FLA autotunes), autotune, or a folder python -m hybridtitan.tune recorded")
    return p


def load(args):
    """(model, tokenizer, description) for the parsed arguments. Every bad input ends in fail()."""
    if not os.path.exists(args.checkpoint):
        fail(f"checkpoint not found: {args.checkpoint}")
    if args.max_new_tokens < 1:
        fail(f"--max_new_tokens must be positive (got {args.max_new_tokens})")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        fail(f"--temperature must be >= 0 (got {args.temperature})")
    if not 0 < args.top_p <= 1:
        fail(f"--top_p must be in (0, 1] (got {args.top_p})")
    if args.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        fail(f"--device must be cpu or cuda[:N] (got {args.device})")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Triton is not supported")

    import torch

    from hybridtitan import model_loader
    from hybridtitan.hf.convert import is_hf_folder
    from hybridtitan.ops import kernel_configs

    if args.step is not None and is_hf_folder(args.checkpoint):
        fail(f"--step: {args.checkpoint} is a Hugging Face folder, which holds one model (no steps)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if not torch.cuda.is_available() or index >= torch.cuda.device_count():
            fail(f"--device {device}: no such GPU is available")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    with one_line_errors():
        tuned = kernel_configs.use(args.kernel_configs, torch.device(device))
        model, tokenizer, source = model_loader.load(args.checkpoint, step=args.step, device=device, dtype=dtype,
                                               tokenizer=args.tokenizer)
    print(f"hybridtitan: {source}, {dtype} on {device}; {tuned.message}", file=sys.stderr, flush=True)
    return model.eval(), tokenizer


def answer(model, tokenizer, prompt: str, args) -> None:
    """Generate a continuation of ``prompt``, streamed to stdout, ended with a newline."""
    import torch

    generator = torch.Generator(device=next(model.parameters()).device)
    if args.seed is not None:
        generator.manual_seed(args.seed)
    else:
        generator.seed()

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    try:
        generate(model, tokenizer, tokenizer.encode(prompt, add_special_tokens=False),
                 max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                 generator=generator, on_token=write)
    finally:
        write("\n")


def interactive(model, tokenizer, args) -> None:
    """A "> " prompt loop until EOF, Ctrl-C at the prompt, or "exit". Ctrl-C during an answer stops that answer."""
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return
        if line.strip() in ("exit", "quit"):
            return
        if not line.strip():
            continue
        try:
            answer(model, tokenizer, line, args)
        except KeyboardInterrupt:
            pass


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        model, tokenizer = load(args)
        if args.prompt is not None:
            answer(model, tokenizer, args.prompt, args)
        else:
            interactive(model, tokenizer, args)
    except KeyboardInterrupt:  # while loading, or during a --prompt answer
        print(file=sys.stderr)
        raise SystemExit(130) from None
    except BrokenPipeError:  # stdout closed early (| head): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
