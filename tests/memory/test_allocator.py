"""The caching-allocator replay (kdakit.memory.allocator): its rules on small cases, and its prediction of
the reserved peaks against the H200 measurements committed in benchmarks/results/chunk_h200.json."""

import json
from pathlib import Path

import pytest

from kdakit.memory.allocator import MIB, CachingAllocator, predict_protocol_reserved, round_size, segment_size

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "chunk_h200.json"


def test_rounding_and_segment_sizes():
    assert (round_size(1), round_size(512), round_size(513)) == (512, 512, 1024)
    assert segment_size(MIB) == 2 * MIB                 # small pool
    assert segment_size(MIB + 512) == 20 * MIB          # large pool, under 10 MiB
    assert segment_size(10 * MIB) == 10 * MIB
    assert segment_size(10 * MIB + 1) == 12 * MIB       # rounded up to 2 MiB


def test_split_merge_and_best_fit():
    a = CachingAllocator()
    x = a.malloc(3 * MIB)                               # a 20 MiB segment, split: 17 MiB stay free
    assert (a.reserved, a.allocated) == (20 * MIB, 3 * MIB)
    y = a.malloc(16 * MIB)                              # takes the 17 MiB rest whole: 1 MiB left is not > 1 MiB
    assert a.reserved == 20 * MIB and a.allocated == 20 * MIB
    z = a.malloc(MIB // 2)                              # small pool: its own 2 MiB segment
    assert a.reserved == 22 * MIB
    a.free(x)
    a.free(y)                                           # merges with x: the whole 20 MiB segment free
    w = a.malloc(20 * MIB)                              # reuses the merged block whole
    assert a.reserved == 22 * MIB and a.allocated == 20 * MIB + MIB // 2
    a.free(w)
    a.free(z)
    a.empty_cache()
    assert (a.reserved, a.allocated) == (0, 0)


def test_a_small_remainder_is_handed_out_whole():
    a = CachingAllocator()
    big = a.malloc(12 * MIB - 512)                      # segment 12 MiB, remainder 512 B <= 1 MiB: not split
    assert a.allocated == 12 * MIB
    a.free(big)
    with pytest.raises(ValueError):
        a.free(big)


def _measured():
    records = json.loads(RESULTS.read_text())["records"]
    return {(r["mbs"], r["seq"], r["heads"]): r for r in records if r.get("status", "ok") == "ok"}


@pytest.mark.parametrize("shape", [(1, 8192, 96), (8, 8192, 16), (1, 8192, 128), (1, 131072, 96)])
def test_reserved_peaks_match_the_h200_measurements(shape):
    r = _measured()[shape]
    p = predict_protocol_reserved(*shape)
    assert p.peak_allocated_bytes == round(r["peak_alloc_gib"] * 2**30)
    # the first measured step, to the byte (later ones may add a 2 MiB small-pool segment: host-side allocations)
    assert p.peak_reserved_bytes == r["peak_reserved_bytes_runs"][0]
    assert max(r["peak_reserved_bytes_runs"]) - p.peak_reserved_bytes <= 2 * MIB
    assert p.peak_reserved_clean_bytes == round(r["peak_reserved_clean_gib"] * 2**30)
