"""Imports a Primus (Megatron-LM) checkpoint as a DCP step-0 that training can start from. Only the model is imported;
the optimizer state does not carry over.

    python -m hybridtitan.import_hf --model output/.../checkpoints --output outputs/ft/checkpoint/step-0

``--model`` is a run's checkpoint folder or one ``iter_N`` folder. For a run's folder, the iteration is the one
``latest_checkpointed_iteration.txt`` names, else the highest ``iter_N``. Both formats Primus saves are read:

* ``torch``: ``iter_N/mp_rank_XX/model_optim_rng.pt``, a torch.save dict with ``model`` (the state dict),
  ``args`` (Megatron's argparse Namespace) and ``iteration``. Pipeline stages (``mp_rank_XX_YYY``, stage YYY) are
  joined in order. Each stage numbers its layers from 0, so its layers follow the previous stages'. Several
  tensor-parallel ranks (mp_rank_00, mp_rank_01, ...) are merged. Column-parallel weights, and the vocabulary of
  the embedding and output layer, are joined along their rows. Row-parallel weights are joined along their
  columns. Fused projections are joined block by block, because each rank holds its share of every block of
  ``[z | x | B | C | dt]``, of ``[gate; up]``, and so on. Replicated tensors are taken once.
* ``fsdp_dtensor``: DCP files (``.metadata``, ``__R_0.distcp``) with the model under ``model.module.``. The SwiGLU
  ``linear_fc1.weight`` is saved as its two halves, ``weight_w`` (gate) and ``weight_v`` (up). ``args`` is a
  pickled item.

Every file is read without executing anything in it. torch.load runs with ``weights_only`` and an allow-list of
the types Megatron saves besides tensors: argparse.Namespace, numpy's arrays of the RNG state, io.BytesIO of
Transformer Engine's ``_extra_state``, and Megatron's own enums. Stand-in classes record the enums by value, so
Megatron need not be installed. Any other type is refused in one line that names it.

The model's arguments come from ``args``: the pattern, the sizes, the vocabulary (``padded_vocab_size``), tied
embeddings, ``layernorm_epsilon``, and the MLA and GDN/KDA head sizes. The pattern is ``hybrid_override_pattern``,
``hybrid_layer_pattern``, or ``hybrid_attention_ratio`` by Primus's placement rule. The mixer kind, Mamba2's expand and
the convolution widths come from the tensors, because Primus sets them in its layer spec, not in ``args``. Each
character of the pattern is one ``decoder.layers.{i}``, which becomes hybridtitan's sublayer ``layers.{i}``. Megatron's
names become ours as follows::

    embedding.word_embeddings.weight, decoder.final_norm.weight, output_layer.weight (untied)
                                            -> embeddings.weight, norm.weight, lm_head.weight
    pre-norm: mixer.in_proj.layer_norm_weight | norm.weight | input_layernorm.weight
              | mlp.linear_fc1.layer_norm_weight | pre_mlp_layernorm.weight          -> layers.{i}.norm.weight
    Mamba2  mixer.{in_proj [z|x|B|C|dt], conv1d, A_log, D, dt_bias, norm, out_proj} -> mixer.<the same names>
    GDN     mixer.in_proj [q|k|v|g|b|a], conv1d [q|k|v], A_log, dt_bias, out_norm, out_proj
                                            -> mixer.{q,k,v,g,b,a}_proj, {q,k,v}_conv1d, A_log, dt_bias, o_norm, o_proj
    KDA     mixer.in_proj [q|k|v|f_a|g_a|beta], f_b_proj, g_b_proj, conv1d [q|k|v], A_log [1,1,H,1], dt_bias,
            out_norm, out_proj              -> mixer.{q,k,v}_proj, f_proj.{0,1}, g_proj.{0,1}, b_proj, ... (A_log [H])
    MLA     self_attention.linear_q_down_proj, q_layernorm and/or linear_q_up_proj.layer_norm_weight,
            linear_q_up_proj (or linear_q_proj), linear_kv_down_proj [c_kv | k_rope], kv_layernorm and/or
            linear_kv_up_proj.layer_norm_weight, linear_kv_up_proj, linear_proj
                                            -> attn.q_down_proj, q_norm, q_up_proj (q_proj), kv_down_proj, kv_norm,
                                               kv_up_proj, o_proj
    MLP     mlp.linear_fc1 [gate; up], linear_fc2 -> mlp.gate_proj, up_proj, down_proj

Megatron's MLA rotates channel 2i of a RoPE part with channel 2i+1: it de-interleaves them before a rotate-half.
hybridtitan rotates channel i with i + d/2. So the RoPE rows of the query projection (per head) and of the shared RoPE
key are reordered, even channels first, then odd. The attention scores are unchanged. ``_extra_state`` entries carry no
weights and are skipped. KDA's ``gate_norm``, which Primus builds but never applies, is left out.

Primus's TE hybrid specs (Zebra-Llama's ``hybrid_stack_spec``, ``gdn_hybrid_stack_spec``, ``kda_hybrid_stack_spec``)
normalise each MLA latent twice: q_layernorm, then the norm fused into linear_q_up_proj, and likewise for kv. The two
become hybridtitan's one norm exactly (``_latent_norm``). The latent's rows of the down projection are scaled by
sqrt((a² + ε) / ε), and the norm's weight is a·b / sqrt(a² + ε), where a and b are the two norms' weights. The function
is the same, but the parametrization is not. Those rows are about |a| / sqrt(ε) times larger, so AdamW moves them
relatively less than Primus's run would.

What cannot be reproduced exactly is refused in one line, and nothing is written:

* a LayerNorm model;
* zero-centred norm weights (``apply_layernorm_1p``);
* linear biases (any tensor the mapping does not use);
* a Mamba2 sublayer without a pre-norm (Primus's no-TE Mamba spec), because hybridtitan normalises the input of
  every sublayer;
* a sublayer whose input is normalised twice (a pre-norm and a fused one);
* MoE or other layer types, and virtual pipeline stages;
* Megatron's torch_dist format.

The weights imported are the model's own, with the values training kept (bfloat16 under ``bf16``). They are not the
optimizer's float32 master copy.

The optimizer state does not carry over. Megatron's distributed optimizer shards its moments and master weights its own
way (``distrib_optim.pt``, or the optimizer entries of the DCP files), and no hybridtitan optimizer reads that. The run
that starts from the step-0 begins with fresh AdamW moments and its own LR schedule and data order."""

