"""The chunked PyTorch kernels (hybridtitan.ops.reference) against FLA's naive recurrences and plain-torch
oracles written here: forward outputs, final states and every input gradient, in float32.

Shapes are chosen to hit the awkward cases: lengths that are not a multiple of the chunk size, grouped value
heads (HV = 2 H), packed documents through ``cu_seqlens`` (one of them a single token), initial states.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
from fla.ops.kda.naive import naive_recurrent_kda
from fla.ops.simple_gla.naive import naive_recurrent_simple_gla

import hybridtitan.ops as ops
from hybridtitan.ops import reference


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, computed in float64."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


TOL = 1e-5
CU = [0, 30, 31, 120, 200]  # four packed documents, one of a single token


# ----------------------------------------------------------------------------------------------------------------
# helpers


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in tensors]


def _loss(outputs, cotangents):
    """A scalar that weights every output with a fixed random cotangent, so backward checks all gradients."""
    return sum((o * c).sum() for o, c in zip(outputs, cotangents) if o is not None)


def _check(ours, theirs, our_inputs, their_inputs, names, tol=TOL, grad_tol=None):
    """Compare outputs, then the gradients of every input, under the same random cotangents.
    ``grad_tol`` maps an input name to a looser tolerance for its gradient."""
    grad_tol = grad_tol or {}
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape, f"output {i}: {tuple(a.shape)} vs {tuple(b.shape)}"
        assert rel_err(a, b) < tol, f"output {i}: relative error {rel_err(a, b):.2e}"
    cotangents = [torch.randn_like(b) for b in theirs]
    grads_ours = torch.autograd.grad(_loss(ours, cotangents), our_inputs)
    grads_theirs = torch.autograd.grad(_loss(theirs, cotangents), their_inputs)
    for name, a, b in zip(names, grads_ours, grads_theirs):
        assert a is not None and b is not None, name
        assert a.shape == b.shape, f"d{name}: {tuple(a.shape)} vs {tuple(b.shape)}"
        assert torch.isfinite(a).all(), f"d{name} not finite"
        limit = grad_tol.get(name, tol)
        assert rel_err(a, b) < limit, f"d{name}: relative error {rel_err(a, b):.2e} (limit {limit:.0e})"


def _docs(cu_seqlens, T):
    bounds = [0, T] if cu_seqlens is None else cu_seqlens
    return list(zip(bounds[:-1], bounds[1:]))


def _per_document(fn, cu_seqlens, B, T, initial_state, tensors):
    """Run ``fn(*slices, initial_state=..)`` on each batch row or each packed document; concatenate the outputs
    along time and stack the final states (one per row / document, FLA's [N, ...] convention)."""
    if cu_seqlens is None:
        return fn(*tensors, initial_state=initial_state)
    outs, states = [], []
    for n, (s, e) in enumerate(_docs(cu_seqlens, T)):
        h0 = None if initial_state is None else initial_state[n:n + 1]
        o, st = fn(*(t[:, s:e] for t in tensors), initial_state=h0)
        outs.append(o)
        states.append(st)
    return torch.cat(outs, dim=1), torch.cat(states, dim=0)


# cases: (B, T, H, HV, K, V, cu_seqlens, with initial state)
DELTA_CASES = [
    pytest.param(2, 100, 2, 4, 16, 32, None, False, id="T100-gva"),
    pytest.param(1, 77, 2, 2, 16, 16, None, True, id="T77-h0"),
    pytest.param(2, 77, 1, 2, 8, 16, None, True, id="T77-gva-h0"),
    pytest.param(1, 200, 2, 4, 16, 16, CU, False, id="packed-gva"),
    pytest.param(1, 200, 2, 4, 16, 16, CU, True, id="packed-gva-h0"),
]


def _delta_inputs(B, T, H, HV, K, V, cu_seqlens, with_h0, per_channel):
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q = torch.randn(B, T, H, K)
    k = F.normalize(torch.randn(B, T, H, K), p=2, dim=-1)
    v = torch.randn(B, T, HV, V)
    g = F.logsigmoid(torch.randn(B, T, HV, K) if per_channel else torch.randn(B, T, HV))
    beta = torch.rand(B, T, HV)
    h0 = torch.randn(N, HV, K, V) if with_h0 else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    return q, k, v, g, beta, h0, cu


# ----------------------------------------------------------------------------------------------------------------
# Gated DeltaNet / KDA cores


def _naive_gdn(H, HV):
    def naive(q_, k_, v_, g_, b_, initial_state):
        G = HV // H
        return naive_recurrent_gated_delta_rule(
            q_.repeat_interleave(G, dim=2), k_.repeat_interleave(G, dim=2), v_, b_, g_,
            initial_state=initial_state, output_final_state=True,
        )
    return naive


def _naive_kda(H, HV):
    def naive(q_, k_, v_, g_, b_, initial_state):
        return naive_recurrent_kda(q_, k_, v_, g_, b_, initial_state=initial_state, output_final_state=True)
    return naive


# mixer -> (one decay per key channel, the reference's chunk size, FLA's naive recurrence for H, HV heads)
DELTA_MIXERS = {"gdn": (False, 64, _naive_gdn), "kda": (True, 16, _naive_kda)}


@pytest.mark.parametrize("mixer", list(DELTA_MIXERS))
@pytest.mark.parametrize("B, T, H, HV, K, V, cu_seqlens, with_h0", DELTA_CASES)
def test_chunk_delta_rule_vs_fla_naive(mixer, B, T, H, HV, K, V, cu_seqlens, with_h0):
    per_channel, chunk_size, naive_for = DELTA_MIXERS[mixer]
    q, k, v, g, beta, h0, cu = _delta_inputs(B, T, H, HV, K, V, cu_seqlens, with_h0, per_channel=per_channel)
    ours_in = _leaves(q, k, v, g, beta, h0)
    theirs_in = _leaves(q, k, v, g, beta, h0)
    o, s = reference.chunk_delta_rule(*ours_in[:5], scale=None, initial_state=ours_in[5], output_final_state=True,
                                      cu_seqlens=cu, chunk_size=chunk_size)
    o_ref, s_ref = _per_document(naive_for(H, HV), cu_seqlens, B, T, theirs_in[5], theirs_in[:5])
    names = ["q", "k", "v", "g", "beta"] + (["initial_state"] if with_h0 else [])
    n = len(names)
    _check([o, s], [o_ref, s_ref], ours_in[:n], theirs_in[:n], names)


def test_chunk_delta_rule_kda_strong_decay_stays_finite():
    """Per-channel decays of -20 per token underflow exp(cumsum) within a chunk: the reference must not form
    exp(+gamma) and so must stay exact (FLA's naive recurrence never overflows either)."""
    B, T, H, K, V = 1, 40, 2, 8, 8
    q, k, v, _, beta, _, _ = _delta_inputs(B, T, H, H, K, V, None, False, per_channel=True)
    g = -20 * torch.rand(B, T, H, K)
    o, s = reference.chunk_delta_rule(q, k, v, g, beta, output_final_state=True, chunk_size=16)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert rel_err(o, o_ref) < TOL and rel_err(s, s_ref) < TOL


def _l2norm(x):
    """FLA's fused l2norm: x / sqrt(sum(x^2) + 1e-6)."""
    return x / torch.sqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def _dt_bias(n, decay):
    """'init': the mixers' initialisation (softplus^-1 of a dt log-uniform in [1e-3, 0.1]); 'strong': N(0, 1),
    decays of -10 to -60 per token, where the state forgets everything within a token or two."""
    if decay == "strong":
        return torch.randn(n)
    dt = torch.empty(n).uniform_(math.log(1e-3), math.log(0.1)).exp()
    return dt + torch.log(-torch.expm1(-dt))


# Under very strong decays the chunked form loses float32 precision in the gradients of the gate only: a
# token's gate gradient is obtained as a difference of chunk-level sums (the reverse cumsum of the gradient of
# the chunk-cumulative decay), which nearly cancel when the true gradient is tiny. FLA's chunk kernels use the
# same formulation. Outputs and all other gradients stay at ~1e-6.
STRONG_DECAY_GATE_TOL = {"a": 3e-4, "A_log": 3e-4, "dt_bias": 3e-4}

OP_CASES = [
    pytest.param(None, False, "init", id="init"),
    pytest.param(None, True, "init", id="init-h0"),
    pytest.param(CU, True, "init", id="packed-init-h0"),
    pytest.param(None, True, "strong", id="strong-h0"),
    pytest.param(CU, False, "strong", id="packed-strong"),
]


@pytest.mark.parametrize("cu_seqlens, with_h0, decay", OP_CASES)
def test_gated_delta_rule_op_vs_fla_naive(cu_seqlens, with_h0, decay):
    """The full op: raw q, k (l2-normalised inside), gate logits a with A_log and dt_bias, beta logits b."""
    B, T, H, HV, K, V = (2, 100, 2, 4, 16, 16) if cu_seqlens is None else (1, 200, 2, 4, 16, 16)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    a, b = torch.randn(B, T, HV), torch.randn(B, T, HV)
    A_log = torch.empty(HV).uniform_(1, 16).log()
    dt_bias = _dt_bias(HV, decay)
    h0 = torch.randn(N, HV, K, V) if with_h0 else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    ours_in = _leaves(q, k, v, a, b, A_log, dt_bias, h0)
    theirs_in = _leaves(q, k, v, a, b, A_log, dt_bias, h0)
    assert ops.backend_for(q) == "torch"
    o, s = ops.gated_delta_rule(*ours_in[:7], cu_seqlens=cu, initial_state=ours_in[7], output_final_state=True)

    q_, k_, v_, a_, b_, A_, dt_ = theirs_in[:7]
    g = -A_.exp() * F.softplus(a_ + dt_)
    beta = torch.sigmoid(b_)
    G = HV // H
    qn = _l2norm(q_).repeat_interleave(G, dim=2)
    kn = _l2norm(k_).repeat_interleave(G, dim=2)

    def naive(q1, k1, v1, g1, b1, initial_state):
        return naive_recurrent_gated_delta_rule(q1, k1, v1, b1, g1, initial_state=initial_state,
                                                output_final_state=True)

    o_ref, s_ref = _per_document(naive, cu_seqlens, B, T, theirs_in[7], [qn, kn, v_, g, beta])
    names = ["q", "k", "v", "a", "b", "A_log", "dt_bias"] + (["initial_state"] if with_h0 else [])
    n = len(names)
    _check([o, s], [o_ref, s_ref], ours_in[:n], theirs_in[:n], names,
           grad_tol=STRONG_DECAY_GATE_TOL if decay == "strong" else None)

    # without output_final_state the state is not returned
    o2, s2 = ops.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cu_seqlens=cu, initial_state=h0)
    assert s2 is None and rel_err(o2, o_ref) < TOL

    # CUDA graphs and the call site that keys them change nothing off the GPU (gpu_harness/checks/gpu_check.py checks
    # them)
    graphed = ops.Kernels(ops.KernelConfig(cuda_graphs=True))
    o3, _ = graphed.gated_delta_rule(q, k, v, a, b, A_log, dt_bias, cu_seqlens=cu, initial_state=h0,
                                     site=torch.nn.Module())
    assert torch.equal(o3, o2)


