"""Data, thresholds and ranges of the arithmetic tasks."""
import numpy as np
import pytest
import torch

import nalu_cuda
from nalu_cuda.experiments.parts import arithmetic_data as ar
from nalu_cuda.experiments.parts import uniform_stream as us


@pytest.mark.parametrize("op", ar.OPS)
def test_threshold_matches_published_within_5_percent(op):
    # Madsen & Johansen's R script used subsets one input longer than their data set
    # (inclusive a.start:a.end); with that layout the estimator must give their numbers.
    got = ar.mse_threshold(op, ar.parse_range([2, 6]), layout="madsen", samples=100_000)
    assert got == pytest.approx(ar.PUBLISHED_THRESHOLDS[op], rel=0.05)


def test_task_threshold_is_of_the_trained_layout():
    # 25-input subsets: the additive thresholds grow with the number of unused inputs.
    r = ar.parse_range([2, 6])
    task = ar.mse_threshold("add", r, samples=100_000)
    madsen = ar.mse_threshold("add", r, layout="madsen", samples=100_000)
    assert task > madsen
    assert task == pytest.approx(ar.PUBLISHED_THRESHOLDS["add"], rel=0.15)


def test_recurrent_threshold_positive_and_ordered():
    r = ar.parse_range([1, 2])
    short = ar.recurrent_mse_threshold("add", r, 100, samples=500)
    long = ar.recurrent_mse_threshold("add", r, 1000, samples=500)
    assert 0 < short < long


def test_subset_layout_sizes_and_seed_offset():
    lay = ar.subset_layout(3, 100)
    assert lay.a_end - lay.a_start == 25 and lay.b_end - lay.b_start == 25
    assert lay.a_end - lay.b_start == 12
    assert 0 <= lay.a_start and lay.b_end <= 100
    starts = {ar.subset_layout(s, 100).a_start for s in range(20)}
    assert len(starts) > 5  # a random offset per seed
    assert ar.subset_layout(3, 100) == lay
    m = lay.mask()
    assert m.sum(0).tolist() == [25, 25]


def test_stream_members_independent_of_ensemble_and_resumable():
    r = ar.parse_range([1, 2])
    ens = us.UniformStream([4, 7, 9], (5, 3), r, chunk=4)
    single = us.UniformStream([7], (5, 3), r, chunk=4)
    for _ in range(6):
        a, b = ens.next(), single.next()
        assert torch.equal(a[1], b[0])
    state = ens.state_dict()
    nxt = [ens.next().clone() for _ in range(5)]
    again = us.UniformStream([4, 7, 9], (5, 3), r, chunk=4)
    again.load_state_dict(state)
    assert all(torch.equal(again.next(), x) for x in nxt)


@pytest.mark.parametrize("prefetch", [False, True])
def test_stream_reuses_chunk_memory_only_when_nothing_holds_it(prefetch):
    r = ar.parse_range([-2, 3])
    stream = us.UniformStream([1, 2], (6, 5), r, chunk=3, prefetch=prefetch)
    fresh = us.UniformStream([1, 2], (6, 5), r, chunk=3)
    held = stream.next()  # a batch the caller keeps across many chunks
    keep = held.clone()
    assert torch.equal(fresh.next(), keep)
    ptrs = set()
    for _ in range(30):
        x = stream.next()
        assert torch.equal(x, fresh.next())
        ptrs.add(x.untyped_storage().data_ptr())
        del x
    stream.close()
    assert torch.equal(held, keep)  # never overwritten while referenced
    assert len(ptrs) <= 3 < 30 // 3  # chunks drawn into recycled arrays, not fresh memory


def test_stream_values_in_range_and_union():
    x = us.UniformStream([0], (20000,), ar.parse_range([-6, -2, 2, 6])).next()
    assert ((x.abs() >= 2) & (x.abs() <= 6)).all()
    assert 0.45 < (x > 0).float().mean() < 0.55
    y = us.UniformStream([0], (20000,), ar.parse_range([0.1, 0.2])).next()
    assert y.min() >= 0.1 and y.max() <= 0.2
    assert abs(float(y.mean()) - 0.15) < 0.002


