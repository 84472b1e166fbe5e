"""The run's differential-privacy settings and the privacy accountant (Google's ``dp-accounting`` library).

Central DP (``dp=central``, :mod:`fedfuse.fusion.privacy`): every round is one subsampled Gaussian mechanism of
noise multiplier z on the sum of clipped client updates, and the rounds compose.  The sampling decides the event:

* ``sampling=poisson`` — every client takes part independently with probability q = m/N (McMahan et al. 2018's
  sampling); neighbouring federations differ by adding or removing one client, the sum's sensitivity is C:
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, RDP or PLD accountant.
* ``sampling=uniform`` — exactly m of the N clients (fedfuse's default sampler); the federation size is public
  and neighbours *replace* one client, so the sum's sensitivity is 2C:
  ``SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z/2))`` with the RDP accountant (Wang, Balle,
  Kasiviswanathan 2019).  It costs more ε than Poisson sampling at the same z.

Adaptive clipping adds the centred clipped-count query; its noise is split off z so that the round's two releases
are jointly one Gaussian mechanism of multiplier z (:mod:`fedfuse.fusion.privacy`), so the event is the same.

ε is reported at ``dp_delta`` after every round (``dp_epsilon`` in ``metrics.jsonl`` and the summary).  The run
keeps one event per round (:func:`round_event`, plain Python values stored in the checkpoint) and composes them
(:func:`events_epsilon`): a resumed run adds to the rounds it has already spent, it never recomputes them from
today's settings.  The values come from the library; nothing here computes a bound by hand.

A guarantee holds only if nobody can regenerate the noise or the sampling: both come from the OS's secure source
unless the run opts into the research mode ``dp_reproducible`` (seeded: no guarantee, and the outputs say so).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

ACCOUNTANTS = ("rdp", "pld")
DP_SAMPLINGS = ("poisson", "uniform")


@dataclass(frozen=True)
class DPSettings:
    """The run's DP options (``dp_*`` keys of the run configuration)."""

    mode: str = "none"  # none | central | local
    noise: float = 1.0  # noise multiplier z
    clip: float = 1.0  # C (the initial clip under adaptive clipping; per-sample for local DP)
    quantile: float = 0.0  # adaptive clipping target γ (0 = fixed clip)
    clip_lr: float = 0.2  # η_C
    count_noise: float = 0.0  # σ_b of the clipped-count query; 0 = m/20 (Andrew et al.)
    delta: float = 1e-5
    accountant: str = "rdp"
    reproducible: bool = False  # research mode: noise and sampling from the run seed (no guarantee)
    debug_metrics: bool = False  # publish per-client metrics DP withholds (no guarantee)

    @property
    def central(self) -> bool:
        return self.mode == "central"

    @property
    def local(self) -> bool:
        return self.mode == "local"

    @property
    def guarantee(self) -> bool:
        """Whether the run may claim its (ε, δ): DP is on with noise, its randomness cannot be regenerated from the
        run seed and nothing un-noised about individual clients is published."""
        return self.mode != "none" and self.noise > 0 and not self.reproducible and not self.debug_metrics

    def count_std(self, per_round: int) -> float:
        """σ_b: the configured ``count_noise``, or m/20 (Andrew et al. 2021's recommendation)."""
        return self.count_noise if self.count_noise > 0 else per_round / 20.0


def central_event(noise: float, num_clients: int, per_round: int, sampling: str, rounds: int):  # -> DpEvent
    """The ``dp_accounting`` event of ``rounds`` rounds of DP-FedAvg (see the module docstring)."""
    import dp_accounting

    if sampling == "poisson":
        one = dp_accounting.PoissonSampledDpEvent(min(per_round / num_clients, 1.0),
                                                  dp_accounting.GaussianDpEvent(noise))
    elif sampling == "uniform":
        one = dp_accounting.SampledWithoutReplacementDpEvent(num_clients, min(per_round, num_clients),
                                                             dp_accounting.GaussianDpEvent(noise / 2))
    else:
        raise ValueError(f"central DP needs sampling poisson or uniform, not {sampling!r}")
    return dp_accounting.SelfComposedDpEvent(one, rounds)


def _accountant(sampling: str, accountant: str):  # -> PrivacyAccountant
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    relation = (dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE if sampling == "poisson"
                else dp_accounting.NeighboringRelation.REPLACE_ONE)
    if accountant == "rdp":
        return rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    if accountant == "pld":
        if sampling != "poisson":
            raise ValueError("the PLD accountant covers Poisson sampling only; use sampling=poisson or "
                             "dp_accountant=rdp")
        return pld_privacy_accountant.PLDAccountant(neighboring_relation=relation)
    raise ValueError(f"dp_accountant={accountant!r}; choose one of {', '.join(ACCOUNTANTS)}")


