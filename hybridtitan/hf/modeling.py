"""hybridtitan's own Hugging Face model class: HybridLM behind transformers' PreTrainedModel and GenerationMixin.

The weights keep HybridLM's names under ``model.``, the names of a DCP checkpoint. So the forward is HybridLM's own
code, and its logits are bit-for-bit the trainer's. Generation carries a ``HybridCache``. It is a transformers Cache
around HybridLM's InferenceCache (convolution windows, recurrent states, MLA latents ``c_kv``/``k_rope``). So each new
token costs one step instead of a pass over the prefix."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from hybridtitan.models import HybridLM, InferenceCache
from hybridtitan.models.model import init_module
from hybridtitan.ops import KernelConfig, Kernels, fla_available

from .configuration import HybridTitanConfig, without_auto_class

logger = logging.getLogger("hybridtitan")

# the output's cache field: `cache` from transformers 5.24, `past_key_values` before it (pyproject admits both)
_CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


class HybridCache(Cache):
    """The decoding state of every sublayer. It is a transformers Cache, so ``generate`` carries and reorders it.

    Recurrent states cannot be rolled back, so ``crop`` refuses anything but a no-op, as FLA's caches do."""

    is_compileable = False

    def __init__(self, n_layers: int):
        super().__init__(layers=[])
        self.n_layers = n_layers
        self.inner = InferenceCache(n_layers)
        self.seen_tokens = 0

    def __len__(self) -> int:
        return self.n_layers

    def __repr__(self) -> str:
        return f"HybridCache(n_layers={self.n_layers}, seen_tokens={self.seen_tokens})"

    def _map(self, fn) -> None:
        for state in self.inner.layers:
            for key, value in state.items():
                state[key] = fn(value)

    def get_seq_length(self, layer_idx: int = 0, cache_position=None) -> int:
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.inner.reorder(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.inner.reorder(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda v: v.repeat_interleave(repeats, dim=0))

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.seen_tokens + max_length
        if max_length < self.seen_tokens:
            raise NotImplementedError("a recurrent state cannot be rolled back: HybridCache cannot be cropped")

    def reset(self) -> None:
        self.inner = InferenceCache(self.n_layers)
        self.seen_tokens = 0

    def activate_past_recording(self) -> None:
        pass

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_initialized(self) -> bool:
        return self.seen_tokens > 0

    @property
    def is_linear(self) -> list[bool]:
        # mixed attention + recurrent state: sequence-length bookkeeping applies (get_seq_length)
        return [False] * self.n_layers

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.n_layers

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.n_layers

    @property
    def batch_size(self) -> int:
        for state in self.inner.layers:
            for value in state.values():
                return value.shape[0]
        return -1


class HybridTitanPreTrainedModel(PreTrainedModel):
    config_class = HybridTitanConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Sublayer"]
    _is_stateful = True  # recurrent state: no assisted decoding, no cache cropping
    supports_gradient_checkpointing = True  # HybridTitanForCausalLM._set_gradient_checkpointing

    def save_pretrained(self, save_directory, *args, **kwargs):
        """As transformers' save_pretrained, but it does not copy this package's modules into the folder after a
        trust_remote_code load. The config's save_pretrained writes the two small files that auto_map names."""
        with without_auto_class(self), without_auto_class(self.config):
            return super().save_pretrained(save_directory, *args, **kwargs)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """HybridLM.init_weights, one module at a time. Modules whose parameters were loaded are skipped."""
        params = list(module.parameters(recurse=False))
        if not params or all(getattr(p, "_is_hf_initialized", False) for p in params):
            return
        init_module(module, self.config.model_args.get("init_std", 0.02))


class HybridTitanForCausalLM(HybridTitanPreTrainedModel, GenerationMixin):
    """A causal LM over HybridLM. ``forward`` accepts what ``generate`` passes.

    A batch padded on the left, or anywhere but the end, is fed one row at a time. So no pad enters a recurrent state, a
    convolution window or attention. Its cache then decodes the rows together. Right padding is harmless without a
    cache."""

    def __init__(self, config: HybridTitanConfig):
        super().__init__(config)
        # the GPU kernels where there is a GPU and FLA imports (and the config allows them); the PyTorch forms
        # everywhere else. Kernels runs FLA's ops on CUDA (and ROCm) tensors only, so without a GPU FLA and Triton
        # are not imported at all. On a CPU that import would cost ~2.5 s of a load and print FLA's CPU notice.
        fla = getattr(config, "use_fla_kernels", True) and torch.cuda.is_available() and fla_available()
        self.model = HybridLM(config.to_model_args(), Kernels(KernelConfig(reference=not fla)))
        self.uses_fla_kernels = fla
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the forward creates its own HybridCache on the first call

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Module) -> None:
        self.model.lm_head = new_embeddings  # untied models only: a tied one has none (get_output_embeddings)

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func=None,
                                    every_n_layers: int = 1, **kwargs) -> None:
        """The method that transformers' gradient_checkpointing_enable and activation_checkpointing_enable, and their
        disable, call.

        With ``enable``, every ``every_n_layers``-th sublayer (attention, mixer or MLP) is recomputed in the backward
        pass with ``gradient_checkpointing_func``, as in the trainer's activation_checkpoint modes. Without it, the
        plain sublayers come back."""
        from hybridtitan.parallel import apply_activation_checkpointing, remove_activation_checkpointing

        if enable and gradient_checkpointing_func is not None:
            # the sublayers take keyword arguments, which torch's reentrant checkpoint cannot pass. Some transformers
            # releases ask for reentrant by default, and torch's own default is reentrant too.
            keywords = getattr(gradient_checkpointing_func, "keywords", None) or {}
            if keywords.get("use_reentrant") is not False:
                if keywords.get("use_reentrant"):
                    logger.warning("HybridTitanForCausalLM: activation checkpointing runs with use_reentrant=False "
                                   "(its sublayers take keyword arguments)")
                gradient_checkpointing_func = functools.partial(gradient_checkpointing_func, use_reentrant=False)
        remove_activation_checkpointing(self.model)
        if enable:
            apply_activation_checkpointing(self.model, "full" if every_n_layers <= 1 else "selective",
                                           every_n_layers, checkpoint_fn=gradient_checkpointing_func)
        self.gradient_checkpointing = enable  # what transformers' is_gradient_checkpointing looks for

    def _rows_alone(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: HybridCache | None,
                    collected: list | None) -> torch.Tensor:
        """The final-normed hidden states [B, T, D] of a padded batch, with each row's real tokens fed alone.

        A recurrent state, a convolution window or attention never sees a pad, and the pads' states are zero. Where a
        cache is kept, it holds the rows' states stacked (InferenceCache.stack). The rows' hidden states go into
        ``collected``."""
        B, T = input_ids.shape
        rows, caches, hiddens = [], [], []
        for i in range(B):
            real = attention_mask[i].bool()
            inner = InferenceCache(len(self.model.layers)) if cache is not None else None
            mine = [] if collected is not None else None
            rows.append(real)
            hiddens.append((self.model.hidden_states(input_ids[i, real][None], cache=inner, collect=mine), mine))
            caches.append(inner)
        if cache is not None:
            cache.inner = InferenceCache.stack(caches)

        def placed(tensors: list[torch.Tensor]) -> torch.Tensor:
            out = tensors[0].new_zeros(B, T, tensors[0].shape[-1])
            for i, (real, t) in enumerate(zip(rows, tensors)):
                out[i, real] = t[0]
            return out

        if collected is not None:
            collected.extend(placed([mine[j] for _, mine in hiddens]) for j in range(len(hiddens[0][1])))
        return placed([h for h, _ in hiddens])

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        cache: HybridCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        return_dict: bool | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values: HybridCache | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        if input_ids is None:
            raise ValueError("HybridTitanForCausalLM needs input_ids (inputs_embeds are not supported)")
        if cache is None:
            cache = past_key_values
        if use_cache is None:
            # by default an eval forward returns a cache to decode on, except for a padded batch (scoring,
            # evaluation: generate() asks for one). A cache passed in is used, never dropped.
            use_cache = self.config.use_cache and not self.training and (cache is not None
                                                                         or not _padded(attention_mask))
        if cache is not None and not isinstance(cache, HybridCache):
            raise TypeError(f"HybridTitanForCausalLM needs a HybridCache, got {type(cache).__name__}")
        if getattr(self, "gradient_checkpointing", False) and torch.is_grad_enabled():
            # the backward pass runs each sublayer again, which would advance a cache a second time
            if cache is not None:
                raise ValueError("HybridTitanForCausalLM cannot update a cache under activation checkpointing with "
                                 "gradients on: call it under torch.no_grad(), or switch checkpointing off")
            use_cache = False
        # a cache passed in is always used and updated, as transformers' models do; use_cache only says whether
        # a new one is made
        if use_cache and cache is None:
            cache = HybridCache(len(self.model.layers))
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        # as transformers' models: the embeddings' output, each sublayer's input after it, the final-normed states
        collected = [] if output_hidden_states else None
        with _kernel_failures(self.uses_fla_kernels):
            if _left_padded(attention_mask) and not (cache is not None and cache.seen_tokens):
                # prompts of other lengths: each row alone, no pad in any state; a cache then holds the rows stacked
                h = self._rows_alone(input_ids, attention_mask, cache, collected)
            else:
                _check_mask(attention_mask, with_cache=cache is not None)
                h = self.model.hidden_states(input_ids, cache=cache.inner if cache is not None else None,
                                             collect=collected)
        all_hidden = tuple(collected) if collected is not None else None
        if cache is not None:
            cache.seen_tokens += input_ids.shape[1]
        if labels is None and isinstance(logits_to_keep, int) and logits_to_keep > 0:
            h = h[:, -logits_to_keep:]
        elif labels is None and isinstance(logits_to_keep, torch.Tensor):
            h = h[:, logits_to_keep]
        logits = (h @ self.model.output_weight.t()).float()
        loss = None
        if labels is not None:
            # transformers' Trainer passes num_items_in_batch, the counted labels of all of a step's accumulated
            # micro-batches, and then leaves the loss unscaled. The sum over that count keeps the step's loss and
            # gradients the same for any number of micro-batches.
            num_items = kwargs.get("num_items_in_batch")
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                   labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100,
                                   reduction="mean" if num_items is None else "sum")
            if num_items is not None:
                loss = loss / torch.as_tensor(num_items, device=loss.device)
        if return_dict is None:
            return_dict = self.config.return_dict
        if return_dict is False:
            out = (logits, *(x for x in (cache, all_hidden) if x is not None))
            return (loss, *out) if loss is not None else out
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=all_hidden, **{_CACHE_FIELD: cache})


