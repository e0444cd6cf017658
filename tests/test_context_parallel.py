"""Context parallelism's building blocks (hybridtitan.ops.context_parallel) over real processes (gloo): every op
split over W ranks gives the outputs and gradients of the one-process op on the whole sequence, in float32.

One launch of W processes per degree (2 and 4) checks every case: layouts contiguous and zigzag; dense rows and
packed documents whose boundaries fall inside chunks, exactly on chunk edges, one token before a chunk (the
convolution's halo cut), and at random; documents over more than two chunks. Per case the ops gated_delta_rule
(grouped value heads), kda, simple_gla, the short convolution, attention (grouped-query heads) and the MLA's use
of it, plus the split/gather round trip. The four ranks also split into two CP groups of two
(``context_parallel_group``), each checking the carried ops on its own, and refuse groups of three. Each rank
writes what it found to a JSON file; a test per case reads it. The layout itself (segments, positions, the
one-line errors) is planned without processes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import run_ranks
from hybridtitan.models.rope import apply_rope, plain_inv_freq, rope_cos_sin
from hybridtitan.ops import context_parallel as cp

# float32: CP and one process differ only in the order of roundings (atol: times max(1, the largest |value|))
RTOL, ATOL = 1e-4, 1e-5
T_PACKED, T_DENSE, DENSE_ROWS = 128, 64, 2
H, HV, K, V, D_CONV, WIDTH = 2, 4, 16, 16, 24, 4
DEGREES = (2, 4)
CASES = ("dense", "inside", "on_edges", "random")
# the MLA's head widths (Dk = nope + rope differs from Dv) and its latent
MLA_NOPE, MLA_ROPE, MLA_V, MLA_LATENT = 16, 8, 12, 20
OPS = ("layout", "gated_delta_rule", "kda", "simple_gla", "short_conv", "attention", "mla")
CARRIED = OPS[1:]  # the ops whose result depends on the other ranks' tokens (not the layout round trip)
SUBGROUP, SUBGROUP_CASE, SUBGROUP_LAYOUT = 2, "inside", "zigzag"  # the groups of two inside the four ranks
LAUNCH_TIMEOUT_S = 150


def case_bounds(case: str, T: int, C: int, degree: int) -> list[int] | None:
    """The document boundaries of a case (None: dense rows) for rows of T tokens in chunks of C."""
    if case == "dense":
        return None
    if case == "inside":  # boundaries inside chunks; [3, 2C + 5) spans three chunks; a one-token document
        return [0, 3, 2 * C + 5, 2 * C + 6, T - C // 2, T]
    if case == "on_edges":  # on chunk edges; a one-token document; [2C - 1, 3C) starts a token before chunk 2
        return [0, C, C + 1, 2 * C - 1, 3 * C, T]
    g = torch.Generator().manual_seed(100 + degree)
    return [0, *sorted((torch.randperm(T - 1, generator=g)[:6] + 1).tolist()), T]


def case_key(degree: int, layout: str, case: str, op: str) -> str:
    return f"W{degree}-{layout}-{case}-{op}"


# ------------------------------------------------------------------------------------------------------ the ranks


def _inputs(op: str, B: int, T: int, seed: int) -> tuple[dict, dict]:
    """(sequence tensors [B, T, ...], shared parameters) of an op, the same on every rank."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    # decays of ~0.95 a token: a state carries across chunks of 8 to 32 tokens (strong ones would forget it)
    A_log = torch.empty(H).uniform_(0.5, 2.0, generator=g).log()
    if op == "gated_delta_rule":
        return ({"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, HV, V),
                 "a": randn(B, T, HV, scale=0.5), "b": randn(B, T, HV)},
                {"A_log": torch.empty(HV).uniform_(0.5, 2.0, generator=g).log(), "dt_bias": randn(HV, scale=0.1) - 3})
    if op == "kda":
        return ({"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, H, V),
                 "a": randn(B, T, H, K, scale=0.5), "b": randn(B, T, H)},
                {"A_log": A_log, "dt_bias": randn(H * K, scale=0.1) - 3})
    if op == "simple_gla":
        return ({"q": randn(B, T, H, K), "k": randn(B, T, H, K), "v": randn(B, T, H, V),
                 "g": -torch.nn.functional.softplus(randn(B, T, H)) * 0.1}, {})
    if op == "short_conv":
        return {"x": randn(B, T, D_CONV)}, {"weight": randn(D_CONV, WIDTH, scale=0.5), "bias": randn(D_CONV)}
    if op == "attention":
        return {"q": randn(B, T, H, K), "k": randn(B, T, 1, K), "v": randn(B, T, 1, V)}, {}  # grouped-query heads
    if op == "mla":
        return ({"q": randn(B, T, H, MLA_NOPE + MLA_ROPE), "c_kv": randn(B, T, MLA_LATENT),
                 "k_rope": randn(B, T, MLA_ROPE)},
                {"kv_up": randn(H * (MLA_NOPE + MLA_V), MLA_LATENT, scale=MLA_LATENT ** -0.5)})
    return {"x": randn(B, T, 3, 5)}, {}  # the layout round trip


