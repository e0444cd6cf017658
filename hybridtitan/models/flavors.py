"""Named model configurations: the released Primus hybrids and pure mixers, and tiny flavors for CPU runs.

Sizes follow the Primus configurations (24/32 sublayers = 12/16 FLA blocks); vocabulary 128256 is Llama-3.2's.
"""

from __future__ import annotations

import copy
import dataclasses

from .args import GDNArgs, GQAArgs, KDAArgs, Mamba2Args, MLAArgs, ModelArgs

HYBRID_300M = "*-M-M-M-*-M-M-M-*-M-M-M-"
# YaRN's original context and mscale_all_dim as Primus's runs set them: 8,192 for the 1B-8B and 2,048 for the 300M
# hybrids, and 1.0. At rope_scaling_factor 1 YaRN is plain RoPE whatever they are, and an export carries them.
MLA_300M = MLAArgs(num_heads=16, q_lora_rank=672, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                   v_head_dim=64, original_max_position_embeddings=2048, mscale_all_dim=1.0)
MLA_1B = MLAArgs(num_heads=32, q_lora_rank=1344, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                 v_head_dim=64, original_max_position_embeddings=8192, mscale_all_dim=1.0)


def llama(layers: int, dim: int, ffn_dim: int, *, heads: int, head_dim: int, rope_factor: float, tied: bool,
          vocab_size: int = 128256, kv_heads: int = 8, norm_eps: float = 1e-5) -> ModelArgs:
    """A Llama 3 as a pattern of attention and MLP sublayers ('*-' per Llama layer), with Llama 3.1's RoPE scaling
    (original context 8,192, low and high frequency factors 1 and 4)."""
    return ModelArgs(vocab_size=vocab_size, dim=dim, n_layers=2 * layers, ffn_dim=ffn_dim, pattern="*-" * layers,
                     attention="gqa", tie_embeddings=tied, norm_eps=norm_eps,
                     gqa=GQAArgs(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rope_theta=500000.0,
                                 rope_scaling="llama3", rope_scaling_factor=rope_factor, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192))


# The MLA latent ranks of an upcycled Llama by its shape (dim, heads, head_dim): q rank, kv rank, qk_nope_head_dim,
# qk_rope_head_dim. Zebra-Llama's released configs (AMD-AGI/AMD-Hybrid-Models, Zebra-Llama/configs/llama3.*) for
# Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B; half the query and a quarter of the key/value rows for debug_llama.
MLA_RANKS = {(2048, 32, 64): (1344, 128, 32, 32), (3072, 24, 128): (1536, 128, 64, 64),
             (4096, 32, 128): (2048, 160, 64, 64), (128, 4, 32): (64, 32, 16, 16)}


def llama_layers_pattern(n_layers: int, attention_layers) -> str:
    """The pattern of a Llama of ``n_layers`` layers. The layers in ``attention_layers`` keep attention ('*-'), and the
    others become mixers ('M-')."""
    return "".join("*-" if i in set(attention_layers) else "M-" for i in range(n_layers))


# HyLo's Gated DeltaNet for Llama-3.2-1B (its ROCm blog, the model cards of amd/HyLo-Llama-4MLA12GDN-*): FLA's
# GatedDeltaNet defaults, 6 heads of 256 key and 512 value channels, filled from the attention's overlapping blocks.
# Other shapes: one key and one value head per attention head.
HYLO_GDN = {(2048, 32, 64): GDNArgs(num_heads=6, num_v_heads=6, head_dim=256, head_v_dim=512)}


