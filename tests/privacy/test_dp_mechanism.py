"""The mechanism central DP actually runs, checked against its analysis: the joint sensitivity of everything one
round releases (the clipped sum and adaptive clipping's centred count) is at most 1/z in units of their noise, and
the ε a run reports equals dp-accounting's ε for that mechanism, computed here from the noise the run used and the
sensitivities the client contributions have (not from fedfuse's accountant)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from fedfuse.config import RunConfig, apply
from fedfuse.fusion.privacy import (
    dp_contribution,
    joint_noise_multiplier,
    noised_mean,
    update_noise_multiplier,
    update_norm,
)
from fedfuse.runner import experiment
from fedfuse.types import Message

Z, SIGMA_B, CLIP, M = 0.8, 1.0, 0.5, 5


def _base() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(6, 5), "bn.running_mean": torch.zeros(5), "bn.num_batches_tracked": torch.tensor(3)}


def _client(norm: float, seed: int) -> dict[str, torch.Tensor]:
    """A client whose update has exactly L2 norm ``norm`` over the released entries."""
    g = torch.Generator().manual_seed(seed)
    s = {"w": torch.randn(6, 5, generator=g), "bn.running_mean": torch.randn(5, generator=g)}
    scale = norm / update_norm(s, _base()) if norm else 0.0
    return {**{k: v * scale for k, v in s.items()}, "bn.num_batches_tracked": torch.tensor(9)}


def _flat(upd: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([upd[k].double().reshape(-1) for k in sorted(upd)])


def _release(contribs: list[tuple[dict[str, torch.Tensor], float]], update_std: float,
             count_std: float) -> torch.Tensor:
    """What a round releases before noise, in units of each part's noise std: (Σ Δ̃ / σ_Δ, Σ (b − ½) / σ_b)."""
    total = sum((_flat(u) for u, _ in contribs), torch.zeros(35, dtype=torch.float64))
    count = sum(b for _, b in contribs)
    return torch.cat([total / update_std, torch.tensor([count / count_std], dtype=torch.float64)])


def _update_std(z: float, count_std: float) -> float:
    """The std of the noise on the clipped sum as the mechanism draws it (read back from ``noised_mean``)."""
    _, std_on_mean, _, _ = noised_mean(_base(), {"w": torch.zeros(6, 5)}, 0.0, clip=CLIP, noise_multiplier=z,
                                       denominator=M, gen=torch.Generator().manual_seed(0), quantile=0.5,
                                       count_std=count_std)
    return std_on_mean * M


@pytest.mark.parametrize("norms", [(0.1, 0.2, 3.0), (5.0, 5.0), (), (CLIP, 0.0, 0.49, 0.51)])
def test_one_added_client_moves_the_round_s_release_by_at_most_one_over_z(norms) -> None:
    base, sigma_d = _base(), _update_std(Z, SIGMA_B)
    assert sigma_d == pytest.approx(update_noise_multiplier(Z, SIGMA_B) * CLIP)
    data = [dp_contribution(_client(n, i), base, CLIP)[:2] for i, n in enumerate(norms)]
    before = _release(data, sigma_d, SIGMA_B)
    worst = 0.0
    for j, n in enumerate((0.0, 0.01, 0.3, CLIP, CLIP * 1.0001, 2.0, 100.0)):  # clipped and unclipped newcomers
        upd, bit, norm = dp_contribution(_client(n, 100 + j), base, CLIP)
        assert bit == (0.5 if norm <= CLIP else -0.5)  # the centred bit: ±½ whichever way
        after = _release([*data, (upd, bit)], sigma_d, SIGMA_B)
        move = float((after - before).norm())
        assert move <= 1 / Z * (1 + 1e-9), (n, move)
        worst = max(worst, move)
    assert worst == pytest.approx(1 / Z, rel=1e-9)  # a client clipped to C attains the bound
    assert joint_noise_multiplier(sigma_d / CLIP, SIGMA_B) == pytest.approx(Z)
    # the un-centred bits (sensitivity 1) this replaces would move the release by more than 1/z
    uncentred = math.hypot(1 / update_noise_multiplier(Z, SIGMA_B), 1 / SIGMA_B)
    assert uncentred > 1 / Z * 1.05


def _cfg(tmp_path, **kw) -> RunConfig:
    base = dict(dataset="digits", partition="dirichlet", model="mlp", clients=20, clients_per_round=M, rounds=3,
                batch_size=32, lr=0.05, seed=3, out=str(tmp_path / "run"), plots=False,
                model_options={"widths": [16]}, partition_options={"alpha": 0.5, "min_size": 20}, dp="central",
                dp_noise=Z, dp_clip=CLIP, sampling="poisson")
    base.update(kw)
    return apply(RunConfig(), base)


def test_the_secure_contribution_has_the_same_sensitivity(tmp_path) -> None:
    """Under SecAgg the client computes its own share of the two sums: a clipped update and b − ½."""
    exp = experiment(_cfg(tmp_path, secagg=True, dp_quantile=0.5, dp_count_noise=SIGMA_B, out=None))
    g = exp.algo.init_state()["global"]
    for scale, bit in ((1e-4, 0.5), (10.0, -0.5)):
        state = {k: v + scale * torch.ones_like(v) if v.is_floating_point() else v for k, v in g.items()}
        out = exp.algo.secure_contribution(Message(g, {"dp_clip": CLIP}), Message(state))
        assert float(out["secagg/count"].sum()) == bit
        norm = math.sqrt(sum(float((v.double() ** 2).sum()) for k, v in out.items() if k != "secagg/count"))
        assert norm <= CLIP * (1 + 1e-9)


def _independent_epsilon(sampling: str, z_eff: float, n: int, m: int, rounds: int, delta: float) -> float:
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    if sampling == "poisson":  # add/remove one client: sensitivity C and ½, noise multiplier z_eff
        one = dp_accounting.PoissonSampledDpEvent(m / n, dp_accounting.GaussianDpEvent(z_eff))
        rel = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    else:  # replace one: sensitivity 2C and 2·½, so the multiplier halves
        one = dp_accounting.SampledWithoutReplacementDpEvent(n, m, dp_accounting.GaussianDpEvent(z_eff / 2))
        rel = dp_accounting.NeighboringRelation.REPLACE_ONE
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=rel)
    acc.compose(dp_accounting.SelfComposedDpEvent(one, rounds))
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("sampling,quantile", [("poisson", 0.5), ("uniform", 0.5), ("poisson", 0.0)])
def test_the_reported_epsilon_is_dp_accounting_s_for_the_mechanism_run(tmp_path, sampling, quantile) -> None:
    exp = experiment(_cfg(tmp_path, sampling=sampling, dp_quantile=quantile, dp_count_noise=SIGMA_B))
    exp.run()
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    for r, rec in enumerate(recs, 1):
        update_multiplier = rec["dp_noise_std"] * M / rec["dp_clip_used"]  # the noise the round drew, in units of C
        z_eff = joint_noise_multiplier(update_multiplier, SIGMA_B if quantile > 0 else 0.0)
        z_eff_by_hand = (update_multiplier ** -2 + ((0.5 / SIGMA_B) ** 2 if quantile > 0 else 0.0)) ** -0.5
        assert z_eff == pytest.approx(z_eff_by_hand, rel=1e-12)
        assert rec["dp_epsilon"] == pytest.approx(_independent_epsilon(sampling, z_eff, 20, M, r, 1e-5), rel=1e-6)
        assert rec["dp_guarantee"] is True