def _mla_attention_inputs(d: dict, positions: torch.Tensor, gather):
    """q, k, v of the MLA as hybridtitan.models.mla forms them: RoPE on the queries and the shared rope key at
    ``positions``, then the keys' nope part and the values up-projected from the latent, after ``gather`` (CP:
    the whole sequence's latent and rotated rope key, as cp_attention takes them; one process: none)."""
    cos, sin = rope_cos_sin(positions, plain_inv_freq(MLA_ROPE, 10000.0))
    q_nope, q_rope = d["q"].split([MLA_NOPE, MLA_ROPE], dim=-1)
    q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)
    c_kv, k_rope = gather(d["c_kv"]), gather(apply_rope(d["k_rope"].unsqueeze(2), cos, sin))
    B, S = c_kv.shape[:2]
    k_nope, v = (c_kv @ d["kv_up"].T).view(B, S, H, MLA_NOPE + MLA_V).split([MLA_NOPE, MLA_V], dim=-1)
    return q, torch.cat([k_nope, k_rope.expand(B, S, H, MLA_ROPE)], dim=-1), v


def _one_process(kernels, op: str, d: dict, cu):
    """The op as one process computes it: on the whole sequence (cu: the global boundaries), or without any state
    from other ranks (the local tokens flattened, cu: the local boundaries)."""
    if op == "gated_delta_rule":
        return kernels.gated_delta_rule(**d, cu_seqlens=cu)[0]
    if op == "kda":
        return kernels.kda(**d, cu_seqlens=cu)[0]
    if op == "simple_gla":
        return kernels.simple_gla(**d, cu_seqlens=cu)[0]
    if op == "short_conv":
        return kernels.causal_conv1d(d["x"], d["weight"], d["bias"], "silu", cu_seqlens=cu)[0]
    if op == "attention":
        return kernels.attention(d["q"], d["k"], d["v"], 0.25, cu_seqlens=cu)
    if op == "mla":
        q, k, v = _mla_attention_inputs(d, torch.arange(d["q"].shape[1]), lambda x: x)
        return kernels.attention(q, k, v, 0.25, cu_seqlens=cu)
    return d["x"]


def _context_parallel(kernels, shard, op: str, d: dict):
    if op == "gated_delta_rule":
        return cp.cp_gated_delta_rule(kernels, shard, **d)[0]
    if op == "kda":
        return cp.cp_kda(kernels, shard, **d)[0]
    if op == "simple_gla":
        return cp.cp_simple_gla(kernels, shard, **d)[0]
    if op == "short_conv":  # through cp_short_conv's blocks (cp_causal_conv1d under them)
        ys, state = cp.cp_short_conv(kernels, shard, d["x"], d["weight"], d["bias"], "silu", sizes=[8, 16])
        assert state is None and [y.shape[-1] for y in ys] == [8, 16]
        return torch.cat(ys, dim=-1)
    if op == "attention":
        k, v = cp.gather_sequence(d["k"], shard), cp.gather_sequence(d["v"], shard)
        return cp.cp_attention(kernels, shard, d["q"], k, v, 0.25)
    if op == "mla":  # the RoPE positions of the unsplit sequence; the small latent gathered, not k and v
        q, k, v = _mla_attention_inputs(d, shard.positions, lambda x: cp.gather_sequence(x, shard))
        return cp.cp_attention(kernels, shard, q, k, v, 0.25)
    return cp.gather_sequence(d["x"], shard)  # every rank the whole sequence again


def _leaves(d: dict) -> dict:
    return {name: t.detach().clone().requires_grad_(True) for name, t in d.items()}