def upcycled(llama: ModelArgs, attention_layers, mixer: str = "mamba2", *, q_lora_rank: int | None = None,
             kv_lora_rank: int | None = None, qk_nope_head_dim: int | None = None,
             qk_rope_head_dim: int | None = None, rope_scaling_factor: float | None = None,
             original_max_position_embeddings: int | None = None) -> ModelArgs:
    """The hybrid that hybridtitan.upcycle makes of a Llama (pattern '*-' per layer, grouped-query attention).

    The layers in ``attention_layers`` become MLA and the others ``mixer``. Everything else is as in the Llama. The
    sizes follow the attention they start from, as in Zebra-Llama's and HyLo's released models:

    * MLA keeps the attention's heads, with v_head_dim = head_dim, no latent norms, and the latent ranks given
      (MLA_RANKS holds Zebra-Llama's for the Llama 3 shapes). YaRN runs at the Llama's RoPE scaling factor from its
      original context.
    * Mamba2 follows MambaInLlama: one head per attention head, with head_dim and d_state the attention's head_dim,
      expand 1, and x and B projected for the key/value heads (xb_heads). Both its mamba2 and gdn sizes are set, so
      model.mixer alone switches between them.
    * Gated DeltaNet follows HyLo: its sizes for Llama-3.2-1B (HYLO_GDN), else one key and one value head per
      attention head, of the attention's head_dim."""
    g = llama.gqa
    if llama.attention != "gqa" or llama.pattern != "*-" * (llama.n_layers // 2):
        raise ValueError("upcycling starts from a Llama: grouped-query attention and MLP sublayers, '*-' per layer")
    heads, head_dim = g.num_heads, g.head_dim
    if heads * head_dim != llama.dim:
        raise ValueError(f"the attention's {heads} heads x {head_dim} channels differ from the model width {llama.dim}:"
                         " a Mamba2 or GDN mixer of one head per attention head would not fit it")
    ranks = MLA_RANKS.get((llama.dim, heads, head_dim))
    given = (q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim)
    if ranks is None and None in given:
        raise ValueError(f"no default MLA ranks for a Llama of width {llama.dim}, {heads} heads of {head_dim}: "
                         "give q_lora_rank, kv_lora_rank, qk_nope_head_dim and qk_rope_head_dim")
    q_rank, kv_rank, nope, rope = (v if v is not None else d for v, d in zip(given, ranks or given))
    llama3 = g.rope_scaling == "llama3"
    mla = MLAArgs(num_heads=heads, q_lora_rank=q_rank, kv_lora_rank=kv_rank, qk_nope_head_dim=nope,
                  qk_rope_head_dim=rope, v_head_dim=head_dim, rope_theta=g.rope_theta,
                  rope_scaling_factor=rope_scaling_factor or (g.rope_scaling_factor if llama3 else 1.0),
                  original_max_position_embeddings=original_max_position_embeddings or (
                      g.original_max_position_embeddings if llama3 else MLAArgs.original_max_position_embeddings),
                  latent_norm=False)
    return dataclasses.replace(
        llama, pattern=llama_layers_pattern(llama.n_layers // 2, attention_layers), attention="mla", mixer=mixer,
        hybrid_attention_ratio=0.0, mla=mla, gqa=GQAArgs(),
        mamba2=Mamba2Args(d_state=head_dim, head_dim=head_dim, n_groups=heads, expand=1, xb_heads=g.num_kv_heads),
        gdn=copy.deepcopy(HYLO_GDN.get((llama.dim, heads, head_dim))) or GDNArgs(
            num_heads=heads, num_v_heads=heads, head_dim=head_dim, head_v_dim=head_dim))


def _flavors() -> dict[str, ModelArgs]:
    base_300m = dict(vocab_size=128256, dim=1024, n_layers=24, ffn_dim=4096)
    base_1b = dict(vocab_size=128256, dim=2048, n_layers=32, ffn_dim=8192)
    llama_1b = llama(16, 2048, 8192, heads=32, head_dim=64, rope_factor=32.0, tied=True)
    llama_3b = llama(28, 3072, 8192, heads=24, head_dim=128, rope_factor=32.0, tied=True)
    llama_8b = llama(32, 4096, 14336, heads=32, head_dim=128, rope_factor=8.0, tied=False)
    debug_llama = llama(4, 128, 384, heads=4, head_dim=32, rope_factor=32.0, tied=True, vocab_size=8192, kv_heads=2)
    return {
        "gdn_300M": ModelArgs(**base_300m, mixer="gdn", gdn=GDNArgs(4, 8, 64, 64)),
        "kda_300M": ModelArgs(**base_300m, mixer="kda", kda=KDAArgs(8, 32, 64)),
        "zebra_gdn_300M": ModelArgs(**base_300m, pattern=HYBRID_300M, hybrid_attention_ratio=0.25, mixer="gdn",
                                    gdn=GDNArgs(4, 8, 64, 64), mla=MLA_300M),
        "zebra_mamba2_300M": ModelArgs(**base_300m, pattern=HYBRID_300M, hybrid_attention_ratio=0.25, mixer="mamba2",
                                       mamba2=Mamba2Args(d_state=64, head_dim=64, n_groups=8, expand=2), mla=MLA_300M),
        "gdn_1B": ModelArgs(**base_1b, mixer="gdn", gdn=GDNArgs(8, 16, 64, 64)),
        "kda_1B": ModelArgs(**base_1b, mixer="kda", kda=KDAArgs(16, 32, 64)),
        # norm eps 1e-5: Llama 3's, and what Primus's runs of these use (Megatron's layernorm_epsilon default; the
        # presets' norm_epsilon is not a Megatron key)
        "zebra_llama_1B": ModelArgs(**base_1b, hybrid_attention_ratio=0.25, mixer="mamba2", norm_eps=1e-5,
                                    mamba2=Mamba2Args(d_state=64, head_dim=64, n_groups=8, expand=1), mla=MLA_1B),
        "zebra_kda_1B": ModelArgs(**base_1b, hybrid_attention_ratio=0.25, mixer="kda", kda=KDAArgs(16, 32, 64),
                                  mla=MLA_1B, norm_eps=1e-5),
        "zebra_llama_3B": ModelArgs(
            vocab_size=128256, dim=3072, n_layers=56, ffn_dim=8192, hybrid_attention_ratio=0.25, mixer="mamba2",
            norm_eps=1e-5, mamba2=Mamba2Args(d_state=128, head_dim=128, n_groups=8, expand=1),
            mla=MLAArgs(num_heads=24, q_lora_rank=1536, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
                        v_head_dim=128, original_max_position_embeddings=8192, mscale_all_dim=1.0)),
        "zebra_llama_8B": ModelArgs(
            vocab_size=128256, dim=4096, n_layers=64, ffn_dim=14436, hybrid_attention_ratio=0.25, mixer="mamba2",
            norm_eps=1e-5, mamba2=Mamba2Args(d_state=128, head_dim=128, n_groups=8, expand=1),
            mla=MLAArgs(num_heads=32, q_lora_rank=2048, kv_lora_rank=160, qk_nope_head_dim=64, qk_rope_head_dim=64,
                        v_head_dim=128, original_max_position_embeddings=8192, mscale_all_dim=1.0)),
        # Primus's mamba_370M: 48 Mamba2 sublayers, no MLP or attention, GPT-NeoX-20B's vocabulary padded to 50,304;
        # ffn_dim is unused
        "mamba_370M": ModelArgs(vocab_size=50304, dim=1024, n_layers=48, ffn_dim=4096, pattern="M" * 48,
                                mixer="mamba2", norm_eps=1e-5,
                                mamba2=Mamba2Args(d_state=16, head_dim=64, n_groups=8, expand=2)),
        # Llama 3 shapes (meta-llama/Llama-3.2-1B, Llama-3.2-3B, Llama-3.1-8B): teachers, baselines, upcycling sources
        "llama_1B": llama_1b,
        "llama_3B": llama_3b,
        "llama_8B": llama_8b,
        # Tiny flavors that train in seconds on a CPU (vocabulary of the tokenizer the repo ships: 8192).
        "debug_gdn": ModelArgs(vocab_size=8192, dim=128, n_layers=4, ffn_dim=384, mixer="gdn",
                               gdn=GDNArgs(num_heads=2, num_v_heads=4, head_dim=32, head_v_dim=32)),
        "debug_kda": ModelArgs(vocab_size=8192, dim=128, n_layers=4, ffn_dim=384, mixer="kda",
                               kda=KDAArgs(num_heads=4, head_dim=16, head_v_dim=32)),
        "debug_mamba2": ModelArgs(vocab_size=8192, dim=128, n_layers=4, ffn_dim=384, mixer="mamba2",
                                  mamba2=Mamba2Args(d_state=16, head_dim=32, n_groups=2, expand=2)),
        "debug_hybrid": ModelArgs(vocab_size=8192, dim=256, n_layers=8, ffn_dim=768, pattern="*-M-M-*-", mixer="gdn",
                                  gdn=GDNArgs(num_heads=2, num_v_heads=4, head_dim=32, head_v_dim=32),
                                  mla=MLAArgs(num_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                                              qk_rope_head_dim=16, v_head_dim=32)),
        "debug_llama": debug_llama,
        # Hybrids upcycled from the Llamas above (python -m hybridtitan.upcycle; docs/upcycling.md), with the
        # attention layers of Zebra-Llama's released 1B 4MLA-12M2, 3B 6MLA-22M2 and 8B 8MLA-24M2 models and of HyLo's
        # 1B 4MLA-12GDN. model.pattern chooses others (all-MLA and all-mixer students for layer distillation).
        "zebra_llama_1B_upcycled": upcycled(llama_1b, [0, 5, 10, 14]),
        "zebra_llama_3B_upcycled": upcycled(llama_3b, [0, 5, 10, 16, 21, 26]),
        "zebra_llama_8B_upcycled": upcycled(llama_8b, [0, 4, 8, 12, 16, 20, 25, 30]),
        "hylo_1B_upcycled": upcycled(llama_1b, [1, 5, 10, 14], "gdn"),
        "debug_llama_upcycled": upcycled(debug_llama, [0]),
    }


FLAVORS: dict[str, ModelArgs] = _flavors()


def get_flavor(name: str) -> ModelArgs:
    if name not in FLAVORS:
        raise ValueError(f"model.flavor {name!r} is unknown; known flavors: {', '.join(FLAVORS)}")
    return copy.deepcopy(FLAVORS[name])
