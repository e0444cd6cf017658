"""An upcycled MLA layer against the attention it claims to compute, written here in plain torch from the Hugging
Face weights alone (not through hybridtitan.upcycle or hybridtitan's RoPE; upcycle's rope_rows is read only to
build a wrong variant): a Llama of grouped key/value heads
(4 heads, 2 key/value heads) with Llama 3 RoPE scaling, upcycled to an MLA with no-RoPE channels at full and at
truncated ranks, and two deliberately wrong upcycles that the comparison catches."""

from __future__ import annotations

import math

import pytest
import torch

from hybridtitan.models import get_flavor
from hybridtitan.upcycle import rope_rows as right_rope_rows

HEADS, KV_HEADS, HEAD_DIM, DIM = 4, 2, 32, 128
NOPE, ROPE = 8, 16  # the MLA's channels per head: 8 without RoPE, 16 with (every second Llama pair)
THETA, FACTOR, ORIGINAL = 10000.0, 8.0, 64  # Llama 3 scaling over 64 positions: its ramps fall inside T
T = 48
LLAMA3 = {"rope_type": "llama3", "factor": FACTOR, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL, "rope_theta": THETA}


def spectral(rows: int, cols: int, scale: float, decay: float, g: torch.Generator) -> torch.Tensor:
    """A random matrix of singular values scale * exp(-i / decay): a spectrum that falls, as trained weights'
    do, so that truncated ranks lose a measured part."""
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=g))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=g))
    return u @ torch.diag(scale * torch.exp(-torch.arange(k) / decay)) @ v.T


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(folder, the first layer's q, k, v, o weights) of a 2-layer Llama made and saved by transformers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=8192, hidden_size=DIM, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         rope_parameters=LLAMA3, tie_word_embeddings=True, max_position_embeddings=4096)
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_proj.weight.copy_(spectral(HEADS * HEAD_DIM, DIM, 1.2, 24.0, g))
        attn.k_proj.weight.copy_(spectral(KV_HEADS * HEAD_DIM, DIM, 1.2, 16.0, g))
        attn.v_proj.weight.copy_(spectral(KV_HEADS * HEAD_DIM, DIM, 1.0, 16.0, g))
    folder = tmp_path_factory.mktemp("llama")
    model.save_pretrained(folder)
    weights = {n: getattr(attn, f"{n}_proj").weight.detach().clone() for n in "qkvo"}
    return folder, weights


def upcycled_mla(folder, out, q_rank, kv_rank):
    """Layer 0's MLA module, as hybridtitan.upcycle makes it from the folder."""
    from hybridtitan.model_loader import load
    from hybridtitan.upcycle import main

    main(["--model", str(folder), "--attention-layers", "all", "--output", str(out), "--tokenizer",
          "hybridtitan/assets/tokenizer", "--q-lora-rank", str(q_rank), "--kv-lora-rank", str(kv_rank),
          "--qk-nope-head-dim", str(NOPE), "--qk-rope-head-dim", str(ROPE), "--overwrite"])
    model, _, _ = load(str(out))
    return model.layers[0].attn


# ------------------------------------------------------------------------------------------------ the reference


def truncated(w: torch.Tensor, rank: int) -> tuple[torch.Tensor, float]:
    """The best rank-``rank`` approximation of w and its largest discarded singular value (its error's
    operator norm)."""
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    tail = s[rank].item() if rank < s.numel() else 0.0
    return (u[:, :rank] * s[:rank]) @ vh[:rank], tail


def rope_and_nope_rows():
    """Llama head rows (rotate-half: row j turns with j + 16 at THETA^(-2j/32)) whose frequency the MLA's 16 RoPE
    channels have, found by comparing the frequencies; the no-RoPE rows: the first 8 of the others."""
    llama_freq = THETA ** (-torch.arange(0, HEAD_DIM, 2).double() / HEAD_DIM)
    mla_freq = THETA ** (-torch.arange(0, ROPE, 2).double() / ROPE)
    pairs = [int(torch.isclose(llama_freq, f).nonzero()) for f in mla_freq]
    rope = pairs + [j + HEAD_DIM // 2 for j in pairs]
    return rope, [r for r in range(HEAD_DIM) if r not in rope][:NOPE]


def mla_cos_sin():
    """cos and sin of the MLA's RoPE from transformers: YaRN at the Llama 3 factor and original context, its
    attention factor (0.1 ln 8 + 1) on both."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=DIM, num_attention_heads=HEADS, head_dim=ROPE, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "yarn", "factor": FACTOR, "rope_theta": THETA,
                                          "original_max_position_embeddings": ORIGINAL})
    rotary = LlamaRotaryEmbedding(config)
    assert rotary.attention_scaling == pytest.approx(0.1 * math.log(FACTOR) + 1)
    cos, sin = rotary(torch.zeros(1, T, ROPE, dtype=torch.float64), torch.arange(T)[None])
    return cos.double(), sin.double()


def reference_attention(x, w, q_rank, kv_rank, shared_key=True):
    """The attention the upcycled MLA claims to compute, in plain torch: queries through W_Q at rank q_rank, keys and
    values through [W_K; W_V] (each key/value head serving its group of query heads, as transformers' repeat_kv) at
    rank kv_rank; each head's RoPE rows and no-RoPE rows; the RoPE key the mean over the key/value heads of W_K's
    RoPE rows (``shared_key``) or each head's own (the Llama's); the MLA's RoPE; o_proj. Also returns the
    largest singular value each rank discards."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    x = x.double()
    B = x.shape[0]
    rope, nope = rope_and_nope_rows()
    group = HEADS // KV_HEADS
    wq, wk, wv, wo = (w[n].double() for n in "qkvo")
    wk_heads = wk.view(KV_HEADS, HEAD_DIM, DIM)[torch.arange(HEADS) // group]  # query head h reads kv head h // 2
    wv_heads = wv.view(KV_HEADS, HEAD_DIM, DIM)[torch.arange(HEADS) // group]
    wq_r, eps_q = truncated(wq, q_rank)
    kv_r, eps_kv = truncated(torch.cat([wk_heads.reshape(-1, DIM), wv_heads.reshape(-1, DIM)]), kv_rank)
    wk_r, wv_r = kv_r[: HEADS * HEAD_DIM].view(HEADS, HEAD_DIM, DIM), kv_r[HEADS * HEAD_DIM:]

    def heads(t):
        return t.view(B, T, HEADS, -1).transpose(1, 2)  # [B, H, T, .]

    q = heads(x @ wq_r.T)
    k_nope = heads(x @ wk_r[:, nope].reshape(-1, DIM).T)
    v = heads(x @ wv_r.T)
    if shared_key:
        k_rope = (x @ wk.view(KV_HEADS, HEAD_DIM, DIM)[:, rope].mean(0).T)[:, None].expand(B, HEADS, T, ROPE)
    else:
        k_rope = heads(x @ wk_heads[:, rope].reshape(-1, DIM).T)
    cos, sin = mla_cos_sin()
    q_rope, k_rope = apply_rotary_pos_emb(q[..., rope], k_rope, cos, sin)
    q = torch.cat([q[..., nope], q_rope], -1)
    k = torch.cat([k_nope, k_rope], -1)
    scale = (NOPE + ROPE) ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale + torch.full((T, T), float("-inf"), dtype=x.dtype).triu(1)
    o = scores.softmax(-1) @ v
    return o.transpose(1, 2).reshape(B, T, -1) @ wo.T, (eps_q, eps_kv)


def relative(a, b):
    return ((a - b).norm() / b.norm()).item()


def compare(folder, w, out_dir, q_rank, kv_rank):
    """The upcycled MLA against the reference on the same hidden states: (its output's relative error against the
    reference at full ranks with the shared RoPE key, against the Llama's own RoPE keys, against the reference at
    these ranks; per token, the error of its queries and of its keys and values as it computes them, and the
    bound of each).

    The bound (Eckart-Young): W_r x differs from W x by (W - W_r) x, whose norm is at most the largest discarded
    singular value of W times |x|; a block of W's rows (each head's RoPE and no-RoPE rows, the key rows without
    RoPE) differs by a part of that vector, so by no more. The MLA's queries are q_up(q_down x), [no-RoPE | RoPE]
    per head; its keys and values kv_up(latent), [k no-RoPE | v] per head; the shared RoPE key is not low-rank."""
    x = torch.randn(2, T, DIM, generator=torch.Generator().manual_seed(2))
    mla = upcycled_mla(folder, out_dir, q_rank, kv_rank)
    seen = {}
    for name in ("q_up_proj", "kv_up_proj"):
        getattr(mla, name).register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(name, o.double()))
    with torch.no_grad():
        out = mla(x).double()
    shared, _ = reference_attention(x, w, DIM, DIM)
    own, _ = reference_attention(x, w, DIM, DIM, shared_key=False)
    at_ranks, (eps_q, eps_kv) = reference_attention(x, w, q_rank, kv_rank)
    rope, nope = rope_and_nope_rows()
    group = HEADS // KV_HEADS
    xd = x.double()
    q = (xd @ w["q"].double().T).view(2, T, HEADS, HEAD_DIM)[..., nope + rope]
    k = (xd @ w["k"].double().T).view(2, T, KV_HEADS, HEAD_DIM)[:, :, torch.arange(HEADS) // group][..., nope]
    v = (xd @ w["v"].double().T).view(2, T, KV_HEADS, HEAD_DIM)[:, :, torch.arange(HEADS) // group]
    kv = torch.cat([k, v], -1)
    q_error = (seen["q_up_proj"] - q.reshape(2, T, -1)).norm(dim=-1)
    kv_error = (seen["kv_up_proj"] - kv.reshape(2, T, -1)).norm(dim=-1)
    norms = xd.norm(dim=-1)
    return (relative(out, shared), relative(out, own), relative(out, at_ranks), (q_error, eps_q * norms),
            (kv_error, eps_kv * norms))


Q_RANK, KV_RANK = 96, 64  # of 128 and 128


# ------------------------------------------------------------------------------------------------ the tests


def test_an_upcycled_mla_computes_the_attention_it_claims(llama, tmp_path):
    """At full ranks the MLA is the reference with the shared RoPE key (1e-5, float32 against float64): its only
    error against the Llama's own keys on those rows is the shared key's. At truncated ranks every token's output
    stays within the bound from the discarded singular values, a bound below the error each wrong upcycle makes
    (test_a_wrong_upcycle_fails_the_comparison)."""
    folder, w = llama
    shared, own, _, (q_error, _), (kv_error, _) = compare(folder, w, tmp_path / "full", DIM, DIM)
    assert shared < 1e-5
    assert own > 0.05  # the shared key's approximation: the two kv heads' RoPE rows differ
    assert q_error.max() < 1e-4 and kv_error.max() < 1e-4
    shared, _, at_ranks, *errors = compare(folder, w, tmp_path / "truncated", Q_RANK, KV_RANK)
    assert shared > 0.02  # the ranks lose a measured part
    assert at_ranks < 1e-5  # and the MLA computes the claim at these ranks
    for error, bound in errors:
        assert (error <= bound + 1e-5).all(), (error / bound).max()
        assert (error > 0.1 * bound).all()  # a bound that says something: within 10x of the error


def misrotated_rows(head_dim, rope_dims, nope_dims, last=False):
    """Wrong: each RoPE pair's second row taken from the next pair (rows that never turned together)."""
    rope, nope = right_rope_rows(head_dim, rope_dims, nope_dims)
    half = len(rope) // 2
    return rope[:half] + rope[half + 1:] + rope[half:half + 1], nope


def tiled_heads(w, heads, head_dim, groups):
    """Wrong: key/value heads tiled (0, 1, 0, 1) instead of each serving its own group (0, 0, 1, 1)."""
    return w.view(heads, head_dim, -1).repeat(groups, 1, 1).reshape(heads * groups * head_dim, -1)


@pytest.mark.parametrize("wrong", ["rope_rows", "repeat_heads"])
def test_a_wrong_upcycle_fails_the_comparison(llama, tmp_path, monkeypatch, wrong):
    """The same comparison with RoPE rows mis-paired, or key/value heads given to the wrong query heads: outside
    the full-rank tolerance, and outside the truncated ranks' bound."""
    import hybridtitan.upcycle as upcycle

    monkeypatch.setattr(upcycle, wrong, misrotated_rows if wrong == "rope_rows" else tiled_heads)
    folder, w = llama
    shared, *_ = compare(folder, w, tmp_path / "full", DIM, DIM)
    assert shared > 1e-2
    _, _, at_ranks, (q_error, q_bound), (kv_error, kv_bound) = compare(folder, w, tmp_path / "truncated", Q_RANK,
                                                                       KV_RANK)
    assert at_ranks > 1e-2
    error, bound = (q_error, q_bound) if wrong == "rope_rows" else (kv_error, kv_bound)
    assert (error > bound).all()


def test_the_mlas_rope_under_llama3_scaling_is_as_the_docs_say():
    """Llama-3.2-1B upcycled (head_dim 64, the MLA's 32 RoPE channels, Llama 3 scaling x32 from 8,192): the MLA's
    frequencies are transformers' YaRN at that factor; against the Llama's own (transformers' llama3) at the same
    pairs they agree where a pair turns more than 32 times over the original context or less than once, the Llama
    keeps and YaRN lowers them between 4 and 32 turns, and both ramps differ between 1 and 4 (docs/upcycling.md)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from hybridtitan.models.flavors import upcycled
    from hybridtitan.models.mla import mla_inv_freq

    llama = get_flavor("llama_1B")
    mla = upcycled(llama, [0]).mla
    assert (mla.rope_scaling_factor, mla.original_max_position_embeddings, mla.qk_rope_head_dim) == (32.0, 8192, 32)
    common = dict(hidden_size=2048, num_attention_heads=32, max_position_embeddings=131072)
    theta, original = llama.gqa.rope_theta, 8192
    llama3 = LlamaConfig(head_dim=64, **common, rope_parameters={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": original, "rope_theta": theta})
    yarn = LlamaConfig(head_dim=32, **common, rope_parameters={
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": original, "rope_theta": theta})
    llama_freq = ROPE_INIT_FUNCTIONS["llama3"](llama3, "cpu")[0][::2].double()  # the pairs the MLA keeps
    yarn_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](yarn, "cpu")
    torch.testing.assert_close(mla_inv_freq(mla).double(), yarn_freq.double(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(1.3466, abs=1e-4)
    plain = theta ** (-torch.arange(0, 32, 2).double() / 32)
    turns = original * plain / (2 * math.pi)
    same = torch.isclose(llama_freq, yarn_freq.double(), rtol=1e-5)
    assert same[(turns > 32) | (turns < 1)].all()
    middle = (turns > 4) & (turns < 32)
    assert middle.any() and torch.allclose(llama_freq[middle], plain[middle])
    assert (yarn_freq[middle] < plain[middle]).all()
    assert not same[(turns > 1) & (turns < 4)].any()