def _compare(pairs) -> tuple[list[str], float]:
    """(failures, largest absolute difference) of (name, ours, theirs) pairs."""
    failures, worst = [], 0.0
    for name, ours, theirs in pairs:
        worst = max(worst, (ours - theirs).abs().max().item() if ours.shape == theirs.shape else math.inf)
        try:
            # the absolute part at the tensor's scale: a gradient that is zero in exact arithmetic (the decay of a
            # document's first token) comes out as float32 noise of the size of its neighbours' roundings
            torch.testing.assert_close(ours, theirs, rtol=RTOL, atol=ATOL * max(1.0, theirs.abs().max().item()))
        except AssertionError as e:
            failures.append(f"{name}: " + "; ".join(line for line in str(e).splitlines() if line))
    return failures, worst


def _check_case(kernels, shard, op: str, case_seed: int, B: int, cu) -> tuple[list[str], float, float]:
    """Runs one op both ways on this rank. Every collective comes before any comparison, so a failed comparison
    on one rank leaves the others' collectives matched. Returns (failures, worst difference, the largest
    difference of the state-free local op from the truth over all ranks)."""
    import torch.distributed as dist

    seq, params = _inputs(op, B, shard.seq_len, case_seed)
    full, full_params = _leaves(seq), _leaves(params)
    truth = _one_process(kernels, op, {**full, **full_params}, cu)
    cotangent = torch.randn(truth.shape, generator=torch.Generator().manual_seed(case_seed + 1))
    (truth * cotangent).sum().backward()

    local, local_params = _leaves({n: shard.split(t) for n, t in seq.items()}), _leaves(params)
    ours = _context_parallel(kernels, shard, op, {**local, **local_params})
    if op == "layout":  # each rank's loss covers the whole gathered sequence: W times each part's cotangent
        (ours * cotangent).sum().backward()
        expected_grad = {"x": shard.degree * shard.split(cotangent)}
        gathered = ours.detach()
    else:
        (ours * shard.split(cotangent)).sum().backward()
        expected_grad = {n: shard.split(t.grad) for n, t in full.items()}
        gathered = shard.gather(ours.detach())
    param_grads = {}
    for name, p in local_params.items():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=shard.group)  # a shared parameter's gradient: the sum of the ranks'
        param_grads[name] = grad
    with torch.no_grad():
        flat = {n: t.reshape(1, -1, *t.shape[2:]) for n, t in local.items()}
        alone = _one_process(kernels, op, {**flat, **local_params}, cp.local_cu_seqlens(shard, B))
        alone_diff = torch.tensor((alone.view(shard.split(truth).shape) - shard.split(truth)).abs().max().item())
    dist.all_reduce(alone_diff, op=dist.ReduceOp.MAX, group=shard.group)

    pairs = [("output", gathered, truth.detach())]
    pairs += [(f"d{n}", local[n].grad, expected_grad[n]) for n in local]
    pairs += [(f"d{n} (summed over ranks)", param_grads[n], full_params[n].grad) for n in params]
    failures, worst = _compare(pairs)
    return failures, worst, alone_diff.item()


def subgroup_key(op: str) -> str:
    return f"groups of {SUBGROUP}-{SUBGROUP_LAYOUT}-{SUBGROUP_CASE}-{op}"