@pytest.mark.parametrize("cu_seqlens, with_h0, decay", OP_CASES)
def test_kda_op_vs_fla_naive(cu_seqlens, with_h0, decay):
    B, T, H, HV, K, V = (2, 77, 2, 4, 8, 16) if cu_seqlens is None else (1, 200, 2, 4, 8, 16)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K)
    v = torch.randn(B, T, HV, V)
    a, b = torch.randn(B, T, HV, K), torch.randn(B, T, HV)
    A_log = torch.empty(HV).uniform_(1, 16).log()
    dt_bias = _dt_bias(HV * K, decay)
    h0 = torch.randn(N, HV, K, V) if with_h0 else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    ours_in = _leaves(q, k, v, a, b, A_log, dt_bias, h0)
    theirs_in = _leaves(q, k, v, a, b, A_log, dt_bias, h0)
    o, s = ops.kda(*ours_in[:7], cu_seqlens=cu, initial_state=ours_in[7], output_final_state=True)

    q_, k_, v_, a_, b_, A_, dt_ = theirs_in[:7]
    g = -A_.exp().view(HV, 1) * F.softplus(a_ + dt_.view(HV, K))
    beta = torch.sigmoid(b_)

    def naive(q1, k1, v1, g1, b1, initial_state):
        return naive_recurrent_kda(q1, k1, v1, g1, b1, initial_state=initial_state, output_final_state=True)

    o_ref, s_ref = _per_document(naive, cu_seqlens, B, T, theirs_in[7], [_l2norm(q_), _l2norm(k_), v_, g, beta])
    names = ["q", "k", "v", "a", "b", "A_log", "dt_bias"] + (["initial_state"] if with_h0 else [])
    n = len(names)
    _check([o, s], [o_ref, s_ref], ours_in[:n], theirs_in[:n], names,
           grad_tol=STRONG_DECAY_GATE_TOL if decay == "strong" else None)


