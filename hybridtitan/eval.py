"""lm-eval over our model, straight from a DCP checkpoint (no export step) or a Hugging Face folder.

    python -m hybridtitan.eval --checkpoint outputs/gdn_300M/checkpoint/step-4768 --tasks arc_easy,hellaswag
    python -m hybridtitan.eval --checkpoint hf/gdn_300M --tasks my_task --include_path my_tasks/ --limit 100

The model is always HybridLM (our own code, which runs on CPU too): a DCP folder is read directly; an HF folder --
our own export, or an FLA GatedDeltaNet/KDA checkpoint through the reverse name mapping -- is loaded into it.
loglikelihood, loglikelihood_rolling and generate_until are batched; generation is greedy and decodes with the
recurrent/MLA cache. Prints lm-eval's table and writes its JSON to --output_path. --include_path takes local task
YAMLs, as lm-eval does.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import os
import time
import warnings

from lm_eval.api.model import TemplateLM

from hybridtitan.errors import first_error_line
from hybridtitan.cli import OneLineParser, fail

logger = logging.getLogger("hybridtitan")

DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256


class EvalError(ValueError):
    """A bad evaluation request (an unknown task): reported as one line."""


class HybridTitanLM(TemplateLM):
    """An lm-eval LM over a HybridLM and its tokenizer.

    Batches are right-padded (harmless for a causal model: no real position sees a pad). Generation feeds the
    prompts of a batch in lockstep -- their common length in one pass, the rest one token per step, every row
    switching to its own greedy tokens once its prompt is consumed -- so every row shares one cache position and
    no row ever reads a pad."""

    backend = "causal"

    def __init__(self, model, tokenizer, *, batch_size: int = 8, max_length: int = DEFAULT_MAX_LENGTH,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS):
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = max(1, int(batch_size))
        self.max_length = int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        self._device = next(model.parameters()).device
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eot_token_id

    # ---- tokenizer
    @property
    def eot_token_id(self) -> int:
        from hybridtitan.data.tokenizer import eos_id

        return eos_id(self.tokenizer)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "tokenizer")).replace("/", "__")

    @property
    def device(self):
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=False)

    # ---- scoring
    def _log_probs(self, rows: list[list[int]]):
        """log-softmax over the vocabulary of a right-padded batch: [B, T, V] (float32)."""
        import torch

        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        with torch.no_grad():
            return torch.log_softmax(self.model(ids.to(self._device)).float(), dim=-1)

    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """(sum log p(continuation | context), continuation is greedy) per (context, continuation) token pair."""
        import torch
        from tqdm import tqdm

        prepared = []
        for ctx, cont in pairs:
            full = (ctx + cont)[-(self.max_length + 1):]
            n = min(len(cont), len(full) - 1)
            prepared.append((full[:-1], full[1:], n))
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))
        results: list[tuple[float, bool] | None] = [None] * len(prepared)
        for start in tqdm(range(0, len(order), self.batch_size), disable=disable_tqdm, desc="scoring"):
            idx = order[start: start + self.batch_size]
            logp = self._log_probs([prepared[i][0] for i in idx])
            for row, i in enumerate(idx):
                inp, tgt, n = prepared[i]
                L = len(inp)
                lp = logp[row, L - n: L]
                target = torch.tensor(tgt[L - n: L], dtype=torch.long, device=lp.device)
                picked = lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
                greedy = bool((lp.argmax(-1) == target).all())
                results[i] = (float(picked.sum()), greedy)
        return results  # type: ignore[return-value]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self._score([(ctx, cont) for _, ctx, cont in requests], disable_tqdm=disable_tqdm)
        for (key, _, _), res in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, res)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for n, req in enumerate(requests):
            (string,) = req.args[:1]
            for w in get_rolling_token_windows(self.tok_encode(string), prefix_token=self.prefix_token_id,
                                               max_seq_len=self.max_length, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(n)
        scores = self._score(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for n, (lp, _) in zip(owner, scores):
            totals[n] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        groups: dict[tuple, list[int]] = {}
        settings = []
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args[0], dict(req.args[1] if len(req.args) > 1 else {})
            until = gen_kwargs.pop("until", None) or []
            if isinstance(until, str):
                until = [until]
            max_new = int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks))
            if gen_kwargs.get("do_sample") and float(gen_kwargs.get("temperature", 1.0)) > 0:
                logger.warning("hybridtitan.eval decodes greedily; do_sample is ignored")
            key = (tuple(until), max_new)
            groups.setdefault(key, []).append(i)
            ids = self.tok_encode(context)[-max(1, self.max_length - max_new):]
            settings.append(ids)
        out: list[str | None] = [None] * len(requests)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generating")
        for (until, max_new), members in groups.items():
            members = sorted(members, key=lambda i: -len(settings[i]))
            for start in range(0, len(members), self.batch_size):
                batch = members[start: start + self.batch_size]
                texts = self.greedy([settings[i] for i in batch], max_new, list(until))
                for i, text in zip(batch, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]

    def greedy(self, prompts: list[list[int]], max_new: int, until: list[str]) -> list[str]:
        """Greedy continuations of token prompts, cut at the first stop string (or the end-of-text token)."""
        import torch

        from hybridtitan.models import InferenceCache

        B = len(prompts)
        lengths = [len(p) for p in prompts]
        common = min(lengths)
        cache = InferenceCache(len(self.model.layers))
        eot = self.eot_token_id
        generated: list[list[int]] = [[] for _ in range(B)]
        done = [False] * B
        with torch.no_grad():
            ids = torch.tensor([p[:common] for p in prompts], dtype=torch.long, device=self._device)
            logits = self.model(ids, cache=cache)[:, -1]
            pos = common
            while True:
                best = logits.argmax(-1).tolist()
                step = []
                for i in range(B):
                    if pos < lengths[i]:  # still feeding this row's prompt
                        step.append(prompts[i][pos])
                        continue
                    if not done[i]:
                        generated[i].append(best[i])
                        text = self.tok_decode(generated[i])
                        done[i] = (best[i] == eot or len(generated[i]) >= max_new
                                   or any(s and s in text for s in until))
                    step.append(generated[i][-1] if generated[i] else eot)
                if all(done):
                    break
                logits = self.model(torch.tensor(step, device=self._device).view(B, 1), cache=cache)[:, -1]
                pos += 1
        texts = []
        for g in generated:
            if g and g[-1] == eot:
                g = g[:-1]
            text = self.tok_decode(g)
            for s in until:
                if s and s in text:
                    text = text[: text.index(s)]
            texts.append(text)
        return texts


# ------------------------------------------------------------------------------------------------ loading


def load_for_eval(checkpoint: str, *, step: int | None = None, device: str = "cpu", dtype: str = "float32",
                  tokenizer: str | None = None):
    """(HybridLM, tokenizer, description) from a DCP checkpoint or a Hugging Face folder."""
    import torch

    from hybridtitan.checkpoint import load_model_args, resolve_checkpoint
    from hybridtitan.hf.convert import (
        ConversionError,
        checkpoint_tokenizer,
        is_hf_folder,
        load_hf_model,
        load_tokenizer,
        model_from_state,
        read_dcp_model_state,
    )

    torch_dtype = getattr(torch, dtype)
    if os.path.isdir(checkpoint) and is_hf_folder(checkpoint):
        model = load_hf_model(checkpoint, torch_dtype, device)
        tok_path, source = tokenizer or checkpoint, f"HF folder {checkpoint}"
        return model, load_tokenizer(tok_path, model.args.vocab_size), source
    step_dir = resolve_checkpoint(checkpoint, step)
    args = load_model_args(step_dir)
    tok_path = tokenizer or checkpoint_tokenizer(step_dir)
    if not tok_path:
        raise ConversionError(f"{step_dir} names no tokenizer (no job_config.json); pass --tokenizer")
    tok = load_tokenizer(tok_path, args.vocab_size)  # before the weights are read
    model = model_from_state(args, read_dcp_model_state(step_dir, args), torch_dtype, device, source=step_dir)
    return model, tok, f"DCP checkpoint {step_dir}"


def task_manager_for(names: list[str], include_path: str | None):
    """A TaskManager that knows every requested task, and the names expanded (globs, YAML paths kept).
    Only the include_path is indexed when it holds every requested task (indexing lm-eval's own takes seconds).
    EvalError naming the unknown tasks."""
    from lm_eval.tasks import TaskManager

    def resolve(tm):
        known, unknown = [], []
        for name in names:
            if name.endswith((".yaml", ".yml")):
                if not os.path.isfile(name):
                    raise EvalError(f"--tasks: no such task file: {name}")
                known.append(name)
            elif name in tm.all_tasks:
                known.append(name)
            elif any(c in name for c in "*?[") and fnmatch.filter(tm.all_tasks, name):
                known.extend(fnmatch.filter(tm.all_tasks, name))
            else:
                unknown.append(name)
        return known, unknown

    if include_path:
        tm = TaskManager(include_path=include_path, include_defaults=False)
        known, unknown = resolve(tm)
        if not unknown:
            return tm, known
    tm = TaskManager(include_path=include_path)
    known, unknown = resolve(tm)
    if unknown:
        where = f" (nor in --include_path {include_path})" if include_path else ""
        raise EvalError(f"unknown task{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)}: not an lm-eval task"
                         f"{where}; `lm-eval ls tasks` lists them")
    return tm, known


def evaluate(lm, tasks: list[str], task_manager, *, limit=None, num_fewshot=None, batch_size=None,
             device=None, bootstrap_iters: int = 100000) -> dict:
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, limit=limit, num_fewshot=num_fewshot,
                           batch_size=batch_size, device=device, log_samples=False, bootstrap_iters=bootstrap_iters)


def results_file(path: str, overwrite: bool = False, create: bool = False) -> str:
    """The file --output_path names: the path itself, or a new results_<time>.json in a folder (one that exists,
    or a path ending with a separator). Checked before the evaluation, so that a bad path fails before the work
    rather than after it; the folders are made only with ``create`` (when writing). EvalError for an existing
    file without ``overwrite``, or where no folder can be made."""
    folder_form = os.path.isdir(path) or path.endswith(("/", os.sep))
    folder = os.path.abspath(path if folder_form else os.path.dirname(os.path.abspath(path)))
    if not folder_form and os.path.exists(path) and not overwrite:
        raise EvalError(f"output file exists: {path} (pass --overwrite to replace it)")
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
        raise EvalError(f"--output_path {path}: {existing} is not a writable folder")
    if create:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise EvalError(f"--output_path {path}: {e}") from None
    return os.path.join(folder, f"results_{time.strftime('%Y-%m-%dT%H-%M-%S')}.json") if folder_form else path


def write_json(results: dict, path: str) -> str:
    from lm_eval.utils import handle_non_serializable

    path = results_file(path, overwrite=True, create=True)
    tmp = path + f".tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=2, default=handle_non_serializable, ensure_ascii=False)
    os.replace(tmp, path)
    return path


# ------------------------------------------------------------------------------------------------ CLI


def _limit(text: str):
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return int(value) if value >= 1 and value == int(value) and "." not in text else value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m hybridtitan.eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="a DCP step/checkpoint/dump folder, or a Hugging Face folder")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (or YAML paths)")
    p.add_argument("--include_path", default=None, help="a folder of extra task YAMLs")
    p.add_argument("--limit", type=_limit, default=None, help="examples per task (a fraction if < 1)")
    p.add_argument("--num_fewshot", type=int, default=None)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_length", type=int, default=DEFAULT_MAX_LENGTH, help="context length in tokens")
    p.add_argument("--max_gen_toks", type=int, default=DEFAULT_MAX_GEN_TOKS,
                   help="default generation length when a task sets none")
    p.add_argument("--output_path", default=None,
                   help="results JSON file, or a folder to put one in (an existing one, or a path ending with /)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output_path file")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: the checkpoint's)")
    p.add_argument("--step", type=int, default=None, help="the DCP step (default: the latest complete one)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: bfloat16 on a GPU, float32 on CPU")
    p.add_argument("--bootstrap_iters", type=int, default=100000, help="lm-eval's stderr bootstrap (0: none)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not names:
        fail("--tasks is empty")
    if args.output_path:
        try:
            results_file(args.output_path, args.overwrite)
        except EvalError as e:
            fail(str(e))
    if args.include_path and not os.path.isdir(args.include_path):
        fail(f"--include_path: no such folder: {args.include_path}")
    if not os.path.exists(args.checkpoint):
        fail(f"checkpoint not found: {args.checkpoint}")
    if args.batch_size < 1 or args.max_length < 2:
        fail("--batch_size must be >= 1 and --max_length >= 2")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        fail(f"--num_fewshot must be >= 0 (got {args.num_fewshot})")
    if args.step is not None and os.path.isfile(os.path.join(args.checkpoint, "config.json")):
        fail(f"--step: {args.checkpoint} is a Hugging Face folder, which holds one model (no steps)")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Triton is not supported")

    import torch

    from hybridtitan.checkpoint import CheckpointError, resolve_checkpoint
    from hybridtitan.hf.convert import ConversionError, is_hf_folder

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        fail("--device cuda: no GPU is available")
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    try:
        if not is_hf_folder(args.checkpoint):
            resolve_checkpoint(args.checkpoint, args.step)  # a bad folder fails before the tasks are indexed
        task_manager, tasks = task_manager_for(names, args.include_path)
        model, tokenizer, source = load_for_eval(args.checkpoint, step=args.step, device=device, dtype=dtype,
                                                 tokenizer=args.tokenizer)
    except (CheckpointError, ConversionError, EvalError) as e:
        fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    lm = HybridTitanLM(model, tokenizer, batch_size=args.batch_size, max_length=args.max_length,
                       max_gen_toks=args.max_gen_toks)
    try:
        results = evaluate(lm, tasks, task_manager, limit=args.limit, num_fewshot=args.num_fewshot,
                           batch_size=args.batch_size, device=device, bootstrap_iters=args.bootstrap_iters)
    except ConnectionError as e:  # a task's dataset on the Hub, offline or unreachable (datasets raises this)
        fail(f"--tasks: cannot load a task's data: {first_error_line(e)} (a task on the Hub needs network access "
             "once, to cache its data; a task of local files, through --include_path, needs none)")
    from lm_eval.utils import make_table

    results.setdefault("config", {})["model"] = f"hybridtitan ({source})"
    print(f"hybridtitan: {source}, {dtype} on {device}, batch_size {args.batch_size}, limit {args.limit}")
    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output_path:
        print(f"results written to {write_json(results, args.output_path)}")


if __name__ == "__main__":
    main()