from __future__ import annotations

import argparse
import io
import json
import os
import re

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner

from hybridtitan.errors import ConversionError, first_error_line
from hybridtitan.models import GDNArgs, KDAArgs, Mamba2Args, MLAArgs, ModelArgs
from hybridtitan.models.pattern import pattern_from_ratio

LATEST_FILE = "latest_checkpointed_iteration.txt"
TORCH_FILE = "model_optim_rng.pt"
ITER_RE = re.compile(r"^iter_(\d+)$")
RANK_RE = re.compile(r"^mp_rank_(\d+)$")
PIPELINE_RANK_RE = re.compile(r"^mp_rank_(\d+)_(\d+)$")
LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
FSDP_PREFIX = "model.module."
TORCH_DIST = ("Megatron's torch_dist format, which is not read: convert it to the torch format with Megatron's "
              "--ckpt-convert-format torch --ckpt-convert-save DIR (docs/primus.md)")

# Megatron's enums that its checkpoints hold (args.model_type, args.attention_backend, the rerun state machine's
# mode, ...), recorded by value: Megatron need not be installed to read its checkpoints.
MEGATRON_ENUMS = (
    "megatron.core.enums.ModelType",
    "megatron.core.enums.Fp8Recipe",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.CudaGraphScope",
    "megatron.core.rerun_state_machine.RerunMode",
)


class MegatronValue:
    """What a Megatron enum member in a checkpoint becomes here: its value, under its class's name."""

    megatron_name = ""

    def __init__(self, value):
        self.value = value

    def __repr__(self) -> str:
        return f"{self.megatron_name}({self.value!r})"


def _stand_in(name: str) -> type:
    return type(name.rsplit(".", 1)[1], (MegatronValue,), {"megatron_name": name})


def _allowed_globals() -> dict[str, object]:
    """The globals a Primus checkpoint may name besides torch's own, each with what it loads as."""
    import numpy as np

    try:  # numpy 2 (numpy.core in numpy 1)
        from numpy._core.multiarray import _reconstruct
    except ImportError:
        from numpy.core.multiarray import _reconstruct

    allowed: dict[str, object] = {"argparse.Namespace": argparse.Namespace, "_io.BytesIO": io.BytesIO,
                                  "numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype}
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):  # as numpy 2 and numpy 1 pickle it
        allowed[f"{module}._reconstruct"] = _reconstruct
    for name in dir(np.dtypes):  # the dtype classes of the arrays (numpy.dtypes.UInt32DType, ...)
        if name.endswith("DType"):
            allowed[f"numpy.dtypes.{name}"] = getattr(np.dtypes, name)
    allowed.update({name: _stand_in(name) for name in MEGATRON_ENUMS})
    return allowed


def safe_load(source: str | bytes, what: str):
    """torch.load of a file or bytes, with weights_only and the allow-list. Raises ConversionError naming a type outside
    the list, or saying what is wrong with a damaged file."""
    allowed = _allowed_globals()
    stream = io.BytesIO(source) if isinstance(source, bytes) else source
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(stream)
    except Exception as e:  # noqa: BLE001 -- a truncated or foreign file: one line
        raise ConversionError(f"cannot read {what}: {first_error_line(e, with_type=True)}") from None
    refused = [n for n in names if n not in allowed]
    if refused:
        raise ConversionError(f"{what} holds an object of type {refused[0]}, which is not among the types a Primus "
                              "checkpoint is read with (argparse.Namespace, numpy arrays, Megatron's enums); it is "
                              "not unpickled")
    if isinstance(stream, io.BytesIO):
        stream.seek(0)
    try:
        with torch.serialization.safe_globals([(obj, name) for name, obj in allowed.items()]):
            return torch.load(stream, map_location="cpu", weights_only=True, mmap=isinstance(source, str))
    except Exception as e:  # noqa: BLE001
        raise ConversionError(f"cannot read {what}: {first_error_line(e, with_type=True)}") from None


# ------------------------------------------------------------------------------------------ finding the iteration


def is_primus_checkpoint(path: str) -> bool:
    """Whether ``path`` looks like a Megatron checkpoint folder. A run's folder has latest_checkpointed_iteration.txt or
    iter_N folders. One iteration's folder has mp_rank_XX folders, or DCP files without hybridtitan's model_args.json.
    """
    from hybridtitan.checkpoint import MODEL_ARGS_FILE

    if not os.path.isdir(path):
        return False
    names = os.listdir(path)
    if LATEST_FILE in names or any(ITER_RE.match(n) or RANK_RE.match(n) or PIPELINE_RANK_RE.match(n)
                                   for n in names):
        return True
    return ".metadata" in names and MODEL_ARGS_FILE not in names and any(n.endswith(".distcp") for n in names)


