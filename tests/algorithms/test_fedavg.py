"""FedAvg: one round equals the hand-composed size-weighted average of the clients' trained models."""

import torch

from fedfuse.algorithms.base import RoundInfo
from fedfuse.engine.client import train_local
from fedfuse.engine.loop import Experiment
from fedfuse.fusion.average import weighted_average
from fedfuse.rng import derive_seed, numpy_rng, torch_generator
from fedfuse.runner import experiment
from support import small_cfg


def _manual_fedavg_round(exp: Experiment, r: int, init: dict) -> dict:
    clients = exp.algo.select_clients(RoundInfo(r, exp.cfg.rounds), numpy_rng(exp.cfg.seed, "select", r))
    states, weights = [], []
    for c in clients:
        torch.manual_seed(derive_seed(exp.cfg.seed, "fit", r, 0, c, "torch"))
        gen = torch_generator(exp.cfg.seed, "fit", r, 0, c)
        model = exp.ctx.build()
        model.load_state_dict(init)
        data = exp.fed.clients[c]
        train_local(model, data.train, exp.ctx.train, gen)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        weights.append(float(len(data.train)))
    return weighted_average(states, weights)


def test_fedavg_round_equals_hand_composed_average(tmp_path):
    cfg = small_cfg(tmp_path, rounds=1, out=None)
    exp = experiment(cfg)
    exp.state = exp.algo.init_state()
    init = {k: v.clone() for k, v in exp.state["global"].items()}
    exp.client_states = {c: None for c in range(exp.fed.num_clients)}
    exp._round(0)
    expected = _manual_fedavg_round(exp, 0, init)
    for k in expected:
        torch.testing.assert_close(exp.state["global"][k], expected[k], rtol=0, atol=0)