def worker(rank: int, degree: int, folder: str) -> None:
    """One rank: every case of this degree (at degree 4 also the groups of two and the refusal of groups of
    three); writes {key: {failures, worst, alone[, refusal]}} to folder/rank<R>.json."""
    import torch.distributed as dist

    from hybridtitan.ops import Kernels

    torch.set_num_threads(1)
    # RANK, WORLD_SIZE and the store's address come from the environment run_ranks gives
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a hang fails within a minute
    kernels, found = Kernels(), {}
    for layout in cp.LAYOUTS:
        for case in CASES:
            T = T_DENSE if case == "dense" else T_PACKED
            B = DENSE_ROWS if case == "dense" else 1
            bounds = case_bounds(case, T, T // (2 * degree), degree)
            cu = None if bounds is None else torch.tensor(bounds, dtype=torch.long)
            shard = cp.shard_for(cu, T, None, layout)
            for i, op in enumerate(OPS):
                failures, worst, alone = _check_case(kernels, shard, op, 1000 * i + 7 * degree, B, cu)
                found[case_key(degree, layout, case, op)] = {"failures": failures, "worst": worst, "alone": alone}
    if degree == 2 * SUBGROUP:
        try:
            cp.context_parallel_group(SUBGROUP + 1)
            refusal = None
        except ValueError as e:  # raised alike on every rank, before any collective
            refusal = str(e)
        found["refusal"] = {"failures": [], "worst": 0.0, "alone": 0.0, "refusal": refusal}
        group = cp.context_parallel_group(SUBGROUP)
        T = T_PACKED
        cu = torch.tensor(case_bounds(SUBGROUP_CASE, T, T // (2 * SUBGROUP), SUBGROUP), dtype=torch.long)
        shard = cp.shard_for(cu, T, group, SUBGROUP_LAYOUT)
        assert shard.degree == SUBGROUP and shard.rank == rank % SUBGROUP
        for i, op in enumerate(CARRIED):  # the groups' inputs differ: seeds apart by the group
            failures, worst, alone = _check_case(kernels, shard, op, 1000 * i + 31 * (rank // SUBGROUP), 1, cu)
            found[subgroup_key(op)] = {"failures": failures, "worst": worst, "alone": alone}
    with open(f"{folder}/rank{rank}.json", "w") as f:
        json.dump(found, f)
    dist.destroy_process_group()


def launch(degree: int, folder) -> dict:
    """Runs ``worker`` on ``degree`` ranks (helpers.run_ranks: this file as a script, forks of the preloaded
    server); returns {key: {"failures": ["rank r: ..."], "worst", "alone"}}."""
    proc = run_ranks([__file__, str(folder)], degree, timeout=LAUNCH_TIMEOUT_S)
    if proc.returncode != 0:
        raise RuntimeError(f"the {degree} ranks failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    merged: dict = {}
    for rank in range(degree):
        for key, found in json.loads((folder / f"rank{rank}.json").read_text()).items():
            entry = merged.setdefault(key, {**found, "failures": [], "worst": 0.0})  # rank 0's alone, refusal
            entry["failures"] += [f"rank {rank}: {f}" for f in found["failures"]]
            entry["worst"] = max(entry["worst"], found["worst"])
    return merged


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """results(degree): every case's findings at that degree, from one launch (kept for the module)."""
    done: dict = {}

    def get(degree: int) -> dict:
        if degree not in done:
            try:
                done[degree] = launch(degree, tmp_path_factory.mktemp(f"cp{degree}"))
            except (RuntimeError, subprocess.TimeoutExpired, OSError, ValueError) as e:
                done[degree] = e  # every case of the degree fails with it, without launching again
        if isinstance(done[degree], Exception):
            raise done[degree]
        return done[degree]

    return get


# ----------------------------------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("degree", DEGREES)
def test_context_parallel_equals_one_process(results, degree, layout, case, op):
    """The gathered outputs and the gradients of every input (shared parameters: summed over the ranks) equal
    the one-process op's on the whole sequence, within rtol 1e-4 and atol 1e-5 x max(1, largest |value|)."""
    found = results(degree).get(case_key(degree, layout, case, op))
    assert found is not None, "the ranks did not check this case"
    assert not found["failures"], "\n".join(found["failures"])


@pytest.mark.parametrize("op", CARRIED)
def test_context_parallel_subgroups(results, op):
    """CP inside two groups of two of the four ranks (their own inputs each): the collectives stay in the group,
    ranks counted in it; outputs and gradients as one process."""
    found = results(2 * SUBGROUP).get(subgroup_key(op))
    assert found is not None, "the ranks did not check this case"
    assert not found["failures"], "\n".join(found["failures"])


def test_degree_not_dividing_the_world_is_one_line_error(results):
    refusal = results(2 * SUBGROUP)["refusal"]["refusal"]
    assert refusal is not None, "groups of three of four ranks were not refused"
    assert "\n" not in refusal and "over 3 ranks" in refusal and "4 ranks" in refusal and "divide" in refusal


@pytest.mark.parametrize("degree", DEGREES)
def test_cases_need_the_other_ranks(results, degree):
    """Every case is one where CP has work to do: the op on the local tokens alone (no state, halo or keys from
    the other ranks) is far from the truth, so a CP that dropped what the ranks hand on would fail above."""
    found = results(degree)
    weak = {key: f["alone"] for key, f in found.items()
            if key.rsplit("-", 1)[-1] in CARRIED and f["alone"] < 1e-2}
    assert not weak, f"cases where the local op alone is already right: {weak}"


def test_hand_made_layout():
    """T = 16 over 2 ranks (chunks of 4), documents [0, 3), [3, 4), [4, 10), [10, 16)."""
    cu = torch.tensor([0, 3, 4, 10, 16])
    z0 = cp.shard_for(cu, 16, layout="zigzag", rank=0, degree=2)
    assert z0.chunks == (0, 3) and z0.ranges == ((0, 4), (12, 16)) and z0.chunk_len == 4
    assert z0.cu_seqlens.tolist() == [0, 3, 4, 8]
    assert z0.continues == (False, False, True)
    assert [(s.global_start, s.global_end, s.document_start) for s in z0.segments] == [(0, 3, 0), (3, 4, 3),
                                                                                        (12, 16, 10)]
    assert z0.positions.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]  # as the unsplit model: the index in the row
    assert z0.document_positions.tolist() == [0, 1, 2, 0, 2, 3, 4, 5]
    assert z0.first_segments.tolist() == [0, 2] and z0.last_segments.tolist() == [1, 2]
    # per global chunk: the start of the document of its first token, and whether one starts inside it
    assert z0.chunk_document_start == (0, 4, 4, 10) and z0.chunk_restarts == (True, False, True, False)

    z1 = cp.shard_for(cu, 16, layout="zigzag", rank=1, degree=2)
    assert z1.chunks == (1, 2) and z1.cu_seqlens.tolist() == [0, 4, 6, 8]
    assert z1.continues == (False, True, False)  # chunk 1 starts [4, 10), chunk 2 continues it, then [10, 16)
    assert z1.token_index.tolist() == list(range(4, 12))
    assert z1.document_positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1]

    c0 = cp.shard_for(cu, 16, layout="contiguous", rank=0, degree=2)
    assert c0.chunks == (0, 1) and c0.ranges == ((0, 4), (4, 8))
    assert c0.cu_seqlens.tolist() == [0, 3, 4, 8] and c0.continues == (False, False, False)
    c1 = cp.shard_for(cu, 16, layout="contiguous", rank=1, degree=2)
    assert c1.cu_seqlens.tolist() == [0, 2, 4, 8] and c1.continues == (True, False, True)
    # the attention of c1: [8, 10) sees [4, 10); [10, 12) and [12, 16), one stretch of [10, 16), see [10, 16)
    assert cp._attention_spans(c1) == [(0, 2, 4, 10), (2, 8, 10, 16)]
    # four rows of 4 tokens packed into one: positions restart at each row, as the model's positions_of
    rows = cp.shard_for(cu, 16, layout="contiguous", rank=1, degree=2, rows=4)
    assert rows.positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]


def test_dense_rows_layout_and_empty_documents():
    dense = cp.shard_for(None, 64, layout="zigzag", rank=1, degree=4)
    assert dense.chunks == (1, 6) and dense.cu_seqlens.tolist() == [0, 8, 16]
    assert dense.continues == (True, True) and dense.positions.tolist() == [*range(8, 16), *range(48, 56)]
    assert cp.local_cu_seqlens(dense, 3).tolist() == [0, 8, 16, 24, 32, 40, 48]
    first = cp.shard_for(None, 64, layout="zigzag", rank=0, degree=4)
    assert first.continues == (False, True)  # chunk 0 starts the row
    # repeated boundaries (empty documents) hold no token and cut nothing
    empty = cp.shard_for(torch.tensor([0, 4, 4, 16, 16]), 16, layout="contiguous", rank=0, degree=2)
    assert empty.cu_seqlens.tolist() == [0, 4, 8]


@pytest.mark.parametrize("layout", cp.LAYOUTS)
@pytest.mark.parametrize("degree", DEGREES)
def test_split_holds_every_token_once(layout, degree):
    T = 32
    x = torch.arange(2 * T).view(2, T)
    shards = [cp.shard_for(None, T, layout=layout, rank=r, degree=degree) for r in range(degree)]
    held = torch.cat([s.token_index for s in shards])
    assert sorted(held.tolist()) == list(range(T))
    for s in shards:
        assert torch.equal(s.split(x), x[:, s.token_index])


def test_indivisible_sequence_is_one_line_error():
    with pytest.raises(ValueError) as exc:
        cp.shard_for(None, 100, layout="zigzag", rank=0, degree=4)
    message = str(exc.value)
    assert "\n" not in message and "T = 100" in message and "4 ranks" in message and "zigzag" in message
    assert "8 equal chunks" in message
    with pytest.raises(ValueError, match="layout 'ring'"):
        cp.shard_for(None, 64, layout="ring", rank=0, degree=2)
    with pytest.raises(ValueError, match="rise from 0 to the sequence length 64"):
        cp.shard_for(torch.tensor([0, 30, 60]), 64, rank=0, degree=2)
    with pytest.raises(ValueError, match="^rank 2 is not one of the 2 ranks of a context-parallel group$"):
        cp.shard_for(None, 64, rank=2, degree=2)


if __name__ == "__main__":  # a rank of launch(): python tests/test_context_parallel.py FOLDER
    worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[1])