@contextmanager
def _quiet_absl() -> Iterator[None]:
    """dp-accounting logs a warning for every fractional RDP order whose series it drops; the bound stays valid."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@lru_cache(maxsize=64)
def _one_round_rdp(noise: float, num_clients: int, per_round: int, sampling: str) -> tuple[Any, Any]:
    """(orders, RDP of one round) from the library's RDP accountant; r rounds compose to r times the vector."""
    acc = _accountant(sampling, "rdp")
    with _quiet_absl():
        acc.compose(central_event(noise, num_clients, per_round, sampling, 1))
    return acc._orders.copy(), acc._rdp.copy()  # the accountant's own vectors (no public getter)


@lru_cache(maxsize=4096)
def central_epsilon(noise: float, num_clients: int, per_round: int, sampling: str, rounds: int, delta: float,
                    accountant: str = "rdp") -> float:
    """ε at ``delta`` after ``rounds`` rounds of DP-FedAvg with noise multiplier ``noise`` (``inf`` without noise).

    RDP: the library's RDP of one round, scaled by ``rounds`` and converted with its ``compute_epsilon`` (what its
    accountant does for a self-composed event, without recomputing the RDP every round).  PLD: the library's PLD
    accountant composed ``rounds`` times."""
    if rounds <= 0:
        return 0.0
    if noise <= 0:
        return math.inf
    if accountant == "rdp":
        from dp_accounting.rdp import rdp_privacy_accountant

        orders, rdp = _one_round_rdp(noise, num_clients, per_round, sampling)
        return float(rdp_privacy_accountant.compute_epsilon(orders, rounds * rdp, delta)[0])
    acc = _accountant(sampling, accountant)
    acc.compose(central_event(noise, num_clients, per_round, sampling, rounds))
    return float(acc.get_epsilon(delta))


def round_event(noise: float, num_clients: int, per_round: int, sampling: str, accountant: str) -> dict[str, Any]:
    """One round of central DP as the checkpoint stores it: plain Python values only (it loads with
    ``torch.load(weights_only=True)``).  ``q`` is the Poisson inclusion probability (m/N) or, for ``uniform``, the
    fraction m/N of a fixed-size sample."""
    return {"q": min(per_round / num_clients, 1.0), "noise": float(noise), "num_clients": int(num_clients),
            "per_round": int(per_round), "sampling": str(sampling), "accountant": str(accountant)}


def events_epsilon(events: Sequence[Mapping[str, Any]], delta: float) -> float:
    """ε at ``delta`` of the composition of the stored rounds (:func:`round_event`), from dp-accounting: identical
    rounds are self-composed; different ones add their RDP (or compose in one PLD accountant).  Rounds of different
    neighbouring relations (Poisson and fixed-size sampling) or accountants do not compose: ValueError."""
    if not events:
        return 0.0
    groups = Counter((float(e["noise"]), int(e["num_clients"]), int(e["per_round"]), str(e["sampling"]),
                      str(e["accountant"])) for e in events)
    kinds = {(g[3] == "poisson", g[4]) for g in groups}
    if len(kinds) > 1:
        raise ValueError(f"the run's DP rounds mix samplings or accountants ({sorted(kinds)}); they do not compose")
    if any(g[0] <= 0 for g in groups):
        return math.inf
    if len(groups) == 1:
        (noise, n, m, sampling, accountant), rounds = next(iter(groups.items()))
        return central_epsilon(noise, n, m, sampling, rounds, delta, accountant)
    sampling, accountant = next(iter(groups))[3], next(iter(groups))[4]
    if accountant == "rdp":
        from dp_accounting.rdp import rdp_privacy_accountant

        total, orders = None, None
        for (noise, n, m, s, _), rounds in groups.items():
            orders, rdp = _one_round_rdp(noise, n, m, s)
            total = rounds * rdp if total is None else total + rounds * rdp
        return float(rdp_privacy_accountant.compute_epsilon(orders, total, delta)[0])
    acc = _accountant(sampling, accountant)
    for (noise, n, m, s, _), rounds in groups.items():
        acc.compose(central_event(noise, n, m, s, rounds))
    return float(acc.get_epsilon(delta))


def noise_for_epsilon(epsilon: float, num_clients: int, per_round: int, sampling: str, rounds: int, delta: float,
                      accountant: str = "rdp") -> float:
    """The smallest noise multiplier whose ε after ``rounds`` rounds is at most ``epsilon`` (bisection over
    :func:`central_epsilon`, to 1e-3 relative)."""
    lo, hi = 1e-2, 1.0
    while central_epsilon(hi, num_clients, per_round, sampling, rounds, delta, accountant) > epsilon:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError(f"no noise multiplier reaches ε={epsilon} in {rounds} rounds")
    while hi - lo > 1e-3 * hi:
        mid = round((lo + hi) / 2, 6)
        if central_epsilon(mid, num_clients, per_round, sampling, rounds, delta, accountant) > epsilon:
            lo = mid
        else:
            hi = mid
    return hi
