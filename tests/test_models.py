"""HybridLM: parity of sizes and parameter names with FLA's HF models, CPU training step of every debug flavor,
isolation of packed documents, and decoding with a cache."""

import math

import pytest
import torch
from fla.models import (
    GatedDeltaNetConfig,
    GatedDeltaNetForCausalLM,
    KDAConfig,
    KDAForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
)

from hybridtitan.models import FLAVORS, GDNArgs, InferenceCache, KDAArgs, ModelArgs, build_model, get_flavor

DEBUG_FLAVORS = ["debug_gdn", "debug_kda", "debug_mamba2", "debug_hybrid", "debug_llama", "debug_llama_upcycled"]

# Parameters of FLA 0.6.0's GatedDeltaNetForCausalLM / KDAForCausalLM / Mamba2ForCausalLM with the Primus sizes
# (tied embeddings). Primus's own figures: gdn_300M 0.308B, kda_300M 0.302B (its guide's, without a derivation),
# gdn_1B ~1.20B, mamba_370M by its name.
FLA_PARAMS = {"gdn_300M": 307767232, "kda_300M": 303549280, "gdn_1B": 1203441152, "kda_1B": 1175153920,
              "mamba_370M": 368363008}


# ----------------------------------------------------------------------------------------------------------------
# FLA parity: sizes and names


def fla_model(args: ModelArgs):
    """FLA's HF model with the configuration of ``args`` (a pure GDN or KDA stack), on the meta device."""
    if args.mixer == "gdn":
        g = args.gdn
        config = GatedDeltaNetConfig(
            hidden_size=args.dim, num_hidden_layers=args.n_layers // 2, num_heads=g.num_heads,
            num_v_heads=g.num_v_heads, head_dim=g.head_dim, expand_v=g.head_v_dim / g.head_dim,
            conv_size=g.conv_size, intermediate_size=args.ffn_dim, vocab_size=args.vocab_size,
            tie_word_embeddings=True, norm_eps=1e-6,
        )
        cls = GatedDeltaNetForCausalLM
    elif args.mixer == "kda":
        k = args.kda
        config = KDAConfig(
            hidden_size=args.dim, num_hidden_layers=args.n_layers // 2, num_heads=k.num_heads, head_dim=k.head_dim,
            expand_v=k.head_v_dim / k.head_dim, conv_size=k.conv_size, intermediate_size=args.ffn_dim,
            vocab_size=args.vocab_size, tie_word_embeddings=True,
        )
        cls = KDAForCausalLM
    elif args.mixer == "mamba2" and args.pattern == "M" * args.n_layers:  # FLA's Mamba2 blocks have no MLP
        m = args.mamba2
        config = Mamba2Config(
            hidden_size=args.dim, num_hidden_layers=args.n_layers, state_size=m.d_state, expand=m.expand,
            head_dim=m.head_dim, num_heads=m.expand * args.dim // m.head_dim, n_groups=m.n_groups,
            conv_kernel=m.conv_size, vocab_size=args.vocab_size, tie_word_embeddings=True,
        )
        cls = Mamba2ForCausalLM
    else:
        raise ValueError(args.mixer)
    with torch.device("meta"):
        return cls(config)


def to_fla_name(fqn: str) -> str:
    """Our parameter name -> FLA's. Sublayer j is half of FLA block j // 2: the mixer (even j) or the MLP (odd j)."""
    if fqn in ("embeddings.weight", "norm.weight"):
        return "model." + fqn
    parts = fqn.split(".")
    assert parts[0] == "layers", fqn
    j, kind, rest = int(parts[1]), parts[2], ".".join(parts[3:])
    block = f"model.layers.{j // 2}"
    if kind == "norm":
        return f"{block}.{'attn_norm' if j % 2 == 0 else 'mlp_norm'}.{rest}"
    if kind == "mixer":
        assert j % 2 == 0, fqn
        return f"{block}.attn.{rest}"
    if kind == "mlp":
        assert j % 2 == 1, fqn
        return f"{block}.mlp.{rest}"
    raise AssertionError(f"unexpected parameter {fqn}")


@pytest.mark.parametrize("name", sorted(FLA_PARAMS))
def test_param_count_equals_fla(name):
    args = get_flavor(name)
    ours = sum(p.numel() for p in build_model(args).parameters())
    theirs = sum(p.numel() for p in fla_model(args).parameters())
    assert theirs == FLA_PARAMS[name]
    assert ours == FLA_PARAMS[name]