def find_iteration(path: str) -> tuple[str, int | None]:
    """(the iter_N folder to read, N). This is ``path`` itself when it is an iter_N folder. Otherwise it is the
    iteration that latest_checkpointed_iteration.txt names, else the highest iter_N."""
    names = os.listdir(path)
    if not any(ITER_RE.match(n) for n in names) and LATEST_FILE not in names:
        m = ITER_RE.match(os.path.basename(os.path.normpath(path)))
        return path, int(m.group(1)) if m else None
    latest = os.path.join(path, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest) as f:
            text = f.read().strip()
        if text == "release":
            folder = os.path.join(path, "release")
            if not os.path.isdir(folder):
                raise ConversionError(f"{latest} says 'release', but {folder} is missing")
            return folder, None
        if not text.isdigit():
            raise ConversionError(f"{latest} holds {text[:40]!r}, not an iteration number")
        folder = os.path.join(path, f"iter_{int(text):07d}")
        if not os.path.isdir(folder):
            raise ConversionError(f"{latest} names iteration {int(text)}, but {folder} is missing")
        return folder, int(text)
    iters = sorted((int(m.group(1)), n) for n in names if (m := ITER_RE.match(n)))
    return os.path.join(path, iters[-1][1]), iters[-1][0]


# ------------------------------------------------------------------------------------------ reading the tensors


def _torch_file(folder: str, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    path = os.path.join(folder, name, TORCH_FILE)
    if not os.path.isfile(path):
        raise ConversionError(f"{path} is missing")
    ckpt = safe_load(path, path)
    if not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict):
        raise ConversionError(f"{path} holds no 'model' state dict: not a Megatron checkpoint of one model "
                              "(virtual pipeline stages, model0/model1, are not read)")
    return ckpt, {k: v for k, v in ckpt["model"].items() if not k.endswith("_extra_state")}


def _join_stages(stages: list[dict[str, torch.Tensor]], folder: str, tp: int) -> dict[str, torch.Tensor]:
    """One tensor-parallel rank's state, joined from its pipeline stages. In Megatron's torch format each stage numbers
    its decoder layers from 0, so stage s's layers follow those of the stages before it."""
    state: dict[str, torch.Tensor] = {}
    offset = 0
    for pp, local in enumerate(stages):
        layers = sorted({int(m.group(1)) for k in local if (m := LAYER_RE.match(k))})
        if layers != list(range(len(layers))):
            raise ConversionError(f"{folder}/mp_rank_{tp:02d}_{pp:03d}: its decoder layers {layers[:4]}... are not "
                                  "numbered from 0 without a gap, as a pipeline stage's are")
        for k, v in local.items():
            m = LAYER_RE.match(k)
            name = f"decoder.layers.{int(m.group(1)) + offset}.{k[m.end():]}" if m else k
            if name in state:
                raise ConversionError(f"{folder}: {name} is held by two pipeline stages (the second "
                                      f"mp_rank_{tp:02d}_{pp:03d})")
            state[name] = v
        offset += len(layers)
    return state


def read_torch_format(folder: str) -> tuple[argparse.Namespace | None, list[dict[str, torch.Tensor]], object, int]:
    """(args, the model state of each tensor-parallel rank, iteration, pipeline stages) of an iter_N folder in the torch
    format. Its rank folders are mp_rank_XX (tensor-parallel rank XX) or mp_rank_XX_YYY (also pipeline stage YYY)."""
    names = sorted(os.listdir(folder))
    plain = sorted((int(m.group(1)), 0, n) for n in names if (m := RANK_RE.match(n)))
    staged = sorted((int(m.group(1)), int(m.group(2)), n) for n in names if (m := PIPELINE_RANK_RE.match(n)))
    if plain and staged:
        raise ConversionError(f"{folder} holds both {plain[0][2]} and {staged[0][2]}: the ranks of one run are "
                              "all mp_rank_XX or all mp_rank_XX_YYY")
    ranks = plain or staged
    tps = sorted({t for t, _, _ in ranks})
    pps = sorted({p for _, p, _ in ranks})
    grid = {(t, p) for t, p, _ in ranks}
    if tps != list(range(len(tps))) or pps != list(range(len(pps))) or len(grid) != len(tps) * len(pps):
        raise ConversionError(f"{folder}: the ranks {', '.join(n for _, _, n in ranks)} are not every tensor-"
                              "parallel rank (mp_rank_00 ...) of every pipeline stage (_000 ...) without a gap")
    by_rank = {(t, p): n for t, p, n in ranks}
    states, args, iteration = [], None, None
    for t in tps:
        stages = []
        for p in pps:
            ckpt, local = _torch_file(folder, by_rank[t, p])
            if (t, p) == (0, 0):
                args, iteration = ckpt.get("args"), ckpt.get("iteration")
            stages.append(local)
            del ckpt
        states.append(_join_stages(stages, folder, t) if staged else stages[0])
    return args, states, iteration, len(pps)


class RawBytesPlanner(DefaultLoadPlanner):
    """A DCP load planner that keeps the pickled items (``args``, ``iteration``) as bytes, for safe_load. DCP's default
    planner would unpickle them."""

    def __init__(self):
        super().__init__(flatten_state_dict=False)
        self.raw: dict[str, bytes] = {}

    def load_bytes(self, read_item, value) -> None:
        self.raw[read_item.dest_index.fqn] = value.read()


