"""Model arguments: sizes of the stack and of each sublayer kind, validated once, before anything is built."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .pattern import parse_pattern, pattern_from_ratio

MIXERS = ("gdn", "kda", "mamba2")
ATTENTIONS = ("mla", "gqa")
ROPE_SCALINGS = ("none", "llama3")


@dataclass
class GDNArgs:
    """Gated DeltaNet (FLA's GatedDeltaNet with num_heads, num_v_heads, head_dim, expand_v = head_v_dim / head_dim)."""

    num_heads: int = 4  # query/key heads
    num_v_heads: int = 8  # value heads (grouped: a multiple of num_heads)
    head_dim: int = 64  # key dimension per head
    head_v_dim: int = 64  # value dimension per head
    conv_size: int = 4  # short causal convolution's kernel size


@dataclass
class KDAArgs:
    """Kimi Delta Attention: per-key-channel decay through a low-rank gate of rank head_v_dim (FLA's KDA)."""

    num_heads: int = 8
    head_dim: int = 32  # key dimension per head
    head_v_dim: int = 64  # value dimension per head, also the rank of the low-rank gates
    conv_size: int = 4  # short causal convolution's kernel size


@dataclass
class Mamba2Args:
    """Mamba2 (SSD), computed with the simple-GLA chunk kernel."""

    d_state: int = 64  # state size per head (the B and C width per group)
    head_dim: int = 64  # channels per head (heads = expand x dim / head_dim)
    n_groups: int = 8  # groups of heads sharing B and C
    expand: int = 2  # inner width = expand x dim
    conv_size: int = 4  # short causal convolution's kernel size
    xb_heads: int = 0  # x and B projected for this many heads, each shared by a group of heads (0: for every head)
    norm_eps: float = 1e-5  # the gated output norm's epsilon: Megatron's MambaMixer fixes 1e-5, as mamba_ssm and FLA


@dataclass
class MLAArgs:
    """DeepSeek-V2 multi-latent attention. With q_lora_rank = 0 the queries are projected directly."""

    num_heads: int = 16
    q_lora_rank: int = 672  # query latent width (0: queries projected directly)
    kv_lora_rank: int = 64  # key/value latent width
    qk_nope_head_dim: int = 32  # query/key dimension per head without RoPE
    qk_rope_head_dim: int = 32  # query/key dimension per head with RoPE (the key's part shared by all heads)
    v_head_dim: int = 64  # value dimension per head
    rope_theta: float = 500000.0  # RoPE base
    rope_scaling_factor: float = 1.0  # YaRN context extension factor (1: plain RoPE)
    original_max_position_embeddings: int = 4096  # YaRN: the context length trained without scaling
    beta_fast: float = 32.0  # YaRN: rotations above which frequencies are kept
    beta_slow: float = 1.0  # YaRN: rotations below which frequencies are interpolated
    mscale: float = 1.0  # YaRN attention temperature
    mscale_all_dim: float = 0.0  # YaRN attention temperature over all dimensions
    latent_norm: bool = True  # RMSNorm on the query and key/value latents (off: an MLA upcycled from attention)


@dataclass
class GQAArgs:
    """Llama's grouped-query attention with RoPE. Each of the num_kv_heads key/value heads is shared by num_heads /
    num_kv_heads query heads. rope_scaling "llama3" is Llama 3.1's frequency scaling."""

    num_heads: int = 32  # query heads
    num_kv_heads: int = 8  # key/value heads (dividing num_heads)
    head_dim: int = 64  # channels per head
    rope_theta: float = 500000.0  # RoPE base
    rope_scaling: str = "none"  # "none" or "llama3"
    rope_scaling_factor: float = 1.0  # llama3: how much slower the long wavelengths rotate
    low_freq_factor: float = 1.0  # llama3: wavelengths above original / low_freq_factor are slowed
    high_freq_factor: float = 4.0  # llama3: wavelengths below original / high_freq_factor are kept
    original_max_position_embeddings: int = 8192  # llama3: the context length trained without scaling


@dataclass
class ModelArgs:
    vocab_size: int = 128256
    dim: int = 1024
    n_layers: int = 24  # sublayers: the length of the pattern
    ffn_dim: int = 4096
    pattern: str = ""  # empty: built from hybrid_attention_ratio
    hybrid_attention_ratio: float = 0.0
    mixer: str = "gdn"
    attention: str = "mla"  # the '*' sublayer: multi-latent ("mla") or grouped-query ("gqa", Llama's) attention
    tie_embeddings: bool = True
    norm_eps: float = 1e-6
    init_std: float = 0.02
    gdn: GDNArgs = field(default_factory=GDNArgs)
    kda: KDAArgs = field(default_factory=KDAArgs)
    mamba2: Mamba2Args = field(default_factory=Mamba2Args)
    mla: MLAArgs = field(default_factory=MLAArgs)
    gqa: GQAArgs = field(default_factory=GQAArgs)

    def __post_init__(self):
        if not self.pattern:
            self.pattern = pattern_from_ratio(self.n_layers, self.hybrid_attention_ratio)
        self.validate()

    @property
    def kinds(self) -> list[str]:
        return parse_pattern(self.pattern)

    def validate(self) -> None:
        kinds = parse_pattern(self.pattern)
        if len(kinds) != self.n_layers:
            raise ValueError(
                f"model.pattern {self.pattern!r} has {len(kinds)} sublayers but model.n_layers is {self.n_layers}; "
                "they must be equal (one symbol per sublayer)"
            )
        if "attention" not in kinds and "mixer" not in kinds:
            raise ValueError(f"model.pattern {self.pattern!r} has no attention ('*') or mixer ('M') sublayer: "
                             "nothing would mix information across tokens")
        if "mixer" in kinds and self.mixer not in MIXERS:
            raise ValueError(
                f"model.mixer {self.mixer!r} is not a known mixer; the pattern has 'M' sublayers, so model.mixer "
                f"must be one of: {', '.join(MIXERS)}"
            )
        for name in ("vocab_size", "dim", "n_layers", "ffn_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if "mixer" in kinds:
            _check_positive(getattr(self, self.mixer), f"model.{self.mixer}")
            if self.mixer == "gdn" and self.gdn.num_v_heads % self.gdn.num_heads:
                raise ValueError(
                    f"model.gdn.num_v_heads ({self.gdn.num_v_heads}) must be a multiple of model.gdn.num_heads "
                    f"({self.gdn.num_heads})"
                )
            if self.mixer == "mamba2":
                m = self.mamba2
                if (self.dim * m.expand) % m.head_dim:
                    raise ValueError(
                        f"model.mamba2: dim * expand ({self.dim * m.expand}) must be a multiple of head_dim "
                        f"({m.head_dim})"
                    )
                n_heads = self.dim * m.expand // m.head_dim
                if n_heads % m.n_groups:
                    raise ValueError(f"model.mamba2: {n_heads} heads do not split into n_groups={m.n_groups} groups")
                if m.xb_heads < 0 or (m.xb_heads and (n_heads % m.xb_heads or m.n_groups % m.xb_heads)):
                    raise ValueError(f"model.mamba2.xb_heads ({m.xb_heads}) must divide the {n_heads} heads and the "
                                     f"{m.n_groups} groups (or be 0)")
        if "attention" in kinds and self.attention not in ATTENTIONS:
            raise ValueError(f"model.attention {self.attention!r} is not a known attention; the pattern has '*' "
                             f"sublayers, so model.attention must be one of: {', '.join(ATTENTIONS)}")
        if "attention" in kinds and self.attention == "gqa":
            g = self.gqa
            for name in ("num_heads", "num_kv_heads", "head_dim"):
                if getattr(g, name) <= 0:
                    raise ValueError(f"model.gqa.{name} must be positive, got {getattr(g, name)}")
            if g.num_heads % g.num_kv_heads:
                raise ValueError(f"model.gqa.num_heads ({g.num_heads}) must be a multiple of model.gqa.num_kv_heads "
                                 f"({g.num_kv_heads})")
            if g.head_dim % 2:
                raise ValueError(f"model.gqa.head_dim must be even (RoPE rotates pairs), got {g.head_dim}")
            if g.rope_scaling not in ROPE_SCALINGS:
                raise ValueError(f"model.gqa.rope_scaling must be one of: {', '.join(ROPE_SCALINGS)}, got "
                                 f"{g.rope_scaling!r}")
        if "attention" in kinds and self.attention == "mla":
            mla = self.mla
            for name in ("num_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
                if getattr(mla, name) <= 0:
                    raise ValueError(f"model.mla.{name} must be positive, got {getattr(mla, name)}")
            if mla.qk_nope_head_dim < 0 or mla.q_lora_rank < 0:
                raise ValueError("model.mla.qk_nope_head_dim and model.mla.q_lora_rank must not be negative")
            if mla.qk_rope_head_dim % 2:
                raise ValueError(f"model.mla.qk_rope_head_dim must be even, got {mla.qk_rope_head_dim}")

    def replace(self, **changes) -> ModelArgs:
        return dataclasses.replace(self, **changes)


ZERO_MEANS_NONE = ("xb_heads",)  # sizes where 0 switches a feature off


def _check_positive(args, prefix: str) -> None:
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0 and f.name not in ZERO_MEANS_NONE:
            raise ValueError(f"{prefix}.{f.name} must be positive, got {value}")


def model_args_to_dict(args: ModelArgs) -> dict:
    """ModelArgs as model_args.json holds them: a checkpoint's, and the model_args of an export's config.json."""
    return dataclasses.asdict(args)


def model_args_from_dict(d: dict) -> ModelArgs:
    """ModelArgs from model_args_to_dict's form. A sublayer kind whose sizes the dict lacks takes the defaults, as in a
    checkpoint saved before that kind existed."""
    d = dict(d)
    for key, cls in (("gdn", GDNArgs), ("kda", KDAArgs), ("mamba2", Mamba2Args), ("mla", MLAArgs), ("gqa", GQAArgs)):
        if key in d:
            d[key] = cls(**d[key])
    return ModelArgs(**d)
