"""lm-eval over a HybridLM.

This module holds the lm-eval model (HybridTitanLM), the task lookup, and ``evaluate_live``. The trainer calls
``evaluate_live`` to evaluate the model it is training; every rank calls it, FSDP models included. The command line that
evaluates a checkpoint or a Hugging Face folder is hybridtitan.eval.

loglikelihood, loglikelihood_rolling and generate_until are batched. Generation is greedy and decodes with the recurrent
and MLA caches. Under several processes every rank holds the model and scores its share of the batches. The results
equal those of one process, sample for sample."""

from __future__ import annotations

import fnmatch
import gc
import logging
import math
import os

from lm_eval.api.model import TemplateLM

from hybridtitan.errors import EvalError

logger = logging.getLogger("hybridtitan")

DEFAULT_MAX_LENGTH = 2048
DEFAULT_MAX_GEN_TOKS = 256
# --batch_size auto starts here and backs off on out-of-memory. lm-eval's HF model starts at the same 64. On a CPU
# the start is also capped at what half of the available memory holds (float32 logits and log-probabilities),
# because an allocation there rarely fails with an error: the kernel's OOM killer ends the process instead.
DEFAULT_MAX_BATCH_SIZE = 64


def parse_batch_size(text) -> int | str:
    """Parses an lm-eval batch size: an integer, "auto" or "auto:N". Raises ValueError otherwise.

    With "auto:N" (N > 0) the size is detected again N times over the requests, so the later, shorter requests get
    larger batches."""
    if isinstance(text, int):
        return text
    t = str(text).strip()
    if t == "auto":
        return t
    if t.startswith("auto:"):
        try:
            n = float(t[5:])
        except ValueError:
            n = 0.0
        if not (n > 0 and math.isfinite(n)):
            raise ValueError(f"--batch_size {text}: N in auto:N must be a positive number")
        return t
    try:
        return int(t)
    except ValueError:
        raise ValueError(f"--batch_size must be an integer, auto or auto:N (got {text!r})") from None


def _is_oom(e: BaseException) -> bool:
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "out of memory", "can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED"))


def _available_memory() -> int | None:
    """Bytes of memory this host can still give (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _is_collective(model) -> bool:
    """Whether the model's forward talks to the other ranks (FSDP, DDP). If so, every rank must run as many forwards."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    kinds: tuple = (FSDPModule, DistributedDataParallel)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        kinds += (FullyShardedDataParallel,)
    except ImportError:  # pragma: no cover
        pass
    return any(isinstance(m, kinds) for m in model.modules())