# ----------------------------------------------------------------------------------------------------------------
# Mamba2's SSD: simple GLA (scalar decay per head)


def _scan_simple_gla(q, k, v, g, scale, initial_state=None):
    """The plain recurrence, one token at a time: S = exp(g_t) S + k_t v_t^T;  o_t = S^T (scale q_t)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    S = torch.zeros(B, H, K, V) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", scale * q[:, t], S))
    return torch.stack(outs, dim=1), S


SSD_CASES = [
    pytest.param(2, 100, 3, 16, 8, None, False, id="T100"),
    pytest.param(2, 77, 2, 8, 16, None, True, id="T77-h0"),
    pytest.param(1, 200, 2, 16, 8, CU, False, id="packed"),
    pytest.param(1, 200, 2, 16, 8, CU, True, id="packed-h0"),
]


def _ssd_inputs(B, T, H, K, V, cu_seqlens, with_h0):
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    # Mamba2-like magnitudes: B, C of order 1, x * dt small, decay A * dt in (-inf, 0)
    q, k = torch.randn(B, T, H, K), torch.randn(B, T, H, K) * 0.5
    v = torch.randn(B, T, H, V) * 0.1
    g = F.logsigmoid(torch.randn(B, T, H))
    h0 = torch.randn(N, H, K, V) if with_h0 else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int64)
    return q, k, v, g, h0, cu


@pytest.mark.parametrize("B, T, H, K, V, cu_seqlens, with_h0", SSD_CASES)
def test_chunk_simple_gla_vs_scan(B, T, H, K, V, cu_seqlens, with_h0):
    q, k, v, g, h0, cu = _ssd_inputs(B, T, H, K, V, cu_seqlens, with_h0)
    ours_in = _leaves(q, k, v, g, h0)
    theirs_in = _leaves(q, k, v, g, h0)
    o, s = reference.chunk_simple_gla(*ours_in[:4], scale=1.0, initial_state=ours_in[4], output_final_state=True,
                                      cu_seqlens=cu)

    def scan(q_, k_, v_, g_, initial_state):
        return _scan_simple_gla(q_, k_, v_, g_, 1.0, initial_state)

    o_ref, s_ref = _per_document(scan, cu_seqlens, B, T, theirs_in[4], theirs_in[:4])
    names = ["q", "k", "v", "g"] + (["initial_state"] if with_h0 else [])
    _check([o, s], [o_ref, s_ref], ours_in[:len(names)], theirs_in[:len(names)], names)


@pytest.mark.parametrize("B, T, H, K, V, cu_seqlens, with_h0", SSD_CASES)
def test_chunk_simple_gla_vs_fla_naive(B, T, H, K, V, cu_seqlens, with_h0):
    q, k, v, g, h0, cu = _ssd_inputs(B, T, H, K, V, cu_seqlens, with_h0)
    ours_in = _leaves(q, k, v, g, h0)
    theirs_in = _leaves(q, k, v, g, h0)
    # the default scale is K^-1/2, as FLA's
    o, s = ops.simple_gla(*ours_in[:4], cu_seqlens=cu, initial_state=ours_in[4], output_final_state=True)

    def naive(q_, k_, v_, g_, initial_state):
        return naive_recurrent_simple_gla(q_, k_, v_, g_, initial_state=initial_state, output_final_state=True)

    o_ref, s_ref = _per_document(naive, cu_seqlens, B, T, theirs_in[4], theirs_in[:4])
    names = ["q", "k", "v", "g"] + (["initial_state"] if with_h0 else [])
    _check([o, s], [o_ref, s_ref], ours_in[:len(names)], theirs_in[:len(names)], names)


# ----------------------------------------------------------------------------------------------------------------
# Short causal convolution


def _conv_reference(x, weight, bias, cu_seqlens, initial_state):
    """F.conv1d per document, left-padded with zeros or with the last W - 1 inputs of the initial state.
    Final state: the last W inputs of each document (initial state, then zeros, in front of short ones)."""
    B, T, D = x.shape
    W = weight.shape[-1]
    docs = [(b, 0, T) for b in range(B)] if cu_seqlens is None else [(0, s, e) for s, e in _docs(cu_seqlens, T)]
    outs, finals = [], []
    for n, (row, s, e) in enumerate(docs):
        seq = x[row, s:e].t()  # [D, L]
        hist = initial_state[n] if initial_state is not None else x.new_zeros(D, W)
        padded = torch.cat([hist[:, 1:], seq], dim=1)  # [D, W - 1 + L]
        y = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), bias, groups=D)[0]  # [D, L]
        outs.append(F.silu(y).t())
        finals.append(torch.cat([hist, seq], dim=1)[:, -W:])
    if cu_seqlens is None:
        out = torch.stack(outs)
    else:
        out = torch.cat(outs).unsqueeze(0)
    return out, torch.stack(finals)


@pytest.mark.parametrize(
    "B, T, cu_seqlens, with_h0",
    [(2, 37, None, False), (2, 37, None, True), (1, 200, CU, False), (1, 200, CU, True),
     (1, 10, [0, 1, 3, 10], True)],
)
def test_causal_conv1d_vs_conv1d(B, T, cu_seqlens, with_h0):
    D, W = 12, 4
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    x, weight, bias = torch.randn(B, T, D), torch.randn(D, W), torch.randn(D)
    h0 = torch.randn(N, D, W) if with_h0 else None
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, dtype=torch.int32)
    ours_in = _leaves(x, weight, bias, h0)
    theirs_in = _leaves(x, weight, bias, h0)
    y, s = reference.causal_conv1d(ours_in[0], ours_in[1], ours_in[2], "silu", cu, ours_in[3], True)
    y_ref, s_ref = _conv_reference(*theirs_in[:3], cu_seqlens, theirs_in[3])
    names = ["x", "weight", "bias"] + (["initial_state"] if with_h0 else [])
    _check([y, s], [y_ref, s_ref], ours_in[:len(names)], theirs_in[:len(names)], names)


def test_causal_conv1d_without_state_output():
    x, w = torch.randn(1, 9, 6), torch.randn(6, 3)
    y, s = reference.causal_conv1d(x, w, None, None)
    assert s is None
    ref = F.conv1d(F.pad(x.transpose(1, 2), (2, 0)), w.unsqueeze(1), groups=6).transpose(1, 2)
    assert rel_err(y, ref) < TOL


# ----------------------------------------------------------------------------------------------------------------
# Causal softmax attention (MLA's core)


def _naive_attention(q, k, v, scale, seg_q=None, seg_k=None):
    """softmax(q k^T scale + mask) v per row; query i sits at key position S - T + i; with segment ids, a
    query sees only keys of its own document."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    scores = torch.einsum("bthd,bshd->bhts", q, k) * scale
    allowed = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    if seg_q is not None:
        allowed = allowed & (seg_q[:, None] == seg_k[None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)


def test_causal_attention_plain():
    B, T, H, Dk, Dv = 2, 33, 3, 24, 16
    q, k, v = torch.randn(B, T, H, Dk), torch.randn(B, T, H, Dk), torch.randn(B, T, H, Dv)
    scale = Dk ** -0.5
    ours_in, theirs_in = _leaves(q, k, v), _leaves(q, k, v)
    out = reference.causal_attention(*ours_in, scale)
    ref = _naive_attention(*theirs_in, scale)
    _check([out], [ref], ours_in, theirs_in, ["q", "k", "v"])


def test_causal_attention_packed_rows():
    """Two rows of 40 tokens flattened to a batch of one, documents marked over the 80 tokens (row boundary
    included): each row attends only within its own documents."""
    rows, L, H, Dk, Dv = 2, 40, 2, 16, 8
    cu = [0, 7, 8, 40, 65, 80]
    q, k, v = torch.randn(1, rows * L, H, Dk), torch.randn(1, rows * L, H, Dk), torch.randn(1, rows * L, H, Dv)
    scale = 0.3
    ours_in, theirs_in = _leaves(q, k, v), _leaves(q, k, v)
    out = reference.causal_attention(*ours_in, scale, torch.tensor(cu, dtype=torch.int32), rows)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    ref = _naive_attention(*theirs_in, scale, seg, seg)  # one 80-token row with document masks: same result
    _check([out], [ref], ours_in, theirs_in, ["q", "k", "v"])
    # and document by document, each run alone
    for s, e in _docs(cu, rows * L):
        alone = _naive_attention(q[:, s:e], k[:, s:e], v[:, s:e], scale)
        assert rel_err(out[:, s:e], alone) < TOL


def test_causal_attention_decoding():
    """k and v hold more positions than q (a cache): the T queries are the last T positions."""
    B, T, S, H, Dk, Dv = 2, 3, 20, 2, 16, 8
    q, k, v = torch.randn(B, T, H, Dk), torch.randn(B, S, H, Dk), torch.randn(B, S, H, Dv)
    scale = Dk ** -0.5
    out = reference.causal_attention(q, k, v, scale)
    assert rel_err(out, _naive_attention(q, k, v, scale)) < TOL
    # the last query sees every key: plain softmax attention over all of them
    full = torch.softmax(torch.einsum("bhd,bshd->bhs", q[:, -1], k) * scale, -1)
    assert rel_err(out[:, -1], torch.einsum("bhs,bshd->bhd", full, v)) < TOL
    # one query against the cache, as in token-by-token decoding
    out1 = reference.causal_attention(q[:, :1], k[:, : S - T + 1], v[:, : S - T + 1], scale)
    assert rel_err(out1, out[:, :1]) < TOL


def test_l2norm_matches_fla_formula():
    x = torch.randn(3, 5, 16)
    assert rel_err(reference.l2norm(x), _l2norm(x)) < 1e-6
    assert math.isclose(reference.l2norm(x).norm(dim=-1).mean().item(), 1.0, rel_tol=1e-4)


@pytest.mark.parametrize("B, T", [(1, 1), (1, 2), (2, 1), (1, 3), (2, 2)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_causal_conv1d_sequences_shorter_than_kernel(B, T, with_h0):
    """Inputs shorter than the kernel: decoding one token at a time against a cached window, or a document of
    one or two tokens run alone. With W = 4, fewer than W - 1 = 3 flattened tokens (B * T < 3) fail: the shifted
    copy of the input is built as cat(zeros(shift), flat[:-shift]), which has ``shift`` rows, not B * T, once
    shift > B * T."""
    D, W = 6, 4
    x, weight, bias = torch.randn(B, T, D), torch.randn(D, W), torch.randn(D)
    h0 = torch.randn(B, D, W) if with_h0 else None
    y, s = reference.causal_conv1d(x, weight, bias, "silu", None, h0, True)
    y_ref, s_ref = _conv_reference(x, weight, bias, None, h0)
    assert y.shape == (B, T, D) and s.shape == (B, D, W)
    assert rel_err(y, y_ref) < TOL and rel_err(s, s_ref) < TOL


def test_causal_conv1d_token_by_token_equals_full():
    """Feeding the final state back as the next initial state, one token at a time, reproduces the full output."""
    D, W, T = 5, 4, 9
    x, weight = torch.randn(1, T, D), torch.randn(D, W)
    full, full_state = reference.causal_conv1d(x, weight, None, "silu", output_final_state=True)
    state, outs = torch.zeros(1, D, W), []
    for t in range(T):
        y, state = reference.causal_conv1d(x[:, t:t + 1], weight, None, "silu", initial_state=state,
                                           output_final_state=True)
        outs.append(y)
    assert rel_err(torch.cat(outs, dim=1), full) < TOL
    assert rel_err(state, full_state) < TOL


def test_compiled_norms_equal_eager():
    """compile.components = ["norm"]: RMSNorm and the fused residual add + RMSNorm through torch.compile give the
    eager results, forward and every gradient (the sum's own gradient included); the forced reference path
    ignores the switch."""
    gen = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(2, 8, 32, generator=gen) for _ in range(2))
    weight = 1 + 0.1 * torch.randn(32, generator=gen)
    grads = [torch.randn(2, 8, 32, generator=gen) for _ in range(3)]

    def run(kernels):
        inputs = [t.clone().requires_grad_() for t in (x, residual, weight)]
        normed, total = kernels.add_rms_norm(*inputs, 1e-6)
        plain = kernels.rms_norm(inputs[0], inputs[2], 1e-6)
        torch.autograd.backward([normed, total, plain], grads)
        return [normed.detach(), total.detach(), plain.detach()] + [t.grad for t in inputs]

    eager = run(ops.DEFAULT)
    compiled = run(ops.Kernels(ops.KernelConfig(compiled_norms=True, fused_residual=True)))
    assert ops._compiled.cache_info().currsize == 2  # both functions went through torch.compile
    forced = run(ops.Kernels(ops.KernelConfig(compiled_norms=True, fused_residual=True, reference=True)))
    for a, b, c in zip(compiled, eager, forced):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(c, b, rtol=0, atol=0)
    torch.testing.assert_close(eager[1], x + residual, rtol=0, atol=0)


def test_compiled_swiglu_equals_eager():
    """compile.components = ["swiglu"]: the MLP's silu(gate) * up through torch.compile (the product formed again
    in the backward pass, not kept) gives the eager results, forward and every gradient; the forced reference
    path ignores the switch."""
    gen = torch.Generator().manual_seed(0)
    gate, up = (3 * torch.randn(2, 8, 48, generator=gen) for _ in range(2))
    weight = torch.randn(16, 48, generator=gen) / 48 ** 0.5
    grad = torch.randn(2, 8, 16, generator=gen)

    def run(fn):
        inputs = [t.clone().requires_grad_() for t in (gate, up, weight)]
        out = fn(*inputs)
        out.backward(grad)
        return [out.detach()] + [t.grad for t in inputs]

    compiling = ops.Kernels(ops.KernelConfig(compiled_swiglu=True))
    eager = run(ops.swiglu_linear)
    compiled = run(compiling.swiglu_linear)
    forced = run(ops.Kernels(ops.KernelConfig(compiled_swiglu=True, reference=True)).swiglu_linear)
    # inside a function that torch.compile traces whole (compile.components = ["model", "swiglu"])
    traced = run(torch.compile(compiling.swiglu_linear))
    for a, b, c, d in zip(compiled, eager, forced, traced):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, b, rtol=0, atol=0)
        torch.testing.assert_close(d, b, rtol=1e-5, atol=1e-5)
    # the compiled path is the autograd function that keeps gate and up only
    out = compiling.swiglu_linear(*(t.clone().requires_grad_() for t in (gate, up, weight)))
    assert type(out.grad_fn).__name__ == "_CompiledSwiGLULinearBackward"
