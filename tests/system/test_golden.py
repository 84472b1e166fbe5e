"""Golden metrics: every algorithm's final record on a tiny run, bit for bit, under every deterministic executor.

The file ``tests/golden/metrics.json`` was written before the redesign (issue: one contract, one direction) by
``python tests/golden/make_golden.py``; a refactor must reproduce it.  A change meant to move a number
regenerates the cell (``make_golden.py NAME``) and lists its before/after in the commit message.

Integers, strings and flags must match exactly; a float may differ by :data:`FLOAT_RTOL` (relative) or
:data:`FLOAT_ATOL`. The file is bit-exact on the machine that wrote it, but PyTorch and OpenBLAS pick their vector
kernels by CPU (AVX2 vs AVX-512 sum in another order): on another processor the same code moved losses by up to
~1e-7 relative (measured on an AVX-512 Xeon against a file written elsewhere). A real change to an algorithm, a
fusion rule or the round loop moves them by orders of magnitude more. Bit-identity between executors and across a
resume, on one machine, is checked exactly by tests/engine/test_executors.py and test_checkpoint.py.
"""

from __future__ import annotations

import json
import math

import pytest

from fedfuse.algorithms import ALGORITHMS
from golden.make_golden import EXECUTORS, GOLDEN, final_metrics, is_lora, lora_base

GOLD = json.loads(GOLDEN.read_text())
#: relative tolerance of a float metric (kernel choice by CPU; see the module docstring)
FLOAT_RTOL = 1e-6
#: absolute tolerance, for small differences of large terms (FedMerge-LoRA's merge_cross_term moved by 7e-9)
FLOAT_ATOL = 1e-8


def _same(want: object, got: object) -> bool:
    """Equal, or floats within :data:`FLOAT_RTOL` / :data:`FLOAT_ATOL` of each other (NaN equals NaN; ints and
    bools exactly)."""
    if isinstance(want, float) and isinstance(got, float):
        return (want != want and got != got) or math.isclose(want, got, rel_tol=FLOAT_RTOL, abs_tol=FLOAT_ATOL)
    if isinstance(want, list) and isinstance(got, list):
        return len(want) == len(got) and all(_same(a, b) for a, b in zip(want, got))
    if isinstance(want, dict) and isinstance(got, dict):
        return want.keys() == got.keys() and all(_same(want[k], got[k]) for k in want)
    return type(want) is type(got) and want == got


def test_same_compares_floats_within_the_tolerance_and_the_rest_exactly():
    assert _same(1.8056908501519098, 1.805690680609809)  # the measured cross-CPU drift
    assert not _same(1.8056908501519098, 1.8057)  # a real move
    assert _same(float("nan"), float("nan")) and not _same(0.5, float("nan"))
    assert not _same(3, 4) and not _same(1, 1.0) and not _same(True, 1)
    assert _same(0.005761956367696069, 0.005761963606499114)  # measured too
    assert _same({"a": [0.1, 2]}, {"a": [0.1 + 1e-12, 2]}) and not _same({"a": 1}, {"b": 1})
_BASE: dict[str, str] = {}


def test_every_registered_algorithm_has_a_golden_record():
    assert sorted(GOLD) == sorted(ALGORITHMS)


@pytest.mark.parametrize("algorithm", sorted(GOLD))
def test_golden_final_metrics(algorithm):
    if is_lora(algorithm):
        pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")
    base = _BASE.setdefault("base", lora_base())
    for executor in EXECUTORS:
        got = final_metrics(algorithm, executor, base)
        want = GOLD[algorithm][executor]
        diff = {k: (want.get(k), got.get(k)) for k in set(want) | set(got) if not _same(want.get(k), got.get(k))}
        assert not diff, f"{algorithm} ({executor}) moved from its golden record: {diff}"
