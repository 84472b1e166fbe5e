"""Slice statistics on hand-made selections: coverage, adjacent overlap and holder churn."""

import pytest
import torch

from fedfuse.fusion.slice_stats import adjacent_overlap, coverage, holder_churn


def sel(**groups):
    return {g: torch.tensor(v, dtype=torch.long) for g, v in groups.items()}


GROUPS = {"a": 8, "b": 4}


def test_coverage_is_the_mean_over_groups_of_the_held_fraction():
    sels = [sel(a=[0, 1, 2], b=[0]), sel(a=[2, 3], b=[0, 1])]
    # a: units 0-3 of 8 held = 0.5; b: units 0-1 of 4 = 0.5
    assert coverage(sels, GROUPS) == pytest.approx(0.5)
    assert coverage(sels, {}) == 1.0


def test_adjacent_overlap_goes_around_the_ring():
    sels = [sel(a=[0, 1], b=[0, 1]), sel(a=[1, 2], b=[2, 3])]
    # a: |{0,1}∩{1,2}|/2 = 0.5 and back 0.5; b: 0 and 0  ->  mean of (0.5, 0.5, 0, 0) = 0.25
    assert adjacent_overlap(sels, GROUPS) == pytest.approx(0.25)
    assert adjacent_overlap(sels[:1], GROUPS) == 0.0


def test_holder_churn_counts_units_whose_holders_change():
    before = [sel(a=[0, 1], b=[0]), sel(a=[2, 3], b=[1])]
    now = [sel(a=[1, 2], b=[0]), sel(a=[3, 4], b=[1])]
    # a: unit 0 dropped, 1 same holder, 2 changes holder (1 -> 0), 3 same, 4 gained: 3 of 8; b: none
    assert holder_churn(now, before, GROUPS) == pytest.approx((3 / 8 + 0) / 2)
    assert holder_churn(before, before, GROUPS) == 0.0