@pytest.mark.parametrize("bad", [[], [1], [2, 1], [1, 1], [0, 2, 1, 3], [float("nan"), 1]])
def test_bad_ranges(bad):
    with pytest.raises(ValueError):
        ar.parse_range(bad)


def test_range_contains():
    assert ar.parse_range([1, 2]).contains(ar.parse_range([1.2, 1.8]))
    assert not ar.parse_range([1, 2]).contains(ar.parse_range([2, 6]))
    assert ar.parse_range([-2, 2]).contains(ar.parse_range([-1, 1]))


def test_ops_and_aliases():
    a, b = np.array([6.0]), np.array([2.0])
    assert [float(ar.apply_op(op, a, b)[0]) for op in ar.OPS] == [8, 4, 12, 3, 36, pytest.approx(6 ** 0.5)]
    assert ar.canonical_op("sqrt") == "root" and ar.canonical_op("*") == "mul"
    with pytest.raises(ValueError, match="unknown operation"):
        ar.canonical_op("pow")


# ------------------------------------------------------------------------------------------------
# The native fill (csrc/experiments/cpu/uniform_fill.cpp) against the numpy code of UniformStream._draw_into
# ------------------------------------------------------------------------------------------------

_native = getattr(nalu_cuda._ops.fast, "sfc64_uniform_fill", None)
needs_native = pytest.mark.skipif(_native is None, reason="native extension not built")


class _CountingFast:
    """Stands in for nalu_cuda._C, counting the calls of the native fill."""

    def __init__(self):
        self.calls = 0

    def sfc64_uniform_fill(self, *args):
        self.calls += 1
        return _native(*args)


def _draw(monkeypatch, native, seeds, shape, rng, chunk, steps, has_uint32=0, uinteger=0):
    monkeypatch.setattr(us, "_USE_NATIVE_FILL", native)
    fast = _CountingFast()
    if _native is not None:
        monkeypatch.setattr(nalu_cuda._ops, "fast", fast)
    s = us.UniformStream(seeds, shape, ar.parse_range(rng), chunk=chunk)
    for bg in s._bitgens:  # random_raw leaves the buffered half-word alone; so must the native fill
        bg.state = {**bg.state, "has_uint32": has_uint32, "uinteger": uinteger}
    xs = torch.stack([s.next().clone() for _ in range(steps)])
    used_native = fast.calls > 0
    assert used_native == (native and _native is not None and len(ar.parse_range(rng).intervals) == 1)
    return xs.view(torch.int32), [bg.state for bg in s._bitgens]


def _same_states(a, b):
    return all(x["bit_generator"] == y["bit_generator"] and np.array_equal(x["state"]["state"], y["state"]["state"])
               and x["has_uint32"] == y["has_uint32"] and x["uinteger"] == y["uinteger"] for x, y in zip(a, b))


@needs_native
@pytest.mark.parametrize("rng", [[1, 2], [-2, 3], [0.1, 0.2], [1e-3, 7.3e4]])
@pytest.mark.parametrize("seeds,shape,chunk", [
    ([0], (5, 3), 1),             # odd n: pairs straddle rows; one generator (scalar code)
    ([1, 2, 3], (4, 2), 3),       # even n
    ([4, 7, 9, 11, 13], (67, 3), 4),  # four generators on AVX2 + one scalar; blocks straddle rows
    (list(range(8)), (1,), 3),    # n = 1
    (list(range(9)), (129,), 2),  # a block and a bit per row
])
def test_native_fill_bit_identical_to_numpy(monkeypatch, rng, seeds, shape, chunk):
    extra = dict(has_uint32=1, uinteger=12345) if len(seeds) == 3 else {}
    got, got_states = _draw(monkeypatch, True, seeds, shape, rng, chunk, 2 * chunk + 1, **extra)
    want, want_states = _draw(monkeypatch, False, seeds, shape, rng, chunk, 2 * chunk + 1, **extra)
    assert torch.equal(got, want)
    assert _same_states(got_states, want_states)


