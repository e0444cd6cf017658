"""The GPU backend's own logic around FLA's kernels, checked on CPU with the reference kernel standing in for FLA's
(FLA's Triton kernels do not run here)."""

import pytest
import torch

from hybridtitan.ops import fla_backend, reference


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_simple_gla_pads_small_head_dims_exactly_in_training(monkeypatch, scale, packed):
    """With a backward pass to come, key and value dims below 64 reach FLA's kernel padded with zero columns (its
    backward faulted or was wrong below 64), packed documents or not: outputs, final states and every gradient
    are those of the unpadded computation. Without a backward pass (evaluation) nothing is padded."""
    seen = []

    def stand_in(q, k, v, g, scale, initial_state, output_final_state, cu_seqlens):
        seen.append((q.shape[-1], v.shape[-1]))
        return reference.chunk_simple_gla(q, k, v, g, scale=scale, initial_state=initial_state,
                                          output_final_state=output_final_state, cu_seqlens=cu_seqlens)

    monkeypatch.setattr(fla_backend, "chunk_simple_gla", stand_in)
    gen = torch.Generator().manual_seed(0)
    T, H, K, V = 96, 2, 16, 8
    cu = torch.tensor([0, 30, 96]) if packed else None
    n_states = 2 if packed else 1  # one per document, or per row of the batch of one
    q, k = (torch.randn(1, T, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    h0 = torch.randn(n_states, H, K, V, generator=gen, dtype=torch.float64)
    inputs = [x.requires_grad_() for x in (q, k, v, g, h0)]

    def run(fn):
        for x in inputs:
            x.grad = None
        o, state = fn(*inputs[:4], scale, cu_seqlens=cu, initial_state=inputs[4], output_final_state=True)
        (o.sum() + state.pow(2).sum()).backward()
        return o.detach(), state.detach(), [x.grad.clone() for x in inputs]

    padded = run(fla_backend.simple_gla)
    assert seen == [(fla_backend.MIN_TRAINED_HEAD_DIM, fla_backend.MIN_TRAINED_HEAD_DIM)]
    plain = run(lambda q, k, v, g, s, **kw: reference.chunk_simple_gla(q, k, v, g, scale=s, **kw))
    assert padded[0].shape == (1, T, H, V) and padded[1].shape == (n_states, H, K, V)
    # the reference kernel computes in float32 whatever its inputs: wider value blocks change the order of its
    # float32 sums, hence a float32-level relative error over each tensor (a wrong padding is off by ~1)
    for a, b in zip([padded[0], padded[1], *padded[2]], [plain[0], plain[1], *plain[2]]):
        assert a.shape == b.shape
        assert (a - b).norm() <= 1e-6 * b.norm()

    seen.clear()  # calls without a backward pass (evaluation) are left as they are
    with torch.no_grad():
        fla_backend.simple_gla(q, k, v, g, scale, cu_seqlens=cu)
    fla_backend.simple_gla(q.detach(), k.detach(), v.detach(), g.detach(), scale, cu_seqlens=cu)
    assert seen == [(K, V), (K, V)]


def test_delta_rules_pass_their_chunk_size_and_decode_without_one(monkeypatch):
    """Training calls reach FLA's chunked kernels with CHUNK_SIZE's chunk for their mixer (32 for KDA, measured
    faster on an H200); decoding goes to the recurrent kernels, which take none."""
    calls = []

    def stand_in(name):
        def fn(**kwargs):
            calls.append((name, kwargs.get("chunk_size")))
            return kwargs["v"], None
        return fn

    for name in ("_triton_chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "chunk_kda",
                 "fused_recurrent_kda"):
        monkeypatch.setattr(fla_backend, name, stand_in(name.lstrip("_").replace("triton_", "")))
    q = torch.zeros(1, 128, 2, 8, requires_grad=True)
    args = (q, q, q, None, None, None, None)
    fla_backend.gated_delta_rule(*args)
    fla_backend.kda(*args)
    with torch.no_grad():
        fla_backend.kda(q[:, :1], *args[1:])
    assert calls == [("chunk_gated_delta_rule", fla_backend.CHUNK_SIZE["gdn"]),
                     ("chunk_kda", fla_backend.CHUNK_SIZE["kda"]), ("fused_recurrent_kda", None)]


def test_configs_of_three_or_more_stages_dropped_on_rocm(monkeypatch):
    """On a ROCm build of torch, importing the backend drops the autotune configs of more than 2 stages (they hung
    backward passes on AMD GPUs) from simple GLA's and the delta rules' state-gradient kernels and from KDA's,
    except where a kernel has no other; on CUDA it changes nothing."""
    import importlib

    kernels = fla_backend.limited_kernels(fla_backend.ROCM_STAGE_LIMITS)
    assert {"fla.ops.common.chunk_h.chunk_bwd_kernel_dh",
            "fla.ops.common.chunk_delta_h.chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64"} <= set(kernels)
    assert any(name.startswith("fla.ops.kda.chunk_intra.") for name in kernels)
    others = fla_backend.autotuned_kernels(["fla.ops.common.chunk_h"])  # the forward kernels: left alone
    saved = {name: list(k.configs) for name, k in {**kernels, **others}.items()}
    assert any(c.num_stages > 2 for name in kernels for c in saved[name])
    try:
        monkeypatch.setattr(torch.version, "hip", None)
        importlib.reload(fla_backend)
        assert {name: list(k.configs) for name, k in kernels.items()} == {n: saved[n] for n in kernels}
        monkeypatch.setattr(torch.version, "hip", "6.4.0")
        importlib.reload(fla_backend)
        for name, kernel in kernels.items():
            if any(c.num_stages <= 2 for c in saved[name]):
                assert kernel.configs == [c for c in saved[name] if c.num_stages <= 2], name
            else:
                assert kernel.configs == saved[name], name  # no config of 2 stages or fewer: FLA's own kept
        for name, kernel in others.items():
            if name not in kernels:
                assert kernel.configs == saved[name], name
        assert sum(len(k.configs) for k in kernels.values()) < sum(len(saved[n]) for n in kernels)
    finally:
        for name, kernel in {**kernels, **others}.items():
            kernel.configs = saved[name]
        monkeypatch.setattr(torch.version, "hip", None)
        importlib.reload(fla_backend)


def _gdn_call_recorder(monkeypatch):
    calls = []

    def stand_in(**kwargs):
        calls.append(kwargs)
        return kwargs["v"], None

    monkeypatch.setattr(fla_backend, "_triton_chunk_gated_delta_rule", stand_in)
    monkeypatch.setattr(fla_backend, "chunk_gated_delta_rule", stand_in)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 128, 2, 8, generator=gen, dtype=torch.bfloat16, requires_grad=True)
    a, b = (torch.randn(1, 128, 2, generator=gen, dtype=torch.bfloat16) for _ in range(2))
    A_log, dt_bias = torch.randn(2, generator=gen), torch.randn(2, generator=gen)
    return calls, (q, q, q, a, b, A_log, dt_bias)


def test_gdn_gate_in_float32_outside_the_kernel_on_rocm(monkeypatch):
    """On CUDA the gate and beta go into FLA's kernel raw (fused there); on ROCm the log decay
    -exp(A_log) * softplus(a + dt_bias) and sigmoid(beta) are computed first, the decay in float32."""
    calls, args = _gdn_call_recorder(monkeypatch)
    monkeypatch.setattr(torch.version, "hip", None)
    fla_backend.gated_delta_rule(*args)
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    fla_backend.gated_delta_rule(*args)
    cuda, rocm = calls
    q, _, _, a, b, A_log, dt_bias = args
    assert cuda["use_gate_in_kernel"] and cuda["g"] is a and cuda["A_log"] is A_log and cuda["beta"] is b
    assert not rocm["use_gate_in_kernel"] and not rocm["use_beta_sigmoid_in_kernel"] and "A_log" not in rocm
    assert rocm["g"].dtype == torch.float32
    torch.testing.assert_close(rocm["g"], -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias))
    torch.testing.assert_close(rocm["beta"], torch.sigmoid(b.float()).to(b.dtype))


