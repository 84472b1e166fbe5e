"""How width slices share a layer: coverage, adjacent overlap and holder churn of the participants' selections.

Pure measures on selections (``{group: LongTensor of global unit indices}``, :mod:`fedfuse.fusion.slicing`) and
the groups' sizes; MSfusion reports them every round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fedfuse.fusion.slicing import Selection, overlap_fraction


def coverage(sels: Sequence[Selection], groups: Mapping[str, int]) -> float:
    """The fraction of a group's units some participant holds, averaged over the groups (1 without groups)."""
    cover = []
    for g, k in groups.items():
        held = torch.zeros(k, dtype=torch.bool)
        for sel in sels:
            held[sel[g]] = True
        cover.append(float(held.float().mean()))
    return float(np.mean(cover)) if cover else 1.0


def adjacent_overlap(sels: Sequence[Selection], groups: Mapping[str, int]) -> float:
    """|sel_i ∩ sel_{i+1}| / |sel_i| around the ring of participants (in the given order), averaged over every
    group and participant (0 for fewer than two participants)."""
    n = len(sels)
    adj = [overlap_fraction(sels[i][g], sels[(i + 1) % n][g]) for g in groups for i in range(n) if n > 1]
    return float(np.mean(adj)) if adj else 0.0


def holder_churn(now: Sequence[Selection], before: Sequence[Selection], groups: Mapping[str, int]) -> float:
    """The fraction of a group's units whose set of holders differs between two rounds' selections (participant
    ``i`` is ``now[i]`` and ``before[i]``), averaged over the groups (0 without groups)."""
    fracs = []
    for g, k in groups.items():
        held_now = torch.zeros(len(now), k, dtype=torch.bool)
        held_before = torch.zeros_like(held_now)
        for i in range(len(now)):
            held_now[i, now[i][g]] = True
            held_before[i, before[i][g]] = True
        fracs.append(float((held_now != held_before).any(dim=0).double().mean()))
    return float(np.mean(fracs)) if fracs else 0.0