@contextlib.contextmanager
def _kernel_failures(on_fla: bool):
    """Turns a failure inside FLA's or Triton's code into one line that says what to install, instead of a compiler's
    traceback. Such a failure is a kernel that does not compile, or one that FLA refuses under this Triton."""
    try:
        yield
    except Exception as e:
        where = [f.filename for f in traceback.extract_tb(e.__traceback__)]
        if not on_fla or not any(f"{os.sep}{pkg}{os.sep}" in name for name in where for pkg in ("triton", "fla")):
            raise
        raise RuntimeError(kernel_failure_message(e)) from None


def kernel_failure_message(e: Exception) -> str:
    def version(module: str) -> str:
        try:
            return __import__(module).__version__
        except Exception:  # noqa: BLE001 - a version is only shown
            return "?"

    first = (str(e).strip().splitlines() or [""])[0][:300]
    return (f"FLA's GPU kernels failed ({type(e).__name__}: {first}) under torch {torch.__version__}, triton "
            f"{version('triton')}, flash-linear-attention {version('fla')}: pip install -U 'triton>=3.7.1' "
            "'flash-linear-attention>=0.6.0' (a pair checked on an H100/H200), or load the model with "
            "use_fla_kernels=False to run the PyTorch forms")


def _left_padded(attention_mask: torch.Tensor | None) -> bool:
    """Whether a 2-D mask has a pad before a real token in some row (left padding, or pads anywhere but at the end)."""
    if not _padded(attention_mask):
        return False
    m = attention_mask.long()
    return bool((m[:, 1:] > m[:, :-1]).any())


def _padded(attention_mask: torch.Tensor | None) -> bool:
    return attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all())


def _check_mask(attention_mask: torch.Tensor | None, with_cache: bool) -> None:
    """Checks the mask of a batch fed whole. Right padding is harmless in a causal forward without a cache. A cache that
    decodes from left-padded rows (already set aside by _rows_alone) takes masks whose new positions are real."""
    if not _padded(attention_mask):
        return
    if with_cache and not _left_padded(attention_mask):
        raise ValueError("HybridTitanForCausalLM cannot decode right-padded batches (the next token would follow the "
                         "pads): pad on the left (tokenizer.padding_side = 'left'), as generate() expects")