@needs_native
@pytest.mark.parametrize("raw", [False, True])
def test_native_fill_one_generator_strided_rows(raw):
    # A (rows, n) view with a row stride (one member's block of a chunk); odd rows * n.
    lo, hi = (1.0, 2.0) if raw else (-3.0, 5.0)
    bg = np.random.SFC64(42)
    words = bg.random_raw(3 * 7 // 2 + 1).view(np.uint32)[:21].reshape(3, 7)
    want = ((words >> np.uint32(9)) | np.uint32(0x3F800000)).view(np.float32)
    if not raw:
        want = (want - np.float32(1)) * np.float32(hi - lo) + np.float32(lo)
    base = np.full((3, 2, 7), np.nan, dtype=np.float32)
    state = np.random.SFC64(42).state["state"]["state"].view(np.int64)
    _native(torch.from_numpy(state), torch.from_numpy(base[:, 1, :]), lo, hi, raw)
    assert np.array_equal(base[:, 1, :].view(np.int32), want.view(np.int32))
    assert np.isnan(base[:, 0, :]).all()  # the other column block is untouched
    assert np.array_equal(state.view(np.uint64), bg.state["state"]["state"])


def test_two_interval_range_uses_numpy(monkeypatch):
    for r in ([-6, -2, 2, 6], [-3, -2, 1, 5]):  # equal lengths (low bit selects), unequal (second draw)
        got, got_states = _draw(monkeypatch, True, [3, 5], (7, 3), r, 3, 4)
        want, want_states = _draw(monkeypatch, False, [3, 5], (7, 3), r, 3, 4)
        assert torch.equal(got, want) and _same_states(got_states, want_states)
        x = got.view(torch.float32)
        assert ((x.abs() >= 2) & (x.abs() <= 6)).all() if r[0] == -6 else ((x >= -3) & (x <= 5)).all()


@needs_native
def test_native_fill_bad_arguments():
    out = torch.empty(4, 3, 5)
    with pytest.raises(RuntimeError, match=r"sfc64_uniform_fill: state must be a contiguous int64 .* got a Float"):
        _native(torch.zeros(3, 4), out, 0.0, 1.0)
    with pytest.raises(RuntimeError, match=r"sfc64_uniform_fill: state must be .* shape \(4,\) or \(G, 4\)"):
        _native(torch.zeros(3, 5, dtype=torch.int64), out, 0.0, 1.0)
    with pytest.raises(RuntimeError, match=r"sfc64_uniform_fill: out must be a float32 CPU tensor, got a Double"):
        _native(torch.zeros(3, 4, dtype=torch.int64), out.double(), 0.0, 1.0)
    with pytest.raises(RuntimeError, match=r"size\(1\) must be G = 2 .* got a Float .* shape \[4, 3, 5\]"):
        _native(torch.zeros(2, 4, dtype=torch.int64), out, 0.0, 1.0)
    with pytest.raises(RuntimeError, match=r"out must be 2-D \(rows, n\) for a state of shape \(4,\)"):
        _native(torch.zeros(4, dtype=torch.int64), out, 0.0, 1.0)
    with pytest.raises(RuntimeError, match=r"last dimension must be contiguous .* strides \[15, 1, 3\]"):
        _native(torch.zeros(3, 4, dtype=torch.int64), torch.empty(4, 5, 3).transpose(1, 2), 0.0, 1.0)
    with pytest.raises(RuntimeError, match=r"lo and hi must be finite, got lo = -inf"):
        _native(torch.zeros(3, 4, dtype=torch.int64), out, float("-inf"), 1.0)


# ------------------------------------------------------------------------------------------------
# Targets from sums drawn with the values (SumTargets) against numpy
# ------------------------------------------------------------------------------------------------


def _sum_stream(monkeypatch, native, seeds, shape, rng, weights, ops, steps):
    monkeypatch.setattr(us, "_USE_NATIVE_FILL", native)
    s = us.UniformStream(seeds, shape, ar.parse_range(rng), chunk=3, transform=us.SumTargets(weights, ops))
    return [s.next() for _ in range(steps)]


@needs_native
@pytest.mark.parametrize("rng", [[1, 2], [-3, 5], [0.1, 0.2]])
@pytest.mark.parametrize("shape", [(9, 100), (5, 4, 100), (7, 6)])  # static, recurrent, short rows
@pytest.mark.parametrize("halved", [False, True])  # subsets only (plain sums), or weights of 0.5 for two seeds
def test_sum_targets_native_bit_identical_to_numpy(monkeypatch, rng, shape, halved):
    seeds = [0, 3, 5, 8, 11]  # four generators on AVX2 and one scalar
    I = shape[-1]
    if I >= 50:
        weights = np.stack([ar.subset_layout(s, I).mask().numpy() for s in seeds]).astype(np.float64)
        if halved:  # weighted sums (products with the weights) for seeds 3 and 11, plain ones for the rest
            weights[[1, 4]] *= 0.5
    else:  # scattered 0/1 weights and a column of zeros: spans with gaps, and an empty one
        weights = (np.random.default_rng(1).random((len(seeds), I, 2)) < 0.5).astype(np.float64)
        weights[0, :, 1] = 0.0
    ops = ["add", "mul", "div"]
    with np.errstate(divide="ignore"):  # b = 0 for the empty column: a / b = inf either way
        got = _sum_stream(monkeypatch, True, seeds, shape, rng, weights, ops, 7)
        want = _sum_stream(monkeypatch, False, seeds, shape, rng, weights, ops, 7)
    for (x, t), (xw, tw) in zip(got, want):
        assert torch.equal(x, xw) and torch.equal(t, tw)
        assert t.shape == (len(ops) * len(seeds), shape[0], 1)
    # and the targets are op(a, b) of the inputs, with a and b over the weights (and time steps)
    x, t = got[-1]
    ab = torch.einsum("sb...i,sik->sbk", x.double(), torch.from_numpy(weights))
    expect = torch.cat([ar.apply_op(op, ab[..., 0], ab[..., 1]) for op in ops], 0).unsqueeze(-1).float()
    assert torch.allclose(t, expect, rtol=1e-6, atol=0, equal_nan=True)


@needs_native
def test_native_fill_sums_bad_arguments():
    state, out = torch.zeros(3, 4, dtype=torch.int64), torch.empty(2, 3, 20)
    w, sums = torch.zeros(3, 10, 2, dtype=torch.float64), torch.empty(2, 3, 2, 2, dtype=torch.float64)
    _native(state, out, 1.0, 2.0, True, w, sums)  # the shapes that fit
    with pytest.raises(RuntimeError, match="weights and sums come together, got weights without sums"):
        _native(state, out, 1.0, 2.0, True, w)
    with pytest.raises(RuntimeError, match=r"weights must be a contiguous float64 .* \(G, seg, K\) with G = 3"):
        _native(state, out, 1.0, 2.0, True, w.float(), sums)
    with pytest.raises(RuntimeError, match=r"rows of n = 20 values must split into segments of seg = 7"):
        _native(state, out, 1.0, 2.0, True, torch.zeros(3, 7, 2, dtype=torch.float64), sums)
    with pytest.raises(RuntimeError, match=r"sums must be .* shape \(rows, G, n / seg, K\) = \(2, 3, 2, 2\)"):
        _native(state, out, 1.0, 2.0, True, w, torch.empty(2, 3, 4, 2, dtype=torch.float64))
