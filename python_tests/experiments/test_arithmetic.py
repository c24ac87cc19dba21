"""Data, thresholds and ranges of the arithmetic tasks."""
import numpy as np
import pytest
import torch

from nalu_cuda.experiments import arithmetic as ar


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
    ens = ar.UniformStream([4, 7, 9], (5, 3), r, chunk=4)
    single = ar.UniformStream([7], (5, 3), r, chunk=4)
    for _ in range(6):
        a, b = ens.next(), single.next()
        assert torch.equal(a[1], b[0])
    state = ens.state_dict()
    nxt = [ens.next().clone() for _ in range(5)]
    again = ar.UniformStream([4, 7, 9], (5, 3), r, chunk=4)
    again.load_state_dict(state)
    assert all(torch.equal(again.next(), x) for x in nxt)


def test_stream_values_in_range_and_union():
    x = ar.UniformStream([0], (20000,), ar.parse_range([-6, -2, 2, 6])).next()
    assert ((x.abs() >= 2) & (x.abs() <= 6)).all()
    assert 0.45 < (x > 0).float().mean() < 0.55
    y = ar.UniformStream([0], (20000,), ar.parse_range([0.1, 0.2])).next()
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
