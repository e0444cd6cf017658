"""Named model configurations: the released Primus hybrids and pure mixers, and tiny flavors for CPU runs.

Sizes follow the Primus configurations (24/32 sublayers = 12/16 FLA blocks); vocabulary 128256 is Llama-3.2's.
"""

from __future__ import annotations

import copy

from .args import GDNArgs, KDAArgs, Mamba2Args, MLAArgs, ModelArgs

HYBRID_300M = "*-M-M-M-*-M-M-M-*-M-M-M-"
MLA_300M = MLAArgs(num_heads=16, q_lora_rank=672, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32,
                   v_head_dim=64)
MLA_1B = MLAArgs(num_heads=32, q_lora_rank=1344, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
                 v_head_dim=64)


def _flavors() -> dict[str, ModelArgs]:
    base_300m = dict(vocab_size=128256, dim=1024, n_layers=24, ffn_dim=4096)
    base_1b = dict(vocab_size=128256, dim=2048, n_layers=32, ffn_dim=8192)
    return {
        "gdn_300M": ModelArgs(**base_300m, mixer="gdn", gdn=GDNArgs(4, 8, 64, 64)),
        "kda_300M": ModelArgs(**base_300m, mixer="kda", kda=KDAArgs(8, 32, 64)),
        "zebra_gdn_300M": ModelArgs(**base_300m, pattern=HYBRID_300M, hybrid_attention_ratio=0.25, mixer="gdn",
                                    gdn=GDNArgs(4, 8, 64, 64), mla=MLA_300M),
        "zebra_mamba2_300M": ModelArgs(**base_300m, pattern=HYBRID_300M, hybrid_attention_ratio=0.25, mixer="mamba2",
                                       mamba2=Mamba2Args(d_state=64, head_dim=64, n_groups=8, expand=2), mla=MLA_300M),
        "gdn_1B": ModelArgs(**base_1b, mixer="gdn", gdn=GDNArgs(8, 16, 64, 64)),
        "kda_1B": ModelArgs(**base_1b, mixer="kda", kda=KDAArgs(16, 32, 64)),
        "zebra_llama_1B": ModelArgs(**base_1b, hybrid_attention_ratio=0.25, mixer="mamba2",
                                    mamba2=Mamba2Args(d_state=64, head_dim=64, n_groups=8, expand=1), mla=MLA_1B),
        "zebra_kda_1B": ModelArgs(**base_1b, hybrid_attention_ratio=0.25, mixer="kda", kda=KDAArgs(16, 32, 64),
                                  mla=MLA_1B),
        "zebra_llama_3B": ModelArgs(
            vocab_size=128256, dim=3072, n_layers=56, ffn_dim=8192, hybrid_attention_ratio=0.25, mixer="mamba2",
            mamba2=Mamba2Args(d_state=128, head_dim=128, n_groups=8, expand=1),
            mla=MLAArgs(num_heads=24, q_lora_rank=1536, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
                        v_head_dim=128)),
        "zebra_llama_8B": ModelArgs(
            vocab_size=128256, dim=4096, n_layers=64, ffn_dim=14436, hybrid_attention_ratio=0.25, mixer="mamba2",
            mamba2=Mamba2Args(d_state=128, head_dim=128, n_groups=8, expand=1),
            mla=MLAArgs(num_heads=32, q_lora_rank=2048, kv_lora_rank=160, qk_nope_head_dim=64, qk_rope_head_dim=64,
                        v_head_dim=128)),
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
    }


FLAVORS: dict[str, ModelArgs] = _flavors()


def get_flavor(name: str) -> ModelArgs:
    if name not in FLAVORS:
        raise ValueError(f"model.flavor {name!r} is unknown; known flavors: {', '.join(FLAVORS)}")
    return copy.deepcopy(FLAVORS[name])