class HybridTitanLM(TemplateLM):
    """An lm-eval LM over a HybridLM and its tokenizer.

    Batches are right-padded. That is harmless for a causal model, because no real position sees a pad. Generation feeds
    the prompts of a batch in lockstep. Their common length goes in one pass and the rest one token per step. Each row
    switches to its own greedy tokens once its prompt is consumed. So every row shares one cache position, and no row
    ever reads a pad.

    ``batch_size`` is an integer, or lm-eval's "auto" or "auto:N". Auto finds the largest batch that fits with a forward
    of the longest request. It starts at ``max_batch_size`` and halves on out-of-memory. Then it bisects between the
    last size that failed and the first that fitted.

    With ``distributed``, every rank of the default process group (or ``group``) holds the model and gets the same
    requests. lm-eval runs as one process on each rank: it sees rank 0 and world size 1, so it builds every request
    everywhere. This LM splits the work itself. It forms the batches exactly as one process would, deals them
    round-robin to the ranks, and all-gathers the results. Every rank then returns what one process would, number for
    number.

    ``collective`` says the forward is a collective. It defaults to whether the model holds an FSDP or DDP module. Every
    rank then runs the same number of forward calls. A rank short of a batch runs a one-token dummy forward. During
    generation every step first agrees, by an all-reduce, whether any rank still decodes. The finished ranks run dummies
    meanwhile."""

    backend = "causal"

    def __init__(self, model, tokenizer, *, batch_size: int | str = 8, max_length: int = DEFAULT_MAX_LENGTH,
                 max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 distributed: bool = False, collective: bool | None = None, group=None, device=None):
        super().__init__()
        import torch

        self.model = model.eval()
        self.tokenizer = tokenizer
        batch_size = parse_batch_size(batch_size)
        if isinstance(batch_size, str):
            self.batch_size: int | str = "auto"
            self.batch_schedule = float(batch_size[5:]) if batch_size.startswith("auto:") else 1.0
        else:
            self.batch_size, self.batch_schedule = max(1, int(batch_size)), 1.0
        self.max_batch_size = max(1, int(max_batch_size))
        self.batch_sizes: dict[int, int] = {}  # the sizes auto chose, in order (lm-eval records them)
        self.max_length = int(max_length)
        self.max_gen_toks = int(max_gen_toks)
        self._device = torch.device(device) if device is not None else next(model.parameters()).device
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eot_token_id
        self.collective = _is_collective(model) if collective is None else bool(collective)
        if self.batch_size == "auto" and self.collective:
            raise EvalError("--batch_size auto needs a model whose forward is its own: under FSDP/DDP a rank "
                            "running out of memory mid-forward would leave the others waiting; give an integer")
        self._group, self._world, self._me = group, 1, 0
        if distributed:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                self._world, self._me = dist.get_world_size(group), dist.get_rank(group)
        self._sync = self._world > 1 and self.collective
        self.progress = True  # progress bars on rank 0 (evaluate_live: none)

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

    # ---- the ranks
    def _gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order. Without distribution, this rank's alone."""
        if self._world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self._world
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank. This is an all-reduce, so every rank must call it equally often."""
        import torch
        import torch.distributed as dist

        on = self._device if "nccl" in str(dist.get_backend(self._group)) else torch.device("cpu")
        t = torch.tensor([1.0 if flag else 0.0], device=on)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self._group)
        return bool(t.item() > 0)

    def _same_everywhere(self, what: str, *key) -> None:
        """Refuses requests that differ between ranks, on every rank alike. lm-eval builds them alike on each rank. If
        they differed, a collective forward would wait forever."""
        if self._world == 1:
            return
        keys = self._gather(tuple(key))
        if any(k != keys[0] for k in keys):
            raise RuntimeError(f"hybridtitan.eval: the ranks were given different {what} requests "
                               f"(count, tokens per rank: {keys}); every rank must run the same evaluation")

    def _share(self, jobs: list) -> list:
        """This rank's jobs: every world-th job, starting at its rank. Where the forward is collective, the list is
        padded with None to an equal count on every rank. None means: run a dummy forward instead."""
        if self._world == 1:
            return jobs
        mine = jobs[self._me:: self._world]
        if self._sync:
            mine += [None] * (math.ceil(len(jobs) / self._world) - len(mine))
        return mine

    def _merge(self, local: dict) -> dict:
        merged: dict = {}
        for part in self._gather(local):
            merged.update(part)
        return merged

    def _dummy_forward(self) -> None:
        """One forward of a single token, its output dropped. This is a rank's part in a collective forward."""
        import torch

        with torch.no_grad():
            self.model(torch.full((1, 1), self.pad_id, dtype=torch.long, device=self._device))

    # ---- batch sizes
    def _start_batch_size(self, length: int) -> int:
        """The size --batch_size auto starts from. It is max_batch_size. On a CPU it is also at most the number of
        ``length``-token rows that half the available memory holds. A row needs float32 logits, their float copy, the
        log-probabilities and the activations."""
        cap = self.max_batch_size
        args = getattr(self.model, "args", None)
        if self._device.type == "cpu" and args is not None:
            available = _available_memory()
            row = length * 4 * (3 * int(args.vocab_size) + 16 * int(args.dim))
            if available:
                cap = max(1, min(cap, int(available * 0.5 // row)))
        return cap

    def _fits(self, batch: int, length: int) -> bool:
        """Whether a forward and log-softmax of ``batch`` rows of ``length`` tokens fits in memory."""
        import torch

        try:
            self._log_probs([[self.pad_id] * length] * batch)
            return True
        except Exception as e:  # noqa: BLE001 -- only out-of-memory is an answer; the rest is raised
            if not _is_oom(e):
                raise
        if self._device.type == "cuda":  # the failed forward's tensors went with the exception: their blocks too
            gc.collect()
            torch.cuda.empty_cache()
        return False

    def detect_batch_size(self, length: int) -> int:
        """The largest batch of ``length``-token rows that fits, at most _start_batch_size.

        Sizes are halved from the start until one fits, then bisected between it and the last that failed. Every rank
        takes the smallest of all ranks' sizes. The result is 1 if even one row does not fit; its forward then fails
        with the real error."""
        length = max(1, min(int(length), self.max_length))
        size = self._start_batch_size(length)
        failed = None
        while size >= 1 and not self._fits(size, length):
            failed, size = size, size // 2
        size = max(1, size)
        if failed is not None and size < failed:
            while failed - size > 1:
                mid = (size + failed) // 2
                if self._fits(mid, length):
                    size = mid
                else:
                    failed = mid
        size = min(self._gather(size))
        self.batch_sizes[len(self.batch_sizes)] = size
        logger.info(f"batch_size auto: {size} for requests of {length} tokens")
        return size

    def _batches(self, order: list[int], lengths: list[int]) -> list[list[int]]:
        """Cuts ``order`` into batches. ``order`` is longest first, and ``lengths`` gives the token lengths in the same
        order. With auto:N, a size is detected at the start of each N-th part of the requests (lm-eval's schedule), as
        long as the last size was below the maximum."""
        n = len(order)
        if self.batch_size != "auto":
            return [order[i: i + self.batch_size] for i in range(0, n, self.batch_size)]
        part = max(1, int(n / self.batch_schedule))
        sizes: dict[int, int] = {}
        out, pos = [], 0
        while pos < n:
            k = pos // part
            if k not in sizes:
                previous = sizes.get(k - 1)
                sizes[k] = previous if previous == self.max_batch_size else self.detect_batch_size(lengths[pos])
            out.append(order[pos: pos + sizes[k]])
            pos += sizes[k]
        return out

    # ---- scoring
    def _log_probs(self, rows: list[list[int]]):
        """The log-softmax over the vocabulary of a right-padded batch: [B, T, V], float32."""
        import torch

        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        with torch.no_grad():
            return torch.log_softmax(self.model(ids.to(self._device)).float(), dim=-1)

    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """For each (context, continuation) token pair: the sum of log p(continuation | context), and whether the
        continuation is greedy."""
        import torch
        from tqdm import tqdm

        prepared = []
        for ctx, cont in pairs:
            full = (ctx + cont)[-(self.max_length + 1):]
            n = min(len(cont), len(full) - 1)
            prepared.append((full[:-1], full[1:], n))
        self._same_everywhere("loglikelihood", len(prepared), sum(len(p[0]) for p in prepared))
        order = sorted(range(len(prepared)), key=lambda i: -len(prepared[i][0]))
        batches = self._batches(order, [len(prepared[i][0]) for i in order])
        results: dict[int, tuple[float, bool]] = {}
        for idx in tqdm(self._share(batches), disable=disable_tqdm or not self.progress or self._me != 0,
                        desc="scoring"):
            if idx is None:
                self._dummy_forward()
                continue
            logp = self._log_probs([prepared[i][0] for i in idx])
            for row, i in enumerate(idx):
                inp, tgt, n = prepared[i]
                L = len(inp)
                lp = logp[row, L - n: L]
                target = torch.tensor(tgt[L - n: L], dtype=torch.long, device=lp.device)
                picked = lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
                greedy = bool((lp.argmax(-1) == target).all())
                results[i] = (float(picked.sum()), greedy)
        results = self._merge(results)
        return [results[i] for i in range(len(prepared))]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or not self.progress)

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
        scores = self._score(windows, disable_tqdm=disable_tqdm or not self.progress)
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
        self._same_everywhere("generate_until", len(settings), sum(map(len, settings)))
        jobs = []  # (members, until, max_new): the same list on every rank
        for (until, max_new), members in groups.items():
            members = sorted(members, key=lambda i: -len(settings[i]))
            size = self.batch_size
            if size == "auto":  # the first pass over the longest prompt, then a cache: sized for prompt + output
                size = self.detect_batch_size(len(settings[members[0]]) + max_new)
            jobs += [(members[s: s + size], until, max_new) for s in range(0, len(members), size)]
        out: dict[int, str] = {}
        mine = self._share(jobs)
        bar = tqdm(total=sum(len(j[0]) for j in mine if j), disable=disable_tqdm or not self.progress or self._me != 0,
                   desc="generating")
        for job in mine:
            if job is None:
                self.greedy([], 0, [])
                continue
            batch, until, max_new = job
            texts = self.greedy([settings[i] for i in batch], max_new, list(until))
            out.update(zip(batch, texts))
            bar.update(len(batch))
        bar.close()
        out = self._merge(out)
        texts = [out[i] for i in range(len(requests))]
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def greedy(self, prompts: list[list[int]], max_new: int, until: list[str]) -> list[str]:
        """Greedy continuations of token prompts, cut at the first stop string or the end-of-text token.

        Where the forward is collective, every step first asks whether any rank still decodes. A rank that is done, or
        has no prompt at all, runs dummy forwards until no rank decodes."""
        import torch

        from hybridtitan.models import InferenceCache

        B = len(prompts)
        if B == 0:  # this rank's share ran out: its part in the others' forwards
            if self._sync:
                self._dummy_forward()
                while self._any_rank(False):
                    self._dummy_forward()
            return []
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
                if self._sync:
                    if not self._any_rank(not all(done)):
                        break
                    if all(done):  # another rank still decodes: this round's forward, then until none does
                        self._dummy_forward()
                        while self._any_rank(False):
                            self._dummy_forward()
                        break
                elif all(done):
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


def task_manager_for(names: list[str], include_path: str | None):
    """A TaskManager that knows every requested task, and the task names expanded. Globs are expanded and YAML paths
    kept.

    Indexing lm-eval's own tasks takes seconds. So when the include_path holds every requested task, only it is indexed.
    Raises EvalError naming any unknown tasks."""
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
             device=None, bootstrap_iters: int = 100000, log_samples: bool = False) -> dict | None:
    """Runs lm-eval's simple_evaluate over ``lm`` and returns its results.

    lm-eval returns None on a rank whose LOCAL_RANK is not 0. With HybridTitanLM's own distribution every rank computes
    the same results."""
    from lm_eval import simple_evaluate

    return simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, limit=limit, num_fewshot=num_fewshot,
                           batch_size=batch_size, device=device, log_samples=log_samples,
                           bootstrap_iters=bootstrap_iters)


