"""Golden metrics: every algorithm's final record on a tiny run, bit for bit, under every deterministic executor.

The file ``tests/golden/metrics.json`` was written before the redesign (issue: one contract, one direction) by
``python tests/golden/make_golden.py``; a refactor must reproduce it exactly.  A change meant to move a number
regenerates the cell (``make_golden.py NAME``) and lists its before/after in the commit message.
"""

from __future__ import annotations

import json

import pytest

from fedfuse.algorithms import ALGORITHMS
from golden.make_golden import EXECUTORS, GOLDEN, final_metrics, is_lora, lora_base

GOLD = json.loads(GOLDEN.read_text())
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
        diff = {k: (want.get(k), got.get(k)) for k in set(want) | set(got) if want.get(k) != got.get(k)
                and not (want.get(k) != want.get(k) and got.get(k) != got.get(k))}  # NaN == NaN here
        assert not diff, f"{algorithm} ({executor}) moved from its golden record: {diff}"