def _small(mixer):
    kw = dict(vocab_size=96, dim=32, n_layers=6, ffn_dim=48, mixer=mixer)
    if mixer == "gdn":
        return ModelArgs(**kw, gdn=GDNArgs(num_heads=2, num_v_heads=4, head_dim=8, head_v_dim=16))
    return ModelArgs(**kw, kda=KDAArgs(num_heads=2, head_dim=8, head_v_dim=16))


@pytest.mark.parametrize("args", [
    pytest.param(_small("gdn"), id="small-gdn"),
    pytest.param(_small("kda"), id="small-kda"),
    pytest.param(get_flavor("gdn_300M"), id="gdn_300M"),
    pytest.param(get_flavor("kda_300M"), id="kda_300M"),
])
def test_state_dict_maps_one_to_one_onto_fla(args):
    ours = {to_fla_name(n): tuple(p.shape) for n, p in build_model(args).named_parameters()}
    assert len(ours) == len(list(build_model(args).parameters()))  # the mapping is injective
    theirs = {n: tuple(p.shape) for n, p in fla_model(args).named_parameters()}
    assert "lm_head.weight" not in theirs  # tied: named_parameters lists the embedding only
    assert set(ours) - set(theirs) == set()
    assert set(theirs) - set(ours) == set()
    assert ours == theirs
    # buffers (none expected on either side that a checkpoint would carry)
    assert [n for n, _ in build_model(args).named_buffers()] == []


@pytest.mark.parametrize("name", sorted(FLAVORS))
def test_every_flavor_builds_on_meta(name):
    args = get_flavor(name)
    model = build_model(args)
    assert len(model.layers) == args.n_layers == len(args.pattern)
    assert all(p.is_meta for p in model.parameters())
    assert (model.output_weight is model.embeddings.weight) == args.tie_embeddings
    kinds = [layer.kind for layer in model.layers]
    assert kinds == args.kinds
    # get_flavor hands out copies: changing one never changes the registry
    args.dim = 7
    assert FLAVORS[name].dim != 7


def test_unknown_flavor():
    with pytest.raises(ValueError, match=r"model\.flavor 'nope'"):
        get_flavor("nope")


# ----------------------------------------------------------------------------------------------------------------
# CPU forward/backward, packed documents, decoding


def _debug_model(name, seed=0):
    torch.manual_seed(seed)
    model = build_model(get_flavor(name), "cpu")
    model.init_weights()
    return model


def test_debug_flavors_listed():
    assert set(DEBUG_FLAVORS) <= set(FLAVORS)
    assert {n for n in FLAVORS if n.startswith("debug_")} == set(DEBUG_FLAVORS)


@pytest.mark.parametrize("name", DEBUG_FLAVORS)
def test_debug_flavor_trains_on_cpu(name):
    model = _debug_model(name)
    V = model.args.vocab_size
    ids = torch.randint(0, V, (2, 41))
    loss = model(ids[:, :-1], labels=ids[:, 1:])
    assert loss.dim() == 0 and torch.isfinite(loss)
    # random tokens and a 0.02-std init: the prediction is close to uniform
    assert abs(loss.item() - math.log(V)) < 0.3, loss.item()
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n} has no gradient"
        assert torch.isfinite(p.grad).all(), f"{n} has a non-finite gradient"
    # every sublayer body receives a non-zero gradient (nothing is cut off the graph)
    for i, layer in enumerate(model.layers):
        assert any(p.grad.abs().sum() > 0 for p in layer.body.parameters()), f"layer {i} ({layer.kind})"


@pytest.mark.parametrize("name", DEBUG_FLAVORS)
def test_debug_flavor_loss_matches_logits(name):
    """The fused loss equals the cross-entropy of the logits the model returns, ignored labels included."""
    model = _debug_model(name)
    ids = torch.randint(0, model.args.vocab_size, (2, 25))
    labels = ids[:, 1:].clone()
    labels[0, :5] = -100
    with torch.no_grad():
        loss = model(ids[:, :-1], labels=labels)
        logits = model(ids[:, :-1])
    assert logits.shape == (2, 24, model.args.vocab_size) and logits.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