def read_fsdp_dtensor(folder: str) -> tuple[argparse.Namespace | None, list[dict[str, torch.Tensor]], object]:
    """(args, [the model state], iteration) of an iter_N folder in the fsdp_dtensor format (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except (Exception, CheckpointException) as e:  # noqa: BLE001
        raise ConversionError(f"cannot read the DCP metadata of {folder}: {first_error_line(e)}") from None
    items = metadata.state_dict_metadata
    state = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in items.items()
             if k.startswith(FSDP_PREFIX) and isinstance(v, TensorStorageMetadata) and not k.endswith("_extra_state")}
    if not state:
        raise ConversionError(f"{folder} holds DCP files but no model tensors under '{FSDP_PREFIX}': not a Primus "
                              f"fsdp_dtensor checkpoint; if it is {TORCH_DIST}")
    wanted = {**state, **{k: None for k in ("args", "iteration") if isinstance(items.get(k), BytesStorageMetadata)}}
    planner = RawBytesPlanner()
    try:
        dcp.load(wanted, checkpoint_id=folder, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as e:  # noqa: BLE001 -- CheckpointException is a BaseException
        raise ConversionError(f"cannot read the tensors of {folder}: {first_error_line(e)}") from None
    args = safe_load(planner.raw["args"], f"{folder}: args") if "args" in planner.raw else None
    iteration = safe_load(planner.raw["iteration"], f"{folder}: iteration") if "iteration" in planner.raw else None
    model: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        name = key[len(FSDP_PREFIX):]
        for half, part in ((".weight_w", 0), (".weight_v", 1)):
            if name.endswith(half):  # the SwiGLU fc1's gate (w) and up (v) halves
                base = name[: -len(half)] + ".weight"
                other = FSDP_PREFIX + base[: -len(".weight")] + (".weight_v" if part == 0 else ".weight_w")
                if other not in state:
                    raise ConversionError(f"{folder}: {key} has no matching {other[len(FSDP_PREFIX):]} (a SwiGLU "
                                          "fc1 is saved as both halves)")
                if part == 0:
                    model[base] = torch.cat([t, state[other]])
                break
        else:
            model[name] = t
    return args, [model], iteration


class RankTensors:
    """The model tensors of every tensor-parallel rank. ``take`` returns one name at a time as a whole tensor. ``left``
    lists what was never taken."""

    def __init__(self, states: list[dict[str, torch.Tensor]], source: str):
        self.states, self.tp, self.source = states, len(states), source
        self.taken: set[str] = set()
        names = set(states[0])
        for r, s in enumerate(states[1:], 1):
            if set(s) != names:
                odd = sorted(names ^ set(s))[0]
                raise ConversionError(f"{source}: tensor-parallel rank {r} and rank 0 differ in tensor {odd}")

    def __contains__(self, name: str) -> bool:
        return name in self.states[0]

    def names(self, prefix: str) -> list[str]:
        return sorted(k[len(prefix):] for k in self.states[0] if k.startswith(prefix))

    def local_shape(self, name: str) -> tuple[int, ...]:
        if name not in self:
            raise ConversionError(f"{self.source} lacks tensor {name}")
        return tuple(self.states[0][name].shape)

    def take(self, name: str, shape: tuple[int, ...], dim: int | None = None,
             parts: list[int] | None = None) -> torch.Tensor:
        """The whole tensor ``name`` of ``shape``.

        Where every rank holds all of it (replicated), this is rank 0's copy. Otherwise the ranks' shares are joined
        along ``dim``; with ``parts``, each rank holds its share of every block along it."""
        local = self.local_shape(name)
        self.taken.add(name)
        shards = [s[name] for s in self.states]
        if local == tuple(shape):
            return shards[0]
        tp = self.tp
        if dim is not None and len(local) == len(shape) and local[dim] * tp == shape[dim] and all(
                a == b for i, (a, b) in enumerate(zip(local, shape)) if i != dim):
            blocks = parts or [shape[dim]]
            if all(b % tp == 0 for b in blocks):
                split = [t.split([b // tp for b in blocks], dim=dim) for t in shards]
                return torch.cat([torch.cat([s[i] for s in split], dim=dim) for i in range(len(blocks))], dim=dim)
        shown = f" per rank of {tp}" if tp > 1 else ""
        raise ConversionError(f"{self.source}: tensor {name} has shape {local}{shown}, but the checkpoint's args "
                              f"imply {tuple(shape)}")

    def left(self) -> list[str]:
        return sorted(set(self.states[0]) - self.taken)


# ------------------------------------------------------------------------------------------ the model's arguments


def _arg(args, name: str, default=None):
    value = getattr(args, name, None)
    return default if value is None else value


def _need(args, name: str, kind=int):
    """args.<name> as ``kind``. Raises ConversionError where it is missing or not a number."""
    value = getattr(args, name, None)
    if value is None:
        raise ConversionError(f"args lack {name}, which the model's shape is read from")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConversionError(f"args.{name} is {value!r}, not a number") from None


def _pattern(args) -> str:
    for name in ("hybrid_override_pattern", "hybrid_layer_pattern"):
        if _arg(args, name):
            return str(_arg(args, name))
    if getattr(args, "hybrid_attention_ratio", None) is not None and _arg(args, "num_layers"):
        try:
            return pattern_from_ratio(int(args.num_layers), float(args.hybrid_attention_ratio))
        except ValueError as e:
            raise ConversionError(f"args: {first_error_line(e)}") from None
    raise ConversionError("args names no hybrid_override_pattern, hybrid_layer_pattern or hybrid_attention_ratio: "
                          "not a checkpoint of a Primus hybrid model")


LAYER_TYPES = {"*": "attention", "M": "mixer", "-": "mlp", "E": "MoE", "/": "multi-token prediction"}


def _layer_kind(src: RankTensors, i: int) -> str:
    """What decoder.layers.{i} holds, by its tensors: 'mla', 'mamba2', 'gdn', 'kda' or 'mlp'."""
    p = f"decoder.layers.{i}."
    names = src.names(p)
    if not names:
        raise ConversionError(f"{src.source} has no tensors of decoder.layers.{i}")
    has = set(names)
    if "mixer.f_b_proj.weight" in has:
        return "kda"
    if {"mixer.A_log", "mixer.D"} <= has:
        return "mamba2"
    if {"mixer.in_proj.weight", "mixer.out_norm.weight"} <= has:
        return "gdn"
    if "self_attention.linear_kv_down_proj.weight" in has:
        return "mla"
    if "mlp.linear_fc1.weight" in has or "mlp.linear_fc1.weight_w" in has:
        return "mlp"
    what = ("grouped-query attention" if "self_attention.linear_qkv.weight" in has
            else "a mixture of experts" if any(n.startswith("mlp.router.") or ".experts." in n for n in names)
            else "a layer of unknown type")
    raise ConversionError(f"decoder.layers.{i} holds {what} ({names[0]}, ...), which hybridtitan does not build; it "
                          "builds MLA attention, Mamba2, GDN, KDA and SwiGLU MLP sublayers")


def model_args_from_megatron(args, src: RankTensors) -> ModelArgs:
    """ModelArgs of a Primus hybrid from its saved Megatron args, checked against the kinds of its layers."""
    if getattr(args, "normalization", "RMSNorm") != "RMSNorm":
        raise ConversionError(f"args.normalization is {args.normalization!r}: hybridtitan's sublayers use RMSNorm, "
                              "so this model cannot be imported unchanged")
    if getattr(args, "apply_layernorm_1p", False):  # norms computing x·(1 + w), which ours do not
        raise ConversionError("args.apply_layernorm_1p is true (zero-centred norm weights): hybridtitan's RMSNorms "
                              "scale by the weight itself")
    if getattr(args, "swiglu", True) is False:
        raise ConversionError("args.swiglu is false: hybridtitan's MLPs are SwiGLU")
    pattern = _pattern(args)
    n_layers = int(_arg(args, "num_layers", len(pattern)))
    if len(pattern) != n_layers:
        raise ConversionError(f"args: the pattern {pattern!r} has {len(pattern)} symbols but num_layers is {n_layers}")
    for pos, ch in enumerate(pattern):
        if ch not in "*M-":
            what = LAYER_TYPES.get(ch, "unknown")
            raise ConversionError(f"args: the pattern {pattern!r} has layer type {ch!r} ({what}) at position {pos}; "
                                  "hybridtitan builds '*' (MLA attention), 'M' (a mixer) and '-' (SwiGLU MLP)")
    indices = {int(m.group(1)) for n in src.names("decoder.layers.") if (m := re.match(r"(\d+)\.", n))}
    if indices and max(indices) >= n_layers:
        raise ConversionError(f"{src.source} has tensors of decoder.layers.{max(indices)}, past the {n_layers} "
                              f"layers of its pattern {pattern!r}")
    kinds = [_layer_kind(src, i) for i in range(n_layers)]
    expected = {"*": ("mla",), "M": ("mamba2", "gdn", "kda"), "-": ("mlp",)}
    for i, (ch, kind) in enumerate(zip(pattern, kinds)):
        if kind not in expected[ch]:
            raise ConversionError(f"the pattern {pattern!r} says {LAYER_TYPES[ch]} ({ch!r}) at position {i}, but "
                                  f"decoder.layers.{i} holds {'an MLP' if kind == 'mlp' else kind.upper()} tensors")
    mixers = sorted({k for k in kinds if k in ("mamba2", "gdn", "kda")})
    if len(mixers) > 1:
        raise ConversionError(f"the checkpoint mixes {' and '.join(m.upper() for m in mixers)} layers; a "
                              "hybridtitan model has one mixer kind")
    tp = src.tp
    dim = _need(args, "hidden_size")
    fields = dict(vocab_size=int(_arg(args, "padded_vocab_size", src.local_shape("embedding.word_embeddings.weight")[0]
                                      * tp)),
                  dim=dim, n_layers=n_layers, ffn_dim=int(_arg(args, "ffn_hidden_size", 4 * dim)), pattern=pattern,
                  tie_embeddings=not bool(getattr(args, "untie_embeddings_and_output_weights", False)),
                  norm_eps=float(_arg(args, "layernorm_epsilon", 1e-5)),
                  init_std=float(_arg(args, "init_method_std", 0.02)),
                  hybrid_attention_ratio=float(_arg(args, "hybrid_attention_ratio", 0.0)))
    if mixers:
        mixer = mixers[0]
        first = kinds.index(mixer)
        fields["mixer"] = mixer
        conv = f"decoder.layers.{first}.mixer.conv1d.weight"
        conv_size = src.local_shape(conv)[-1]
        if mixer == "mamba2":
            d_inner = src.local_shape(f"decoder.layers.{first}.mixer.out_proj.weight")[-1] * tp
            if d_inner % dim:
                raise ConversionError(f"decoder.layers.{first}: Mamba2's inner width {d_inner} is not a multiple of "
                                      f"hidden_size {dim}")
            head_dim = int(_arg(args, "mamba_head_dim", 64))
            heads = _arg(args, "mamba_num_heads")
            if heads is not None and int(heads) * head_dim != d_inner:
                raise ConversionError(f"args: mamba_num_heads {heads} x mamba_head_dim {head_dim} is not the inner "
                                      f"width {d_inner} of decoder.layers.{first}.mixer")
            fields["mamba2"] = Mamba2Args(d_state=int(_arg(args, "mamba_state_dim", 128)), head_dim=head_dim,
                                          n_groups=int(_arg(args, "mamba_num_groups", 8)), expand=d_inner // dim,
                                          conv_size=conv_size)
        else:
            heads, v_heads = _need(args, "linear_num_key_heads"), _need(args, "linear_num_value_heads")
            head_dim, head_v_dim = _need(args, "linear_key_head_dim"), _need(args, "linear_value_head_dim")
            if mixer == "gdn":
                fields["gdn"] = GDNArgs(num_heads=heads, num_v_heads=v_heads, head_dim=head_dim,
                                        head_v_dim=head_v_dim, conv_size=conv_size)
            else:
                if heads != v_heads:
                    raise ConversionError(f"args: linear_num_key_heads {heads} != linear_num_value_heads {v_heads}: "
                                          "hybridtitan's KDA has as many key as value heads")
                fields["kda"] = KDAArgs(num_heads=heads, head_dim=head_dim, head_v_dim=head_v_dim, conv_size=conv_size)
    if "mla" in kinds:
        fields["attention"] = "mla"
        first = kinds.index("mla")
        p = f"decoder.layers.{first}.self_attention."
        factor = float(_arg(args, "rotary_scaling_factor", 1.0))
        if factor != 1.0 and _arg(args, "rope_type", "yarn") != "yarn":
            raise ConversionError(f"args: rope_type {args.rope_type!r} with rotary_scaling_factor {factor}: "
                                  "hybridtitan's MLA scales RoPE by YaRN only")
        latent = [f"{p}q_layernorm.weight", f"{p}linear_q_up_proj.layer_norm_weight",
                  f"{p}kv_layernorm.weight", f"{p}linear_kv_up_proj.layer_norm_weight"]
        q_lora = int(_arg(args, "q_lora_rank", 0))
        defaults = MLAArgs()
        fields["mla"] = MLAArgs(
            num_heads=_need(args, "num_attention_heads"), q_lora_rank=q_lora, kv_lora_rank=_need(args, "kv_lora_rank"),
            qk_nope_head_dim=_need(args, "qk_head_dim"), qk_rope_head_dim=_need(args, "qk_pos_emb_head_dim"),
            v_head_dim=_need(args, "v_head_dim"), rope_theta=float(_arg(args, "rotary_base", 10000)),
            rope_scaling_factor=factor,
            original_max_position_embeddings=int(_arg(args, "original_max_position_embeddings",
                                                      defaults.original_max_position_embeddings)),
            beta_fast=float(_arg(args, "beta_fast", defaults.beta_fast)),
            beta_slow=float(_arg(args, "beta_slow", defaults.beta_slow)),
            mscale=float(_arg(args, "mscale", defaults.mscale)),
            mscale_all_dim=float(_arg(args, "mscale_all_dim", defaults.mscale_all_dim)),
            latent_norm=any(n in src for n in latent))
    try:
        return ModelArgs(**fields)
    except (TypeError, ValueError) as e:
        raise ConversionError(f"args: {first_error_line(e)}") from None


# ------------------------------------------------------------------------------------------ the weights


def rope_rows_to_ours(w: torch.Tensor, rows: int) -> torch.Tensor:
    """Reorders the last ``rows`` rows of ``w`` (a RoPE part, [..., rows, in]) from Megatron's pairs (2i, 2i+1) to
    rotate-half's (i, i + rows/2): even rows first, then odd."""
    rope = w[..., -rows:, :]
    return torch.cat([w[..., :-rows, :], rope[..., 0::2, :], rope[..., 1::2, :]], dim=-2)


