"""Upcycling a Llama into a hybrid (Zebra-Llama, HyLo): a step-0 checkpoint that distillation starts from.

    python -m hybridtitan.upcycle --model LLAMA --mixer mamba2 --attention-layers 0,5,10,14 \\
        --output DUMP/checkpoint/step-0
    python -m hybridtitan.upcycle select --teacher LLAMA --student ILD_MAMBA2 --data VALIDATION --count 4

The Llama layers named in --attention-layers keep attention, as multi-latent attention (MLA). The other layers become
the mixer. Embeddings, norms and MLPs are copied. Each new sublayer starts from the attention it replaces:

* MLA (Zebra-Llama's re_init_q and re_init_kv). The queries come from the SVD of W_Q cut to the q rank:
  W_Q ~ U_r (S_r V_r^T) = q_up q_down. The keys and values come from one SVD of the GQA-expanded [W_K; W_V] cut
  to the kv rank: kv_down = S_r V_r^T, and kv_up = U_r split into per-head key (no-RoPE) and value rows. The
  RoPE key, shared by all heads, is the mean of W_K's RoPE rows over the key/value heads. W_O becomes o_proj.
  There are no latent norms, so the factors reproduce the projections as plain products. The RoPE rows are the
  whole rotation pairs of each head whose Llama frequency the MLA's RoPE also has: every
  (head_dim / rope dims)-th pair. Their rotations so stay the Llama's, up to the frequency scalings. The other
  pairs become the no-RoPE channels.
* Mamba2 (MambaInLlama): x <- W_V, B <- W_K, C <- W_Q, out_proj <- W_O, one head per attention head. x and B are
  per key/value head and shared by its group of heads, as in the attention. z, dt, A, D, the convolution and the
  norm start fresh.
* Gated DeltaNet (HyLo): q <- W_Q, k <- W_K and v <- W_V repeated to every head, o_proj <- W_O. Where the sizes
  differ, the overlapping blocks are copied. The gates, beta, the convolutions and the output norm start fresh.

--init takes the choices of INIT_CHOICES where the papers' code initialises otherwise ("amd": Zebra-Llama's).

For each MLA layer the output says how much of W_Q and of [W_K; W_V] the ranks keep, by the singular values discarded.
It also gives the relative error of each projection as the MLA holds it: W_K's no-RoPE rows, W_V, and the shared RoPE
key.

--attention-from and --mixers-from take those sublayers, with their MLPs, from students already trained by layer
distillation: an all-MLA and an all-mixer student of the same shapes. This is Zebra-Llama's second stage.

``select`` ranks the layers of an all-mixer student after layer distillation. The rank of a layer is how much swapping
it back to MLA lowers the KL divergence to the teacher on held-out data. It prints the chosen layers and the pattern."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

import torch

from hybridtitan.cli import OneLineParser, fail, one_line_errors
from hybridtitan.errors import ConversionError

MIXERS = ("mamba2", "gdn")

# Initialisations where upcycle differs from the papers' code. --init names those to take the other way, and "amd"
# names the ones AMD's Zebra-Llama code does otherwise. docs/upcycling.md gives the step-0 KL of each way.
INIT_CHOICES = {
    "mamba2_conv": "Mamba2's convolution weight and bias from nn.Conv1d's default uniform (Zebra-Llama's code), "
                   "not N(0, init_std) and 0",
    "mamba2_z_dt": "Mamba2's z and dt rows of in_proj from nn.Linear's default uniform (Zebra-Llama's code), "
                   "not N(0, init_std)",
    "mla_rope": "each MLA head's RoPE rows its last qk_rope_head_dim rows and its no-RoPE rows its first "
                "(Zebra-Llama's code), not whole rotation pairs at the MLA's frequencies",
    "gdn_paired": "each GDN head's values (and W_O's columns) from the Llama heads its keys come from, the rest "
                  "fresh, not the overlapping block (head h's values from other heads where the sizes differ)",
}
AMD_INIT = ("mamba2_conv", "mamba2_z_dt", "mla_rope")


def parse_init(text: str) -> frozenset[str]:
    """Parses --init into the set of INIT_CHOICES taken the other way. 'hybridtitan' gives none, 'amd' gives AMD_INIT,
    and a comma-separated list gives its choices."""
    names = {n.strip() for n in text.split(",") if n.strip()}
    if names == {"hybridtitan"}:
        return frozenset()
    if "amd" in names:
        names = (names - {"amd"}) | set(AMD_INIT)
    unknown = sorted(names - set(INIT_CHOICES))
    if unknown or not names:
        raise ConversionError(f"--init {text!r}: give hybridtitan, amd or comma-separated choices of "
                              f"{', '.join(INIT_CHOICES)}")
    return frozenset(names)


# ------------------------------------------------------------------------------------------------ linear algebra


@dataclasses.dataclass
class Kept:
    """What a rank-r factorisation of a matrix keeps. ``energy`` is the share of the sum of squared singular values. The
    relative Frobenius error of the product is sqrt(discarded / total)."""

    name: str
    rank: int
    full_rank: int
    energy: float

    @property
    def relative_error(self) -> float:
        return math.sqrt(max(1.0 - self.energy, 0.0))

    def __str__(self) -> str:
        return (f"{self.name} rank {self.rank} of {self.full_rank} keeps {100 * self.energy:.2f}% of its energy "
                f"(relative error {self.relative_error:.4f})")


@dataclasses.dataclass
class Fit:
    """How far a projection the MLA keeps is from the Llama's: ||approximation - original|| / ||original||."""

    name: str
    relative_error: float

    def __str__(self) -> str:
        return f"{self.name} relative error {self.relative_error:.4f}"