def flat_metrics(results: dict, prefix: str = "eval") -> dict[str, float]:
    """lm-eval's results as {"eval/<task>/<metric>": value}, with every number of every task and group.

    A filter other than "none" is added after the metric, as in "eval/gsm8k/exact_match/strict-match". "N/A" stderrs are
    left out."""
    flat = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or "," not in key:
                continue
            metric, _, filt = key.partition(",")
            flat[f"{prefix}/{task}/{metric}" + ("" if filt in ("none", "") else f"/{filt}")] = float(value)
    return flat


_TASK_MANAGERS: dict[tuple, tuple] = {}


def evaluate_live(model, tokenizer, tasks: list[str] | str, *, include_path: str | None = None, limit=None,
                  num_fewshot: int | None = None, batch_size: int = 8, max_length: int = DEFAULT_MAX_LENGTH,
                  max_gen_toks: int = DEFAULT_MAX_GEN_TOKS, bootstrap_iters: int = 0, device=None,
                  group=None) -> dict[str, float]:
    """lm-eval over the model in memory, called from the trainer. The model is a HybridLM, possibly FSDP-wrapped.

    It gives the same numbers as ``python -m hybridtitan.eval`` on the same weights with the same settings (batch size,
    max_length, limit, few-shot), for any number of ranks.

    Every rank of the default process group (or ``group``) must call it alike. Each scores its share of the batches.
    Where the forward is collective (FSDP), every rank runs the same number of forwards (see HybridTitanLM). Every rank
    gets the flat metrics (``flat_metrics``: {"eval/<task>/<metric>": value}).

    It leaves no trace. The random states of Python, NumPy and torch (CPU and CUDA) are restored. The model goes back to
    training mode if it was in it, and FSDP's parameters are resharded. torch.compile'd parts run eagerly during the
    evaluation.

    ``batch_size`` must be an integer. Finding one by trial ("auto") could run out of memory on one rank in the middle
    of a collective forward. ``bootstrap_iters`` sets lm-eval's stderr; 0, the quickest, computes none."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    if isinstance(batch_size, str) or int(batch_size) < 1:
        raise EvalError(f"evaluate_live: batch_size must be a positive integer (got {batch_size!r})")
    names = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks) if t and t.strip()]
    if not names:
        raise EvalError("evaluate_live: no tasks")
    key = (include_path, tuple(names))
    if key not in _TASK_MANAGERS:
        _TASK_MANAGERS[key] = task_manager_for(names, include_path)
    task_manager, task_names = _TASK_MANAGERS[key]
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1

    was_training = model.training
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
              torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    try:
        lm = HybridTitanLM(model, tokenizer, batch_size=int(batch_size), max_length=max_length,
                           max_gen_toks=max_gen_toks, distributed=distributed, group=group, device=device)
        lm.progress = False
        with torch.compiler.set_stance("force_eager"):
            results = evaluate(lm, task_names, task_manager, limit=limit, num_fewshot=num_fewshot,
                               batch_size=int(batch_size), device=str(lm.device), bootstrap_iters=bootstrap_iters)
        flat = flat_metrics(results) if results is not None else None
        if distributed:  # lm-eval returns its results where LOCAL_RANK is 0 (all equal): rank 0's for every rank
            box = [flat]
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                       group=group)
            flat = box[0]
        return flat
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if states[3] is not None:
            torch.cuda.set_rng_state_all(states[3])
        _reshard(model)
        model.train(was_training)


def _reshard(model) -> None:
    """Frees the root's gathered parameters. FSDP2 keeps them after a forward without a backward."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