def _one_of(src: RankTensors, names: list[str], shape: tuple[int, ...], what: str) -> torch.Tensor:
    present = [n for n in names if n in src]
    if not present:
        raise ConversionError(f"{src.source} lacks {what} ({' or '.join(names)})")
    if len(present) > 1:
        raise ConversionError(f"{src.source}: {what} is there twice ({present[0]} and {present[1]}): two norms in a "
                              "row, which hybridtitan's single RMSNorm there does not reproduce")
    return src.take(present[0], shape)


def state_from_megatron(a: ModelArgs, src: RankTensors) -> dict[str, torch.Tensor]:
    """HybridLM's state dict from the Megatron tensors, by the mapping in the module docstring."""
    D = a.dim
    state = {"embeddings.weight": src.take("embedding.word_embeddings.weight", (a.vocab_size, D), 0),
             "norm.weight": _one_of(src, ["decoder.final_norm.weight", "decoder.final_layernorm.weight"], (D,),
                                    "the final norm")}
    if not a.tie_embeddings:
        state["lm_head.weight"] = src.take("output_layer.weight", (a.vocab_size, D), 0)
    elif "output_layer.weight" in src:
        out = src.take("output_layer.weight", (a.vocab_size, D), 0)
        if not torch.equal(out, state["embeddings.weight"]):
            raise ConversionError(f"{src.source}: args say the embedding and output weights are tied, but "
                                  "output_layer.weight differs from embedding.word_embeddings.weight")
    for i, kind in enumerate(a.kinds):
        p, q = f"decoder.layers.{i}.", f"layers.{i}."
        if kind == "attention":
            state.update(_mla(a, src, p, q + "attn."))
            state[q + "norm.weight"] = _one_of(src, [p + "input_layernorm.weight"], (D,), f"{p}'s pre-norm")
        elif kind == "mlp":
            F = a.ffn_dim
            state[q + "norm.weight"] = _one_of(src, [p + "mlp.linear_fc1.layer_norm_weight",
                                                     p + "pre_mlp_layernorm.weight"], (D,), f"{p}'s pre-norm")
            gate, up = src.take(p + "mlp.linear_fc1.weight", (2 * F, D), 0, [F, F]).split([F, F])
            state[q + "mlp.gate_proj.weight"], state[q + "mlp.up_proj.weight"] = gate, up
            state[q + "mlp.down_proj.weight"] = src.take(p + "mlp.linear_fc2.weight", (D, F), 1)
        else:
            norms = [p + "mixer.in_proj.layer_norm_weight", p + "norm.weight", p + "input_layernorm.weight"]
            if a.mixer == "mamba2" and not any(n in src for n in norms):
                raise ConversionError(f"{p[:-1]} (Mamba2) has no pre-norm, as in Primus's no-TE Mamba spec: "
                                      "hybridtitan normalises the input of every sublayer, so this model cannot be "
                                      "imported unchanged")
            state[q + "norm.weight"] = _one_of(src, norms, (D,), f"{p}'s pre-norm")
            state.update({"mamba2": _mamba2, "gdn": _gdn, "kda": _kda}[a.mixer](a, src, p + "mixer.", q + "mixer."))
    left = src.left()
    if left:
        more = f" and {len(left) - 1} more" if len(left) > 1 else ""
        raise ConversionError(f"{src.source} holds tensor {left[0]}{more}, which hybridtitan's model has no place "
                              "for (biases, LayerNorm, position embeddings and other layers are not built)")
    return state