# Two rows of 48 tokens, packed with documents; cu_seqlens runs over the 96 flattened tokens and includes the row
# boundary (48). One document of a single token, one spanning a whole row's tail.
ROWS, ROW_LEN = 2, 48
PACKED_CU = [0, 10, 11, 48, 70, 96]


@pytest.mark.parametrize("name", DEBUG_FLAVORS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_packed_documents_are_isolated(name, dtype):
    model = _debug_model(name)
    ids = torch.randint(0, model.args.vocab_size, (ROWS, ROW_LEN))
    cu = torch.tensor(PACKED_CU, dtype=dtype)
    with torch.no_grad():
        packed = model(ids, cu_seqlens=cu).reshape(ROWS * ROW_LEN, -1)
        flat = ids.reshape(-1)
        for s, e in zip(PACKED_CU[:-1], PACKED_CU[1:]):
            alone = model(flat[s:e].unsqueeze(0))[0]
            torch.testing.assert_close(packed[s:e], alone, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, s=s, e=e: f"{name} document [{s}, {e}): {m}")
        # the isolation matters: without cu_seqlens, the second document of row 0 reads the first
        unpacked = model(ids).reshape(ROWS * ROW_LEN, -1)
        assert (unpacked[11:48] - packed[11:48]).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["debug_hybrid", "debug_mamba2"])
def test_packed_documents_batch_of_one(name):
    """A single row of packed documents (no row flattening)."""
    model = _debug_model(name)
    cu = [0, 1, 33, 40, 64]
    ids = torch.randint(0, model.args.vocab_size, (1, 64))
    with torch.no_grad():
        packed = model(ids, cu_seqlens=torch.tensor(cu, dtype=torch.int32))[0]
        for s, e in zip(cu[:-1], cu[1:]):
            torch.testing.assert_close(packed[s:e], model(ids[:, s:e])[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", DEBUG_FLAVORS)
def test_packed_loss_equals_per_document_losses(name):
    model = _debug_model(name)
    ids = torch.randint(0, model.args.vocab_size, (ROWS, ROW_LEN + 1))
    inputs, labels = ids[:, :-1], ids[:, 1:]
    with torch.no_grad():
        loss = model(inputs, labels=labels, cu_seqlens=torch.tensor(PACKED_CU))
        total, flat_in, flat_lab = 0.0, inputs.reshape(-1), labels.reshape(-1)
        for s, e in zip(PACKED_CU[:-1], PACKED_CU[1:]):
            total += model(flat_in[s:e].unsqueeze(0), labels=flat_lab[s:e].unsqueeze(0)).item() * (e - s)
    assert math.isclose(loss.item(), total / (ROWS * ROW_LEN), rel_tol=1e-5)


@pytest.mark.parametrize("name", DEBUG_FLAVORS)
def test_decoding_with_cache_matches_full_forward(name):
    model = _debug_model(name)
    B, T, prefix = 2, 20, 13
    ids = torch.randint(0, model.args.vocab_size, (B, T))
    with torch.no_grad():
        full = model(ids)
        cache = InferenceCache(len(model.layers))
        steps = [model(ids[:, :prefix], cache=cache)]
        for t in range(prefix, T):
            steps.append(model(ids[:, t:t + 1], cache=cache))
    decoded = torch.cat(steps, dim=1)
    assert decoded.shape == full.shape
    torch.testing.assert_close(decoded, full, rtol=0, atol=1e-4)
    if "*" in model.args.pattern:  # the MLA latents (or grouped-query keys) of every position are cached
        key = "c_kv" if model.args.attention == "mla" else "k"
        assert all(s[key].shape[1] == T for s in cache.layers if key in s)
    # every mixer / attention sublayer left a state behind, the MLPs none
    for layer, state in zip(model.layers, cache.layers):
        assert bool(state) == (layer.kind != "mlp"), layer.kind


def test_cache_reorder_selects_rows():
    """Beam search support: reordering the cache rows is the same as decoding the reordered batch."""
    model = _debug_model("debug_hybrid")
    ids = torch.randint(0, model.args.vocab_size, (3, 9))
    with torch.no_grad():
        cache = InferenceCache(len(model.layers))
        model(ids[:, :8], cache=cache)
        cache.reorder(torch.tensor([2, 0]))
        step = model(ids[[2, 0], 8:9], cache=cache)
        full = model(ids[[2, 0]])
    torch.testing.assert_close(step[:, 0], full[:, -1], rtol=0, atol=1e-4)
