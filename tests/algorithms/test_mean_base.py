"""The mean-of-deltas contract (:mod:`fedfuse.algorithms.mean_base`): privacy declarations derived from what the
server rule consumes, mechanisms that refuse where the declaration does not admit them, and algorithm modules that
hold no privacy code of their own."""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass

import pytest
import torch

from fedfuse.algorithms import ALGORITHMS
from fedfuse.algorithms.base import Algorithm
from fedfuse.algorithms.fedavg import FedAvg
from fedfuse.algorithms.mean_base import DeltaMean, MeanOfDeltas, derived_privacy, plain_client_step
from fedfuse.config import RunConfig, apply
from fedfuse.engine.context import RoundInfo
from fedfuse.engine.program import LossTerm
from fedfuse.errors import UserError
from fedfuse.runner import experiment
from fedfuse.types import Message, ServerView, Support

WEARERS = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "scaffold", "fedavg-ft", "fedsam",
           "fedasam", "moon", "ditto")


def test_every_algorithm_that_admits_central_dp_or_secagg_wears_the_shared_mechanisms() -> None:
    """No algorithm admits central DP or SecAgg by prose: each one that does declares a mean-of-deltas update in
    its own class and its entry is the derived one."""
    for name, cls in ALGORITHMS.items():
        entry = cls.privacy_for()
        if entry.central_dp.ok or entry.secagg.ok:
            assert issubclass(cls, DeltaMean) and "server_update" in vars(cls), name
            assert cls.privacy == (derived_privacy(cls),), name
    assert {n for n, c in ALGORITHMS.items() if c.privacy_for().secagg.ok} == set(WEARERS)


@pytest.mark.parametrize("name", WEARERS)
def test_the_derived_entry_follows_the_declaration_and_the_client_step(name: str) -> None:
    cls = ALGORITHMS[name]
    entry = cls.privacy_for()
    assert entry.view is ServerView.NOTHING_INDIVIDUAL and cls.server_update.releases in entry.why
    assert entry.central_dp.ok and entry.secagg.ok
    assert entry.local_dp.ok == (plain_client_step(cls) is None)
    if not entry.local_dp.ok:
        assert entry.local_dp.support is Support.NOT_BUILT


def test_scaffold_declares_its_control_variates_summed_with_weight_one() -> None:
    cls = ALGORITHMS["scaffold"]
    assert cls.server_update.unweighted == ("dc/",) and not cls.server_update.weighted("dc/fc.weight")
    assert "dc/*" in cls.privacy_for().secagg.why


def test_a_new_algorithm_that_declares_a_mean_gets_the_derived_entry() -> None:
    """Declaring the update is all a new algorithm writes; a loss term makes its client step more than plain SGD,
    so local DP is derived as not built (with the reason), and an own reason replaces the derived one."""

    class Plain(FedAvg):
        server_update = MeanOfDeltas(note="a test rule")

    class WithTerm(FedAvg):
        server_update = MeanOfDeltas()

        def loss_terms(self, payload: Message):
            return (LossTerm("t", lambda b: torch.zeros(())),), {}

    class Explained(WithTerm):
        server_update = MeanOfDeltas()
        local_dp_why = "the term reads the batch as a whole"

    assert Plain.privacy[0].local_dp.ok and "a test rule" in Plain.privacy[0].why
    assert WithTerm.privacy[0].local_dp.support is Support.NOT_BUILT
    assert "adds loss terms" in WithTerm.privacy[0].local_dp.why
    assert Explained.privacy[0].local_dp.why == "the term reads the batch as a whole"
    assert plain_client_step(Algorithm) is None


def _algo(name: str, **kw):
    cfg = apply(RunConfig(), dict(dataset="digits", partition="iid", model="mlp", clients=6, clients_per_round=3,
                                  rounds=1, seed=1, out=None, plots=False, model_options={"widths": [8]},
                                  algorithm=name, **kw))
    return experiment(cfg).algo