def _latent_norm(src: RankTensors, sa: str, first: str, rank: int, eps: float,
                 what: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the latent's RMSNorm weight, the factor for each latent row of the down projection, or None).

    Primus's TE specs normalise a latent twice. The first norm is ``first`` (q_layernorm or kv_layernorm, weight a). The
    second is fused into the up projection (weight b). Both use eps. For a latent x the result is x·a·b /
    sqrt(mean(x²(a²+ε)) + ε²). One RMSNorm of eps computes that exactly, with weight a·b / sqrt(a²+ε), when the down
    projection's rows are scaled by sqrt((a²+ε)/ε)."""
    fused = f"{sa}linear_{first.split('_')[0]}_up_proj.layer_norm_weight"
    own = sa + first + ".weight"
    if own in src and fused in src:
        a, b = src.take(own, (rank,)).float(), src.take(fused, (rank,)).float()
        root = (a.square() + eps).sqrt()
        return a * b / root, root / eps ** 0.5
    return _one_of(src, [own, fused], (rank,), what), None


def _mla(a: ModelArgs, src: RankTensors, p: str, q: str) -> dict[str, torch.Tensor]:
    m, D = a.mla, a.dim
    H, qk = m.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim
    out = {}
    sa = p + "self_attention."
    if m.q_lora_rank > 0:
        down = src.take(sa + "linear_q_down_proj.weight", (m.q_lora_rank, D), 0)
        if m.latent_norm:
            out[q + "q_norm.weight"], scale = _latent_norm(src, sa, "q_layernorm", m.q_lora_rank, a.norm_eps,
                                                           f"{sa}'s query latent norm")
            down = down if scale is None else down.float() * scale[:, None]
        out[q + "q_down_proj.weight"] = down
        w, name = src.take(sa + "linear_q_up_proj.weight", (H * qk, m.q_lora_rank), 0), "q_up_proj"
    else:
        w, name = src.take(sa + "linear_q_proj.weight", (H * qk, D), 0), "q_proj"
    out[q + name + ".weight"] = rope_rows_to_ours(w.view(H, qk, -1), m.qk_rope_head_dim).reshape(H * qk, -1)
    kv_down = src.take(sa + "linear_kv_down_proj.weight", (m.kv_lora_rank + m.qk_rope_head_dim, D), 0)
    if m.latent_norm:
        out[q + "kv_norm.weight"], scale = _latent_norm(src, sa, "kv_layernorm", m.kv_lora_rank, a.norm_eps,
                                                        f"{sa}'s key/value latent norm")
        if scale is not None:  # the latent's rows only, not the shared RoPE key's
            kv_down = torch.cat([kv_down[: m.kv_lora_rank].float() * scale[:, None],
                                 kv_down[m.kv_lora_rank:].float()])
    out[q + "kv_down_proj.weight"] = rope_rows_to_ours(kv_down, m.qk_rope_head_dim)
    out[q + "kv_up_proj.weight"] = src.take(sa + "linear_kv_up_proj.weight",
                                            (H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), 0)
    out[q + "o_proj.weight"] = src.take(sa + "linear_proj.weight", (D, H * m.v_head_dim), 1)
    return out


def _mamba2(a: ModelArgs, src: RankTensors, p: str, q: str) -> dict[str, torch.Tensor]:
    m, D = a.mamba2, a.dim
    d_inner = D * m.expand
    H, GN = d_inner // m.head_dim, m.n_groups * m.d_state
    conv = [d_inner, GN, GN]
    out = {q + "in_proj.weight": src.take(p + "in_proj.weight", (sum(conv) + d_inner + H, D), 0,
                                          [d_inner, *conv, H]),
           q + "conv1d.weight": src.take(p + "conv1d.weight", (sum(conv), 1, m.conv_size), 0, conv),
           q + "conv1d.bias": src.take(p + "conv1d.bias", (sum(conv),), 0, conv),
           q + "out_proj.weight": src.take(p + "out_proj.weight", (D, d_inner), 1),
           q + "norm.weight": src.take(p + "norm.weight", (d_inner,), 0)}
    for name in ("A_log", "D", "dt_bias"):
        out[q + name] = src.take(p + name, (H,), 0)
    return out


def _linear_mixer_convs(src: RankTensors, p: str, q: str, qk: int, v: int, conv_size: int) -> dict:
    w = src.take(p + "conv1d.weight", (2 * qk + v, 1, conv_size), 0, [qk, qk, v])
    cq, ck, cv = w.split([qk, qk, v])
    return {q + "q_conv1d.weight": cq, q + "k_conv1d.weight": ck, q + "v_conv1d.weight": cv}


def _gdn(a: ModelArgs, src: RankTensors, p: str, q: str) -> dict[str, torch.Tensor]:
    g, D = a.gdn, a.dim
    qk, v, HV = g.num_heads * g.head_dim, g.num_v_heads * g.head_v_dim, g.num_v_heads
    blocks = [qk, qk, v, v, HV, HV]
    parts = src.take(p + "in_proj.weight", (sum(blocks), D), 0, blocks).split(blocks)
    out = {q + f"{n}_proj.weight": t for n, t in zip("qkvgba", parts)}
    out.update(_linear_mixer_convs(src, p, q, qk, v, g.conv_size))
    out[q + "A_log"] = src.take(p + "A_log", (HV,), 0)
    out[q + "dt_bias"] = src.take(p + "dt_bias", (HV,), 0)
    out[q + "o_norm.weight"] = src.take(p + "out_norm.weight", (g.head_v_dim,))
    out[q + "o_proj.weight"] = src.take(p + "out_proj.weight", (D, v), 1)
    return out


def _kda(a: ModelArgs, src: RankTensors, p: str, q: str) -> dict[str, torch.Tensor]:
    k, D = a.kda, a.dim
    H, qk, v, R = k.num_heads, k.num_heads * k.head_dim, k.num_heads * k.head_v_dim, k.head_v_dim
    blocks = [qk, qk, v, R, R, H]
    wq, wk, wv, f_a, g_a, beta = src.take(p + "in_proj.weight", (sum(blocks), D), 0, blocks).split(blocks)
    out = {q + "q_proj.weight": wq, q + "k_proj.weight": wk, q + "v_proj.weight": wv, q + "f_proj.0.weight": f_a,
           q + "g_proj.0.weight": g_a, q + "b_proj.weight": beta,
           q + "f_proj.1.weight": src.take(p + "f_b_proj.weight", (qk, R), 0),
           q + "g_proj.1.weight": src.take(p + "g_b_proj.weight", (v, R), 0),
           q + "g_proj.1.bias": src.take(p + "g_b_proj.bias", (v,), 0)}
    out.update(_linear_mixer_convs(src, p, q, qk, v, k.conv_size))
    if len(src.local_shape(p + "A_log")) == 4:  # Primus keeps it as [1, 1, H, 1]
        out[q + "A_log"] = src.take(p + "A_log", (1, 1, H, 1), 2).reshape(H)
    else:
        out[q + "A_log"] = src.take(p + "A_log", (H,), 0)
    out[q + "dt_bias"] = src.take(p + "dt_bias", (qk,), 0)
    out[q + "o_norm.weight"] = src.take(p + "out_norm.weight", (k.head_v_dim,))
    out[q + "o_proj.weight"] = src.take(p + "out_proj.weight", (D, v), 1)
    if p + "gate_norm.weight" in src:  # built by Primus's TE KDA spec, never applied in its forward
        src.take(p + "gate_norm.weight", src.local_shape(p + "gate_norm.weight"))
    return out


# ------------------------------------------------------------------------------------------ the whole import


def _sharded_backend(folder: str) -> str | None:
    """The backend Megatron's dist-checkpoint metadata.json names (torch_dist), or None."""
    try:
        with open(os.path.join(folder, "metadata.json")) as f:
            backend = json.load(f).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return None
    return backend if isinstance(backend, str) else None


def read_primus_checkpoint(path: str) -> tuple[ModelArgs, dict[str, torch.Tensor], str, argparse.Namespace]:
    """(ModelArgs, HybridLM's state dict, a description of what was read, Megatron's args) of a Primus run folder or
    iter_N folder, in either format."""
    folder, number = find_iteration(path)
    names = os.listdir(folder)
    if any(RANK_RE.match(n) or PIPELINE_RANK_RE.match(n) for n in names):
        fmt, (args, states, iteration, stages) = "torch", read_torch_format(folder)
    elif _sharded_backend(folder) == "torch_dist":
        raise ConversionError(f"{folder} is in {TORCH_DIST}")
    elif ".metadata" in names:
        (args, states, iteration), fmt, stages = read_fsdp_dtensor(folder), "fsdp_dtensor", 1
    else:
        raise ConversionError(f"{folder} holds neither mp_rank_XX folders (the torch format) nor DCP files (the "
                              "fsdp_dtensor format)")
    if args is None:
        raise ConversionError(f"{folder} holds no args (Megatron's arguments), which the model's shape is read from")
    if not isinstance(args, argparse.Namespace):
        raise ConversionError(f"{folder}: args is a {type(args).__name__}, not Megatron's argparse Namespace")
    pp = int(_arg(args, "pipeline_model_parallel_size", 1))
    if pp != stages:
        raise ConversionError(f"{folder} holds {stages} pipeline stage{'s' if stages > 1 else ''}, but args say "
                              f"pipeline_model_parallel_size {pp}")
    src = RankTensors(states, folder)
    if src.tp > 1 and int(_arg(args, "tensor_model_parallel_size", src.tp)) != src.tp:
        raise ConversionError(f"{folder} holds {src.tp} tensor-parallel ranks, but args say "
                              f"tensor_model_parallel_size {args.tensor_model_parallel_size}")
    if fmt == "fsdp_dtensor" and int(_arg(args, "tensor_model_parallel_size", 1)) > 1:
        raise ConversionError(f"{folder}: an fsdp_dtensor checkpoint of tensor_model_parallel_size "
                              f"{args.tensor_model_parallel_size} is not read (only 1)")
    try:
        model_args = model_args_from_megatron(args, src)
    except ConversionError:
        raise
    except (TypeError, ValueError) as e:  # a value of args of another type than Megatron's
        raise ConversionError(f"{folder}: args: {first_error_line(e, with_type=True)}") from None
    state = state_from_megatron(model_args, src)
    it = iteration if isinstance(iteration, int) else number
    ranks = f", {src.tp} tensor-parallel ranks merged" if src.tp > 1 else ""
    ranks += f", {stages} pipeline stages joined" if stages > 1 else ""
    return model_args, state, f"Primus {fmt} format, iteration {it}{ranks}; model only", args


def args_tokenizer(args, vocab_size: int):
    """(the tokenizer that Megatron's args name in tokenizer_model, or None; the reason when None). The name is a local
    folder, or a hub name that loads, from the cache where the hub is offline."""
    from hybridtitan.hf.convert import load_tokenizer

    name = _arg(args, "tokenizer_model")
    if not name:
        return None, "args name no tokenizer_model"
    try:
        return load_tokenizer(str(name), vocab_size), ""
    except ConversionError as e:
        return None, f"args.tokenizer_model {name} did not load: {first_error_line(e)}"


def primus_model(model: str, tokenizer: str | None = None):
    """(model, tokenizer or None, what was read) of a Primus checkpoint, for import_hf to write as a model-only step
    folder. Raises ConversionError, in one line, on bad input.

    The tokenizer is ``tokenizer`` where given, else the one args.tokenizer_model names if it loads, else none. What was
    read says which."""
    from hybridtitan.hf.convert import load_tokenizer, model_from_state

    model_args, state, description, args = read_primus_checkpoint(model)
    net = model_from_state(model_args, state, source=model)
    del state
    if tokenizer:
        tok, why = load_tokenizer(tokenizer, model_args.vocab_size), ""
    else:
        tok, why = args_tokenizer(args, model_args.vocab_size)
    return net, tok, description if tok is not None else f"{description}; no tokenizer saved ({why}; give --tokenizer)"