def _relative_error(approximation: torch.Tensor, original: torch.Tensor) -> float:
    return ((approximation - original).norm() / original.norm().clamp_min(1e-30)).item()


def low_rank(matrix: torch.Tensor, rank: int, name: str) -> tuple[torch.Tensor, torch.Tensor, Kept]:
    """The best rank-``rank`` approximation of ``matrix`` [m, n], as up @ down, in float32.

    Returns (up [m, rank], down [rank, n], what was kept), with up = U_r and down = diag(S_r) V_r^T."""
    U, S, Vh = torch.linalg.svd(matrix.float(), full_matrices=False)
    if rank > S.numel():
        raise ConversionError(f"{name}: rank {rank} exceeds the {S.numel()} singular values of a "
                              f"{tuple(matrix.shape)} matrix")
    energy = (S[:rank].square().sum() / S.square().sum().clamp_min(1e-30)).item()
    return U[:, :rank], S[:rank, None] * Vh[:rank], Kept(name, rank, S.numel(), energy)


def rope_rows(head_dim: int, rope_dims: int, nope_dims: int, last: bool = False) -> tuple[list[int], list[int]]:
    """The rows of a Llama head that become an MLA head's RoPE channels and its no-RoPE channels.

    The Llama uses rotate-half RoPE: row j pairs with row j + head_dim / 2, at frequency theta^(-2j/head_dim). The MLA's
    rope pair i turns at theta^(-2i/rope_dims), which is the Llama's pair j = i * head_dim / rope_dims. Those whole
    pairs, in rotate-half order, are the RoPE rows. The first nope_dims of the other rows are the no-RoPE rows.

    With ``last`` (--init mla_rope) the rows are Zebra-Llama's instead: the head's last rope_dims and its first
    nope_dims."""
    if rope_dims % 2 or head_dim % rope_dims:
        raise ConversionError(f"qk_rope_head_dim {rope_dims} must be even and divide the attention's head_dim "
                              f"{head_dim} (its RoPE pairs are taken whole)")
    if rope_dims + nope_dims > head_dim:
        raise ConversionError(f"qk_rope_head_dim + qk_nope_head_dim ({rope_dims} + {nope_dims}) exceed the attention's "
                              f"head_dim {head_dim}")
    if last:
        return list(range(head_dim - rope_dims, head_dim)), list(range(nope_dims))
    half, stride = head_dim // 2, head_dim // rope_dims
    pairs = [i * stride for i in range(rope_dims // 2)]
    rope = pairs + [j + half for j in pairs]
    rest = [r for r in range(head_dim) if r not in set(rope)]
    return rope, rest[:nope_dims]


def repeat_heads(w: torch.Tensor, heads: int, head_dim: int, groups: int) -> torch.Tensor:
    """Repeats each head's rows for its group: [heads * head_dim, D] -> [heads * groups * head_dim, D]. This is how
    grouped-query attention serves query heads h * groups ... from key/value head h."""
    return w.view(heads, head_dim, -1).repeat_interleave(groups, dim=0).reshape(heads * groups * head_dim, -1)


def mla_from_attention(attn: dict[str, torch.Tensor], gqa, mla,
                       last_rows: bool = False) -> tuple[dict[str, torch.Tensor], list[Kept | Fit]]:
    """MLA weights, under our names, from one grouped-query attention's q_proj, k_proj, v_proj and o_proj weights. Also
    returns what they keep of it. ``last_rows`` is passed to rope_rows."""
    H, KV, d = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim
    if mla.num_heads != H or mla.v_head_dim != d:
        raise ConversionError(f"an MLA from attention keeps its {H} heads and value dims {d} (got num_heads "
                              f"{mla.num_heads}, v_head_dim {mla.v_head_dim})")
    rope, nope = rope_rows(d, mla.qk_rope_head_dim, mla.qk_nope_head_dim, last_rows)
    per_head = nope + rope  # an MLA head's query/key channels: [no-RoPE | RoPE]
    out, kept = {}, []
    wq = attn["q_proj.weight"].float()
    if mla.q_lora_rank > 0:
        up, down, k = low_rank(wq, mla.q_lora_rank, "W_Q")
        out["q_down_proj.weight"] = down
        out["q_up_proj.weight"] = up.view(H, d, -1)[:, per_head].reshape(H * len(per_head), -1)
        kept.append(k)
    else:
        out["q_proj.weight"] = wq.view(H, d, -1)[:, per_head].reshape(H * len(per_head), -1)
    wk, wv = attn["k_proj.weight"].float(), attn["v_proj.weight"].float()
    stacked = torch.cat([repeat_heads(wk, KV, d, H // KV), repeat_heads(wv, KV, d, H // KV)])
    up, down, k = low_rank(stacked, mla.kv_lora_rank, "[W_K; W_V]")
    kept.append(k)
    k_up, v_up = up[:H * d].view(H, d, -1)[:, nope], up[H * d:].view(H, d, -1)
    out["kv_up_proj.weight"] = torch.cat([k_up, v_up], dim=1).reshape(H * (len(nope) + d), -1)
    shared_rope_key = wk.view(KV, d, -1)[:, rope].mean(0)
    out["kv_down_proj.weight"] = torch.cat([down, shared_rope_key])
    # the SVD's energy counts every row of [W_K; W_V]. Of W_K, the MLA keeps the no-RoPE rows from the SVD and
    # replaces the RoPE rows by one key shared by all heads. Report the error of each part as kept.
    approx = up @ down
    kept.append(Fit("W_K no-RoPE rows", _relative_error(approx[:H * d].view(H, d, -1)[:, nope],
                                                        stacked[:H * d].view(H, d, -1)[:, nope])))
    kept.append(Fit("W_V", _relative_error(approx[H * d:], stacked[H * d:])))
    kept.append(Fit("shared RoPE key", _relative_error(shared_rope_key.expand(KV, -1, -1),
                                                       wk.view(KV, d, -1)[:, rope])))
    out["o_proj.weight"] = attn["o_proj.weight"].float()
    return out, kept


def default_uniform(t: torch.Tensor, fan_in: int) -> torch.Tensor:
    """Fills ``t`` with U(-1/sqrt(fan_in), 1/sqrt(fan_in)). This is nn.Linear's and nn.Conv1d's default for weights
    (kaiming_uniform_ with a = sqrt(5)) and for biases."""
    bound = 1 / math.sqrt(fan_in)
    return t.uniform_(-bound, bound)


def mamba2_from_attention(attn: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor], gqa, m,
                          dim: int, init: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Mamba2 weights, under our names, from one attention.

    in_proj's x, B and C rows come from W_V, W_K and W_Q, and out_proj from W_O. z, dt and everything else come from
    ``fresh``, the student's own initialisation. For the ``init`` choices mamba2_z_dt and mamba2_conv, they are
    PyTorch's default uniform, drawn here."""
    H, KV, d = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim
    inner = dim * m.expand
    if (m.expand, m.head_dim, m.d_state, m.n_groups, m.xb_heads, inner) != (1, d, d, H, KV, H * d):
        raise ConversionError(f"a Mamba2 from attention has one head per attention head: expand 1, head_dim and "
                              f"d_state {d}, n_groups {H}, xb_heads {KV} (got expand {m.expand}, head_dim "
                              f"{m.head_dim}, d_state {m.d_state}, n_groups {m.n_groups}, xb_heads {m.xb_heads})")
    out = {k: v.float().clone() for k, v in fresh.items()}
    in_proj = out["in_proj.weight"]
    z, x, b, c, dt = in_proj.split([inner, KV * d, KV * d, H * d, in_proj.shape[0] - inner - 2 * KV * d - H * d])
    x.copy_(attn["v_proj.weight"])
    b.copy_(attn["k_proj.weight"])
    c.copy_(attn["q_proj.weight"])
    if "mamba2_z_dt" in init:  # (views of in_proj)
        default_uniform(z, dim)
        default_uniform(dt, dim)
    if "mamba2_conv" in init:  # depthwise: fan_in is the kernel width
        width = out["conv1d.weight"].shape[-1]
        default_uniform(out["conv1d.weight"], width)
        default_uniform(out["conv1d.bias"], width)
    out["out_proj.weight"] = attn["o_proj.weight"].float()
    return out


def gdn_from_attention(attn: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor], gqa,
                       paired=None) -> dict[str, torch.Tensor]:
    """Gated DeltaNet weights, under our names, from one attention.

    The q, k, v and o projections come from the attention's, with keys and values repeated to every head. Where the
    sizes differ, the overlapping block is copied. Everything else comes from ``fresh``.

    ``paired`` is the GDN's GDNArgs, for --init gdn_paired. Then each GDN head's values and W_O's columns come from the
    Llama rows its keys come from, as many as fit. Its other value rows and columns stay fresh."""
    H, KV, d = gqa.num_heads, gqa.num_kv_heads, gqa.head_dim
    source = {"q_proj.weight": attn["q_proj.weight"],
              "k_proj.weight": repeat_heads(attn["k_proj.weight"], KV, d, H // KV),
              "v_proj.weight": repeat_heads(attn["v_proj.weight"], KV, d, H // KV),
              "o_proj.weight": attn["o_proj.weight"]}
    out = {k: v.float().clone() for k, v in fresh.items()}
    for name, w in source.items():
        if paired is not None and name in ("v_proj.weight", "o_proj.weight"):
            continue
        rows, cols = min(w.shape[0], out[name].shape[0]), min(w.shape[1], out[name].shape[1])
        out[name][:rows, :cols] = w[:rows, :cols]
    if paired is not None:
        if paired.num_v_heads != paired.num_heads:
            raise ConversionError(f"--init gdn_paired pairs each GDN head's keys with its values: it needs "
                                  f"num_v_heads = num_heads (got {paired.num_v_heads} and {paired.num_heads})")
        K, V = paired.head_dim, paired.head_v_dim
        v, o = source["v_proj.weight"].float(), source["o_proj.weight"].float()
        for h in range(paired.num_heads):
            start = h * K  # the Llama rows of this head's keys
            n = max(min(K, V, v.shape[0] - start), 0)
            out["v_proj.weight"][h * V: h * V + n] = v[start: start + n]
            out["o_proj.weight"][:, h * V: h * V + n] = o[:, start: start + n]
    return out


# ------------------------------------------------------------------------------------------------ the model


def sublayer_state(state: dict[str, torch.Tensor], index: int, body: str | None = None) -> dict[str, torch.Tensor]:
    """The tensors of sublayer ``index``, named relative to it. With ``body``, only that body's tensors."""
    prefix = f"layers.{index}." + (f"{body}." if body else "")
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def upcycle_state(llama, llama_state: dict[str, torch.Tensor], student, fresh: dict[str, torch.Tensor],
                  attention_from: dict[str, torch.Tensor] | None = None,
                  mixers_from: dict[str, torch.Tensor] | None = None,
                  init: frozenset[str] = frozenset()) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The student's state from the Llama's, and one line per layer saying what its new sublayer kept.

    ``fresh`` is the student's own initialisation, for what attention does not give. ``attention_from`` and
    ``mixers_from`` are the states of trained students of the same shapes. Their MLA or mixer layers, each with the MLP
    after it, are taken whole. ``init`` is the set of INIT_CHOICES taken the other way."""
    out = {k: v.float() for k, v in llama_state.items() if not k.startswith("layers.")}
    report = []
    for i, kind in enumerate(student.kinds):
        if kind == "mlp":
            continue
        trained = attention_from if kind == "attention" else mixers_from
        if trained is not None:
            for j in (i, i + 1):  # the sublayer and the MLP after it, as layer distillation trained them
                out.update({f"layers.{j}.{k}": v.float() for k, v in sublayer_state(trained, j).items()})
            report.append(f"layer {i // 2}: {'MLA' if kind == 'attention' else student.mixer} from the trained student")
            continue
        for j in (i, i + 1):  # the norms and the MLP, as they are
            out[f"layers.{j}.norm.weight"] = llama_state[f"layers.{j}.norm.weight"].float()
        out.update({f"layers.{i + 1}.mlp.{k}": v.float() for k, v in sublayer_state(llama_state, i + 1, "mlp").items()})
        attn = sublayer_state(llama_state, i, "attn")
        if kind == "attention":
            body, kept = mla_from_attention(attn, llama.gqa, student.mla, "mla_rope" in init)
            report.append(f"layer {i // 2}: MLA: " + "; ".join(map(str, kept)))
            name = "attn"
        elif student.mixer == "mamba2":
            body = mamba2_from_attention(attn, sublayer_state(fresh, i, "mixer"), llama.gqa, student.mamba2,
                                         student.dim, init)
            report.append(f"layer {i // 2}: Mamba2: x, B, C and out_proj from W_V, W_K, W_Q and W_O")
            name = "mixer"
        else:
            body = gdn_from_attention(attn, sublayer_state(fresh, i, "mixer"), llama.gqa,
                                      student.gdn if "gdn_paired" in init else None)
            report.append(f"layer {i // 2}: GDN: q, k, v and o projections from the attention's")
            name = "mixer"
        out.update({f"layers.{i}.{name}.{k}": v for k, v in body.items()})
    if init:
        report.insert(0, "initialised the other way (--init): " + "; ".join(INIT_CHOICES[n] for n in sorted(init)))
    return out, report


def parse_layers(text: str, n_layers: int) -> list[int]:
    """Parses '0,5,10,14', 'all' or 'none' into layer indices. Raises ConversionError for an index outside the model."""
    t = text.strip().lower()
    if t == "all":
        return list(range(n_layers))
    if t in ("none", ""):
        return []
    try:
        layers = sorted({int(x) for x in t.split(",") if x.strip()})
    except ValueError:
        raise ConversionError(f"--attention-layers must be comma-separated layer indices, all or none "
                              f"(got {text!r})") from None
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ConversionError(f"--attention-layers: layer {bad[0]} is out of range: the Llama has {n_layers} layers "
                              f"(0-{n_layers - 1})")
    return layers


def student_args(llama, attention_layers: list[int], mixer: str, **ranks):
    from hybridtitan.models.flavors import upcycled

    if mixer not in MIXERS:
        raise ConversionError(f"--mixer {mixer!r}: upcycling initialises {' or '.join(MIXERS)} from attention (no "
                              "public initialisation of KDA from attention is known)")
    try:
        args = upcycled(llama, attention_layers, mixer, **ranks)
    except ValueError as e:
        raise ConversionError(str(e)) from None
    rope_rows(llama.gqa.head_dim, args.mla.qk_rope_head_dim, args.mla.qk_nope_head_dim)  # fits, said before any work
    return args


ROPE_EXTENSION = ("rope_scaling_factor", "original_max_position_embeddings")


def matching_flavor(args) -> tuple[str, list[str]] | None:
    """A named flavor that equals ``args`` up to the pattern, the mixer and the MLA's YaRN extension. Returns its name
    and the recipe keys that turn it into ``args``, or None where no flavor matches."""
    from hybridtitan.models import FLAVORS

    for name, flavor in FLAVORS.items():
        rope = {k: getattr(args.mla, k) for k in ROPE_EXTENSION}
        try:
            candidate = dataclasses.replace(flavor, n_layers=args.n_layers, pattern=args.pattern, mixer=args.mixer,
                                            mla=dataclasses.replace(flavor.mla, **rope))
        except ValueError:  # a flavor whose sizes do not take this pattern or mixer
            continue
        if candidate == args:
            keys = [f"--model.pattern={args.pattern}"] + (
                [f"--model.mixer {args.mixer}"] if flavor.mixer != args.mixer else []) + [
                f"--model.mla.{k} {v}" for k, v in rope.items() if getattr(flavor.mla, k) != v]
            return name, keys
    return None


def read_student(path: str, args, what: str) -> dict[str, torch.Tensor]:
    """A trained student's state.

    It is refused unless the sublayers taken from it are where ``args`` has them and hold the same tensors (names and
    shapes). Those sublayers are the attention for --attention-from and the mixers for --mixers-from, each with the MLP
    after it. Its other settings may differ: the RoPE extension, and the kind and sizes of what is not taken."""
    from hybridtitan.model_loader import read_model
    from hybridtitan.models import build_model

    saved, state, _ = read_model(path)
    wanted = "*" if what == "--attention-from" else "M"
    expected = {k: tuple(v.shape) for k, v in build_model(args, "meta").state_dict().items()}
    for i, kind in enumerate(args.pattern):
        if kind != wanted:
            continue
        if saved.n_layers != args.n_layers or saved.pattern[i] != wanted:
            needed = "attention" if wanted == "*" else "a mixer"
            raise ConversionError(f"{what} {path}: its sublayer {i} is not {needed}"
                                  f" (its pattern is {saved.pattern})")
        for j in (i, i + 1):
            mine = {k: v for k, v in expected.items() if k.startswith(f"layers.{j}.")}
            theirs = {k: tuple(v.shape) for k, v in state.items() if k.startswith(f"layers.{j}.")}
            if mine != theirs:
                raise ConversionError(f"{what} {path} is not a student of this shape: its sublayer {j} holds other "
                                      "tensors than the upcycled model's")
    return state


def upcycled_model(llama, llama_state: dict[str, torch.Tensor], args, seed: int = 0, init: frozenset[str] = frozenset(),
                   attention_from: dict[str, torch.Tensor] | None = None,
                   mixers_from: dict[str, torch.Tensor] | None = None):
    """The student HybridLM on the CPU, and the report. Its fresh parameters are drawn with ``seed``. The rest come from
    the Llama (upcycle_state)."""
    from hybridtitan.models import build_model

    torch.manual_seed(seed)
    student = build_model(args, "cpu")
    student.init_weights()
    state, report = upcycle_state(llama, llama_state, args, student.state_dict(), attention_from, mixers_from, init)
    student.load_state_dict(state, strict=True)
    return student, report


def upcycle(model: str, output: str, *, mixer: str = "mamba2", attention_layers: str = "none",
            tokenizer: str | None = None, overwrite: bool = False, attention_from: str | None = None,
            mixers_from: str | None = None, seed: int = 0, init: str = "hybridtitan",
            **ranks) -> tuple[object, list[str]]:
    """Writes the step folder ``output``, upcycled from ``model``: a model-only DCP checkpoint with the tokenizer
    inside. ``init`` is as --init. Returns the student's ModelArgs and the report. Raises ConversionError or
    CheckpointError, in one line, before anything is written."""
    from hybridtitan.hf.convert import load_tokenizer, output_problem
    from hybridtitan.import_hf import write_step_folder
    from hybridtitan.model_folder import read_folder
    from hybridtitan.model_loader import read_model

    output = os.path.normpath(output)
    problem = output_problem(output, overwrite, "import")
    if problem:
        raise ConversionError(problem)
    llama, llama_state, _ = read_model(model)
    if llama.attention != "gqa" or llama.pattern != "*-" * (llama.n_layers // 2):
        raise ConversionError(f"{model} is not a Llama (grouped-query attention and MLPs, '*-' per layer): its "
                              f"pattern is {llama.pattern!r}")
    layers = parse_layers(attention_layers, llama.n_layers // 2)
    choices = parse_init(init)
    args = student_args(llama, layers, mixer, **ranks)
    tok_path = tokenizer or read_folder(model).tokenizer
    tok = load_tokenizer(tok_path, args.vocab_size) if tok_path else None
    trained_attention = read_student(attention_from, args, "--attention-from") if attention_from else None
    trained_mixers = read_student(mixers_from, args, "--mixers-from") if mixers_from else None
    student, report = upcycled_model(llama, llama_state, args, seed, choices, trained_attention, trained_mixers)
    write_step_folder(student, output, tok)
    return args, report


# ------------------------------------------------------------------------------------------------ selection


@torch.no_grad()
def kl_to_teacher(student, teacher, batches) -> float:
    """The mean KL(teacher || student) of the next-token distributions, per counted token over ``batches``."""
    from hybridtitan.ops import linear_kl_div

    total, count = 0.0, 0
    for b in batches:
        h_s = student.hidden_states(b["input_ids"], cu_seqlens=b.get("cu_seqlens"))
        h_t = teacher.hidden_states(b["input_ids"], cu_seqlens=b.get("cu_seqlens"))
        _, kl, _, n = linear_kl_div(h_s, student.output_weight, h_t, teacher.output_weight, b["labels"])
        total, count = total + kl.item(), count + int(n)
    return total / max(count, 1)


def rank_layers(teacher, student_args_, mixer_state, attention_state, batches, device="cpu",
                log=print) -> list[tuple[int, float]]:
    """(layer, KL with that layer as MLA) for every Llama layer, lowest KL first. The all-mixer student's KL is logged
    first. ``attention_state`` is the state of the MLA layers to swap in: an all-MLA student's, or upcycled ones."""
    from hybridtitan.models import build_model

    n = student_args_.n_layers // 2

    def student_with(layers):
        args = dataclasses.replace(student_args_, pattern="".join("*-" if i in layers else "M-" for i in range(n)))
        model = build_model(args, "cpu")
        state = dict(mixer_state)
        for i in layers:
            for j in (2 * i, 2 * i + 1):
                state = {k: v for k, v in state.items() if not k.startswith(f"layers.{j}.")}
                state.update({f"layers.{j}.{k}": v for k, v in sublayer_state(attention_state, j).items()})
        model.load_state_dict(state, strict=True)
        return model.to(device).eval()

    base = kl_to_teacher(student_with([]), teacher, batches)
    log(f"all-mixer student: KL to the teacher {base:.5f} per token")
    scores = []
    for i in range(n):
        kl = kl_to_teacher(student_with([i]), teacher, batches)
        log(f"layer {i} as MLA: KL {kl:.5f} ({kl - base:+.5f})")
        scores.append((i, kl))
    return sorted(scores, key=lambda s: s[1])


# ------------------------------------------------------------------------------------------------ CLI


def _rank_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("MLA sizes (default: Zebra-Llama's for the Llama's shape)")
    for name in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
        g.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int, default=None)
    g.add_argument("--rope-scaling-factor", dest="rope_scaling_factor", type=float, default=None,
                   help="the MLA's YaRN factor (default: the Llama's RoPE scaling factor, as Zebra-Llama)")
    g.add_argument("--original-max-position-embeddings", dest="original_max_position_embeddings", type=int,
                   default=None, help="YaRN's original context (default: the Llama's)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m hybridtitan.upcycle", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the Llama: a Hugging Face folder or a hybridtitan checkpoint")
    p.add_argument("--mixer", default="mamba2", help="mamba2 (Zebra-Llama) or gdn (HyLo)")
    p.add_argument("--attention-layers", dest="attention_layers", default="none",
                   help="the Llama layers that keep attention as MLA: comma-separated indices, all or none")
    p.add_argument("--output", required=True, help="the step folder to write, e.g. DUMP/checkpoint/step-0")
    p.add_argument("--attention-from", dest="attention_from", default=None,
                   help="take the MLA layers from this trained all-MLA student")
    p.add_argument("--mixers-from", dest="mixers_from", default=None,
                   help="take the mixer layers from this trained all-mixer student")
    p.add_argument("--tokenizer", default=None, help="tokenizer to save with it (default: the model's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fresh parameters (gates, convolutions)")
    p.add_argument("--init", default="hybridtitan",
                   help="hybridtitan (default), amd (" + ", ".join(AMD_INIT) + ": Zebra-Llama's code) or "
                        "comma-separated choices to initialise the other way: "
                        + "; ".join(f"{k}: {v}" for k, v in INIT_CHOICES.items()))
    p.add_argument("--overwrite", action="store_true", help="replace an earlier upcycled or imported step folder")
    _rank_options(p)
    return p


def build_select_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m hybridtitan.upcycle select",
                      description="Rank a Llama's layers by how much keeping each as MLA lowers the KL to it.")
    p.add_argument("--teacher", required=True, help="the Llama the student was distilled from")
    p.add_argument("--student", required=True, help="the all-mixer student after layer distillation")
    p.add_argument("--attention-from", dest="attention_from", default=None,
                   help="the all-MLA student after layer distillation (default: MLA upcycled from the teacher)")
    p.add_argument("--data", required=True, help="held-out documents: local files, or Megatron prefixes")
    p.add_argument("--source", default=None, help="hf or megatron (default: from --data)")
    p.add_argument("--tokenizer", default=None, help="default: the teacher's")
    p.add_argument("--count", type=int, default=4, help="how many layers keep attention")
    p.add_argument("--batches", type=int, default=8, help="held-out batches per measurement")
    p.add_argument("--batch-size", dest="batch_size", type=int, default=4)
    p.add_argument("--seq-len", dest="seq_len", type=int, default=2048)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    _rank_options(p)
    return p


def _ranks(args) -> dict:
    return {k: getattr(args, k) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                          "rope_scaling_factor", "original_max_position_embeddings")
            if getattr(args, k) is not None}


def select_main(argv: list[str]) -> None:
    a = build_select_parser().parse_args(argv)
    from hybridtitan.data import Data, HeldOut, build_tokenizer
    from hybridtitan.data.config import validate_data_config
    from hybridtitan.model_folder import read_folder
    from hybridtitan.model_loader import read_model
    from hybridtitan.models import build_model

    if a.count < 1 or a.batches < 1 or a.batch_size < 1 or a.seq_len < 2:
        fail("--count, --batches and --batch-size must be 1 or more, --seq-len 2 or more")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    with one_line_errors(ValueError):
        llama, llama_state, _ = read_model(a.teacher)
        if llama.attention != "gqa":
            raise ConversionError(f"--teacher {a.teacher} is not a Llama (grouped-query attention and MLPs)")
        student, mixer_state, _ = read_model(a.student)
        if "*" in student.pattern:
            raise ConversionError(f"--student {a.student} has attention layers ({student.pattern}): give the "
                                  "all-mixer student")
        reference = student_args(llama, [], student.mixer, **_ranks(a))
        if dataclasses.replace(student, pattern=reference.pattern) != reference:
            raise ConversionError(f"--student {a.student} is not upcycled from --teacher {a.teacher} with these MLA "
                                  "sizes")
        if a.attention_from:
            attention_state = read_student(a.attention_from, dataclasses.replace(
                reference, pattern="*-" * (reference.n_layers // 2)), "--attention-from")
        else:
            fresh = build_model(dataclasses.replace(reference, pattern="*-" * (reference.n_layers // 2)), "cpu")
            fresh.init_weights()
            attention_state, _ = upcycle_state(llama, llama_state, fresh.args, fresh.state_dict())
        tok_path = a.tokenizer or read_folder(a.teacher).tokenizer
        tok = build_tokenizer(tok_path)
        data = Data(path=a.data, tokenizer=tok_path or "", shuffle=False,
                    source=a.source or ("hf" if os.path.splitext(a.data)[1] in (".json", ".jsonl", ".txt", ".parquet")
                                        or os.path.isdir(a.data) else "megatron"))
        validate_data_config(data)
    held_out = HeldOut(data, tok, seq_len=a.seq_len, local_batch_size=a.batch_size, dp_rank=0, dp_world_size=1,
                       vocab_size=llama.vocab_size)
    batches = []
    for batch, _ in held_out.batches():
        batches.append({k: v.to(device) for k, v in batch.items()})
        if len(batches) == a.batches:
            break
    teacher = build_model(llama, "cpu")
    teacher.load_state_dict(llama_state)
    teacher = teacher.to(device).eval()
    scores = rank_layers(teacher, student, mixer_state, attention_state, batches, device,
                         log=lambda line: print(line, flush=True))
    chosen = sorted(i for i, _ in scores[: a.count])
    pattern = "".join("*-" if i in chosen else "M-" for i in range(student.n_layers // 2))
    print(f"layers ranked (lowest KL with the layer as MLA first): {', '.join(str(i) for i, _ in scores)}")
    print(f"chosen: --attention-layers {','.join(map(str, chosen))}   pattern {pattern}")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["select"]:
        return select_main(argv[1:])
    a = build_parser().parse_args(argv)
    if not os.path.exists(a.model):
        fail(f"model not found: {a.model}")
    with one_line_errors():
        args, report = upcycle(a.model, a.output, mixer=a.mixer, attention_layers=a.attention_layers,
                               tokenizer=a.tokenizer, overwrite=a.overwrite, attention_from=a.attention_from,
                               mixers_from=a.mixers_from, seed=a.seed, init=a.init, **_ranks(a))
    for line in report:
        print(line)
    print(f"upcycled {a.model} into {a.output}: pattern {args.pattern} ({args.mixer})")
    match = matching_flavor(args)
    start = f"--checkpoint.initial_load_path {a.output}"
    if match:
        print(f"train it with: --model.flavor {' '.join([match[0], *match[1]])} {start}")
    else:
        print(f"train it with: --model.flavor checkpoint {start} (no named flavor has these sizes: the run reads "
              "them from the checkpoint)")


if __name__ == "__main__":
    main()
