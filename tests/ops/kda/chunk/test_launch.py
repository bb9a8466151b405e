"""Launch overrides of the 64-token pipeline (``kdakit/ops/kda/chunk/launch.py``): every launch constant a kernel
file lists is read through the plan's ``Launch`` in one forward+backward, an override changes the launch and not
the result (beyond the summation order), and bad overrides are refused naming the constant."""

import pytest
import torch

from kdakit.ops.kda.chunk.launch import SHIPPED, Launch, launch_of

from .test_pipeline import GATES, _inputs, _ours, _rel, _run


class _Recording(Launch):
    """The shipped configs, recording every constant a launcher asks for."""

    def __init__(self):
        super().__init__({})
        object.__setattr__(self, "asked", set())

    def get(self, name, default):
        self.asked.add(name)
        return default


def _step(launch, gate="softplus"):
    x = _inputs(gate, B=1, T=80, H=1, HV=2, K=32, V=32, dtype=torch.float32, lengths=[70, 10], seed=3,
                strided=False, h0=True, v_first=False)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(1, 80, 2, 32, generator=gen)
    dht = torch.randn(2, 2, 32, 32, generator=gen)
    return _run(_ours(x, 64, launch=launch), x, GATES[gate], False, do, dht)


def test_every_listed_constant_is_read_through_the_launch():
    rec = _Recording()
    _step(rec)
    assert rec.asked == set(SHIPPED), (sorted(set(SHIPPED) - rec.asked), sorted(rec.asked - set(SHIPPED)))


def test_an_override_changes_the_launch_not_the_result():
    o, ht, grads = _step(None)
    over = {"PREP_BLOCK_K": 16, "WU_CONFIG": {"bf16": (64, 8), "fp32": (16, 2)}, "FINISH_BLOCK_K": 16,
            "SUM_BLOCK": 32, "SUM_ROWS": 8, "GRADS_INTRA_BLOCK_K": 16, "DAV_BLOCK_V": {"bf16": 128, "fp32": 16},
            "WALK_FWD_BLOCK_V": {"bf16": (64,), "fp32": (16,)},
            "SOLVE_CONFIG": {"bf16": (32, 1, 2), "fp32": (16, 1, 1)}}
    o2, ht2, grads2 = _step(over)
    assert _rel(o, o2) < 1e-6 and _rel(ht, ht2) < 1e-6
    for name in grads:
        assert _rel(grads[name], grads2[name]) < 1e-5, name


@pytest.mark.parametrize("bad, err, match", [
    ({"PREP_BLOK_K": 64}, ValueError, "PREP_BLOK_K"),
    ({"PREP_BLOCK_K": 0}, ValueError, "PREP_BLOCK_K"),
    ({"PREP_BLOCK_K": True}, ValueError, "PREP_BLOCK_K"),
    ({"WU_CONFIG": {"bf16": (64, 8)}}, ValueError, "WU_CONFIG"),
    ({"DOTS_CONFIG": {"bf16": (64,), "fp32": (32, 2)}}, ValueError, "DOTS_CONFIG"),
    ({"DAV_BLOCK_V": {"bf16": 1.5, "fp32": 32}}, ValueError, "DAV_BLOCK_V"),
    ([("PREP_BLOCK_K", 64)], TypeError, "launch"),
])
def test_bad_overrides_name_the_constant(bad, err, match):
    with pytest.raises(err, match=match):
        launch_of(bad)


def test_launch_of_keeps_none_and_freezes_the_overrides():
    assert launch_of(None) is None and launch_of({}) is None
    over = {"WU_CONFIG": {"bf16": (32, 4), "fp32": (32, 4)}}
    launch = launch_of(over)
    over["WU_CONFIG"]["bf16"] = (128, 8)
    assert launch.get("WU_CONFIG", None)["bf16"] == (32, 4)
    with pytest.raises(TypeError):
        launch.overrides["PREP_BLOCK_K"] = 64
    assert launch_of(launch) is launch
