"""Context parallelism: ``build_cp_context`` metadata (FLA 0.6.0's partition) and
``chunk_kda(..., cp_context=ctx)`` on 2 and 4 gloo ranks (separate processes, CPU tensors through
the PyTorch path, float64) against the one-process op: outputs, final states and every gradient.

The rank processes run tests/distributed/cp_worker.py; a hang fails after a timeout instead of blocking.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

import kdakit
from kdakit import build_cp_context, chunk_kda, shard_tokens

_spec = importlib.util.spec_from_file_location("cp_worker", Path(__file__).with_name("cp_worker.py"))
cp_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cp_worker)

TOL = 1e-11  # float64: the chain adds a few roundings; a wrong composition is off by O(1)


@pytest.mark.parametrize("world", [2, 4])
def test_cp_matches_one_process(world, tmp_path):
    results = cp_worker.launch(world, tmp_path, timeout=120)
    assert len(results) == world
    cases = results[0].keys()
    assert len(cases) == len(cp_worker.CPU_CASES[world]) + 1  # + the refusals
    bad = {}
    for r, res in enumerate(results):
        assert res.keys() == cases
        for case, errs in res.items():
            if case == "refusals":
                if any(errs.values()):
                    bad[(r, case)] = errs
                continue
            if "dq" not in errs or ("full=True" in case and "dA_log" not in errs):
                bad[(r, case)] = f"gradients missing: {sorted(errs)}"
            worst = {k: v for k, v in errs.items() if not v <= TOL}
            if worst:
                bad[(r, case)] = worst
    assert not bad, bad


def _cu(*offsets):
    return torch.tensor(offsets, dtype=torch.int32)


def test_contiguous_partition():
    cu = _cu(0, 3, 13, 20)  # part_len 5 over 4 ranks
    want = {  # rank: (local cu_seqlens, pre, post, conv tokens)
        0: ([0, 3, 5], 0, 2, 0),
        1: ([0, 5], 1, 1, 2),
        2: ([0, 3, 5], 2, 1, 7),
        3: ([0, 5], 1, 0, 2),
    }
    for rank, (local, pre, post, conv) in want.items():
        ctx = build_cp_context(cu, None, world_size=4, rank=rank)
        assert ctx.cu_seqlens_cpu.tolist() == local and ctx.cu_seqlens.tolist() == local
        assert (ctx.pre_num_ranks, ctx.post_num_ranks, ctx.pre_num_conv_tokens) == (pre, post, conv)
        assert (ctx.is_first_rank, ctx.is_last_rank) == (pre == 0, post == 0)
        assert ctx.layout == "contiguous" and ctx.part_len == 5 and ctx.num_seqs == len(local) - 1
        assert ctx.pre_num_ranks_by_part is None and ctx.front_num_seqs is None


def test_zigzag_partition():
    cu = _cu(0, 3, 8, 16)  # 4 intervals of 4: rank 0 holds 0 and 3, rank 1 holds 1 and 2
    c0 = build_cp_context(cu, None, layout="zigzag", world_size=2, rank=0)
    assert c0.cu_seqlens_cpu.tolist() == [0, 3, 4, 8] and c0.front_num_seqs == 2 and c0.part_len == 4
    assert c0.pre_num_ranks_by_part == (0, 1) and c0.post_num_ranks_by_part == (1, 0)
    assert c0.is_first_by_part == (True, False) and c0.is_last_by_part == (False, True)
    assert c0.pre_num_conv_tokens_by_part == (0, 4)
    assert c0.pre_num_ranks is None and c0.is_first_rank is None
    c1 = build_cp_context(cu, None, layout="zigzag", world_size=2, rank=1)
    assert c1.cu_seqlens_cpu.tolist() == [0, 4, 8] and c1.front_num_seqs == 1
    assert c1.pre_num_ranks_by_part == (1, 0) and c1.post_num_ranks_by_part == (0, 1)
    # the chain is the same on every rank: whose interval is where
    assert [(s.rank, s.part) for s in c0.chain] == [(0, 0), (1, 0), (1, 1), (0, 1)]
    assert [s.seq_ids for s in c1.chain] == [(0, 1), (1,), (2,), (2,)]


def test_zero_length_sequences_dropped_and_owned():
    cu = _cu(0, 4, 4, 8, 8)  # zero-length sequences at offsets 4 (interval 1) and 8 = T (the last)
    c0 = build_cp_context(cu, None, world_size=2, rank=0)
    c1 = build_cp_context(cu, None, world_size=2, rank=1)
    assert c0.cu_seqlens_cpu.tolist() == [0, 4] and c1.cu_seqlens_cpu.tolist() == [0, 4]
    assert c0.chain[0].empty_ids == () and c0.chain[1].empty_ids == (1, 3)
    assert c0.post_num_ranks == 0 and c1.pre_num_ranks == 0 and not c0.has_boundaries


def test_shard_tokens():
    x = torch.arange(16.0).view(1, 16, 1)
    c = build_cp_context(_cu(0, 16), None, world_size=2, rank=0)
    assert shard_tokens(x, c).flatten().tolist() == list(range(8))
    z = build_cp_context(_cu(0, 16), None, layout="zigzag", world_size=2, rank=1)
    assert shard_tokens(x, z).flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="all 16 global tokens"):
        shard_tokens(x[:, :8], c)
    with pytest.raises(TypeError, match="CPContext"):
        shard_tokens(x, object())


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(layout="ring"), ValueError, "layout must be one of"),
    (dict(use_tf32x3_affine_chain=False), ValueError, "use_tf32x3_affine_chain must be True"),
    (dict(world_size=3, rank=0), ValueError, "positive multiple of world_size = 3"),
    (dict(layout="zigzag", world_size=3, rank=0), ValueError, r"positive multiple of 2 \* world_size = 6"),
    (dict(world_size=2), ValueError, "world_size and rank go together"),
    (dict(world_size=2, rank=2), ValueError, "rank must lie in"),
    (dict(world_size=2, rank=0, conv1d_kernel_size=0), ValueError, "conv1d_kernel_size"),
    (dict(world_size=2, rank=0, bogus=1), TypeError, "bogus"),
])
def test_build_cp_context_refuses(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        build_cp_context(_cu(0, 5, 8), None, **kwargs)


def test_build_cp_context_refuses_offsets():
    with pytest.raises(TypeError, match="int32 or int64"):
        build_cp_context(torch.tensor([0.0, 8.0]), None, world_size=2, rank=0)
    with pytest.raises(ValueError, match="non-decreasing"):
        build_cp_context(_cu(0, 6, 4, 8), None, world_size=2, rank=0)
    with pytest.raises(ValueError, match="must start at 0"):
        build_cp_context(_cu(2, 8), None, world_size=2, rank=0)
    with pytest.raises(ValueError, match="cu_seqlens_cpu's length"):
        build_cp_context(_cu(0, 8), None, cu_seqlens_cpu=torch.tensor([0, 4, 8]), world_size=2, rank=0)
    with pytest.raises(ValueError, match="initialized torch.distributed"):
        build_cp_context(_cu(0, 8), None)


def _local_inputs(T=4, H=1, K=4, V=3):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, T, H, D, generator=gen, dtype=torch.float64) for D in (K, K, V))
    g = -torch.rand(1, T, H, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(1, T, H, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta


def test_chunk_kda_cp_refusals_before_any_communication():
    ctx = build_cp_context(_cu(0, 8), None, world_size=2, rank=0)
    q, k, v, g, beta = _local_inputs()
    with pytest.raises(TypeError, match="cp_context must be a kdakit CPContext"):
        chunk_kda(q, k, v, g, beta, cp_context={"group": None})
    with pytest.raises(ValueError, match="cu_seqlens comes from cp_context"):
        chunk_kda(q, k, v, g, beta, cp_context=ctx, cu_seqlens=_cu(0, 4))
    with pytest.raises(ValueError, match="state_indices"):
        chunk_kda(q, k, v, g, beta, cp_context=ctx, initial_state=torch.randn(2, 1, 4, 3),
                  state_indices=torch.tensor([0], dtype=torch.int32))
    with pytest.raises(ValueError, match="initialized torch.distributed process group"):
        chunk_kda(q, k, v, g, beta, cp_context=ctx, cu_seqlens=ctx.cu_seqlens)
    with pytest.raises(ValueError, match="use_graph"):  # FLA options kdakit lacks still refuse first
        chunk_kda(q, k, v, g, beta, cp_context=ctx, use_graph=True)


def test_exports():
    assert kdakit.build_cp_context is build_cp_context and kdakit.CPContext is type(
        build_cp_context(_cu(0, 2), None, world_size=1, rank=0))