def test_the_mechanisms_refuse_an_algorithm_whose_entry_does_not_admit_them() -> None:
    """FedExP inherits FedAvg's hooks but declares (in prose) that its step size reads Σ p_i‖Δ_i‖²: called anyway,
    the secure sum refuses rather than run FedAvg's mean under FedExP's name."""
    fedexp = _algo("fedexp")
    with pytest.raises(UserError, match="fedexp does not admit secagg"):
        fedexp.secure_sum  # noqa: B018
    robust = _algo("fedavg", algorithm_options={"fusion": "median"})
    with pytest.raises(UserError, match=r"fusion='median' / clip_norm=0 read each client's update"):
        robust.secure_sum  # noqa: B018


def test_under_central_dp_every_round_releases_noise_through_the_mechanism() -> None:
    """No reply: the round still releases the mechanism's noise around the base (for SCAFFOLD: around (x, c))."""
    algo = _algo("scaffold", dp="central", dp_noise=1.0, dp_clip=0.5, sampling="poisson")
    state = algo.init_state()
    out = algo.aggregate_fit(state, RoundInfo(0, 1), {})
    assert out["dp"]["noise_std"] == pytest.approx(1.0 * 0.5 / 3)
    assert any(not torch.equal(out["global"][k], v) for k, v in state["global"].items())
    assert any(not torch.equal(out["c"][k], v) for k, v in state["c"].items())


@dataclass
class _Names(ast.NodeVisitor):
    found: set[str]

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self.found.add(node.attr)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        self.found.add(node.id)


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedavgm", "fedadam", "scaffold", "fedmr"])
def test_algorithm_modules_hold_no_privacy_code(name: str) -> None:
    """The mechanisms are worn, not written: these modules never read the run's DP settings or call a mechanism."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(ALGORITHMS[name])))
    names = _Names(set())
    names.visit(tree)
    forbidden = {"dp", "central_dp", "secure_sum", "train_dp_sgd", "CentralDP", "SecureSum", "noised_mean",
                 "dp_contribution", "check_local_dp"}
    assert not names.found & forbidden, names.found & forbidden


def test_robust_fusion_under_secagg_is_refused_before_the_run() -> None:
    """fusion=median reads each update, which SecAgg hides: the run is refused when it is built (a config error
    naming the option), not at its first secure round and never silently replaced by the mean."""
    from fedfuse.config import ConfigError

    with pytest.raises(ConfigError, match=r"secagg=true hands the server only the sum.*fusion='median'"):
        _algo("fedavg", secagg=True, algorithm_options={"fusion": "median"})
    with pytest.raises(ConfigError, match=r"clip_norm=0\.5"):
        _algo("fedavgm", secagg=True, algorithm_options={"clip_norm": 0.5})


def test_a_subclass_that_changes_the_rule_loses_the_inherited_entry(monkeypatch) -> None:
    """The SCAFFOLD trap: a subclass that adds to the payload or changes the plain rule without declaring its update
    would inherit an entry describing FedAvg's; it has none instead, so config and mechanisms refuse DP and SecAgg
    until it declares one.  A subclass that changes only the client step keeps the mechanisms and has local DP
    derived again from its step."""
    from fedfuse.config import ConfigError, check_privacy

    class NewRule(FedAvg):
        def fuse(self, state, info, results):
            return state

    class NewStep(FedAvg):
        def loss_terms(self, payload: Message):
            return (LossTerm("t", lambda b: torch.zeros(())),), {}

    class Unchanged(FedAvg):
        description = "only a new description"

    assert NewRule.privacy == () and NewRule.privacy_for() is None
    assert NewStep.privacy[0].central_dp.ok and NewStep.privacy[0].secagg.ok
    assert NewStep.privacy[0].local_dp.support is Support.NOT_BUILT and FedAvg.privacy_for().local_dp.ok
    assert Unchanged.privacy is FedAvg.privacy
    monkeypatch.setitem(ALGORITHMS, "new-rule", NewRule)
    with pytest.raises(ConfigError, match="'new-rule' does not admit secure aggregation"):
        check_privacy("new-rule", {}, "none", True)
    with pytest.raises(ConfigError, match="'new-rule' does not admit central DP"):
        check_privacy("new-rule", {}, "central", False)