def test_gdn_backend_pinned_to_triton_or_flash_qla(monkeypatch, caplog):
    """backend "triton" is FLA's own function beneath its backend dispatch (so an installed FlashQLA is never
    taken); "flash_qla" goes through the dispatch with the gate outside the kernel (FlashQLA's condition); the
    log says once which ran (here FlashQLA is not installed)."""
    import inspect
    import logging

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as dispatched

    triton = inspect.unwrap(fla_backend._triton_chunk_gated_delta_rule)
    assert triton is inspect.unwrap(dispatched) and not hasattr(triton, "__wrapped__")
    assert triton.__code__.co_filename.endswith("fla/ops/gated_delta_rule/chunk.py")
    calls, args = _gdn_call_recorder(monkeypatch)
    monkeypatch.setattr(fla_backend, "_logged_kernels", set())
    with caplog.at_level(logging.INFO, logger="hybridtitan"):
        fla_backend.gated_delta_rule(*args, backend="flash_qla")
        fla_backend.gated_delta_rule(*args, backend="flash_qla")
    assert not calls[0]["use_gate_in_kernel"] and calls[0]["g"].dtype == torch.float32
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gated_delta_rule:")]
    assert told == ["gated_delta_rule: FlashQLA asked for but not installed: FLA's Triton kernels"]
    with pytest.raises(ValueError, match="backend must be one of triton, flash_qla"):
        fla_backend.gated_delta_rule(*args, backend="cuda")


@pytest.mark.parametrize("heads, kv_heads, dk, dv", [(4, 2, 16, 16), (4, 4, 24, 16)])
def test_bottom_right_attention_is_the_reference(heads, kv_heads, dk, dv):
    """T queries as the last T of S keys (decoding, a CP rank's run of queries): SDPA's bottom-right causal bias,
    grouped heads repeated, equals the reference's explicit mask, forward and every gradient. On CPUs SDPA takes
    its math kernel; the flash and memory-efficient kernels are gpu_harness/checks/cp_check.py's."""
    g = torch.Generator().manual_seed(0)
    T, S = 5, 12
    q, k, v = (torch.randn(2, n, h, d, generator=g, dtype=torch.float64, requires_grad=True)
               for n, h, d in ((T, heads, dk), (S, kv_heads, dk), (S, kv_heads, dv)))
    fused = fla_backend.bottom_right_attention(q, k, v, 0.3)
    want = reference.causal_attention(q, k, v, 0.3)
    torch.testing.assert_close(fused, want)
    w = torch.randn(fused.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((fused * w).sum(), (q, k, v))
    ref = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
