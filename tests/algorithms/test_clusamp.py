"""CluSamp: FedAvg with clustered sampling and its aggregation weights."""


import numpy as np

from fedfuse.runner import experiment
from support import sampling_cfg


def test_clusamp_uses_clustered_sampling_and_its_weights(tmp_path):
    exp = experiment(sampling_cfg(tmp_path, algorithm="clusamp", rounds=2))
    assert type(exp.sampler).__name__ == "ClusteredSampler"
    seen = []
    orig = exp.algo.aggregate_fit

    def spy(state, info, results):
        seen.append({c: r.meta["sampling_weight"] for c, r in results.items()})
        return orig(state, info, results)

    exp.algo.aggregate_fit = spy
    exp.run()
    for w in seen:
        assert abs(sum(w.values()) - 1.0) < 1e-9  # Σ (times drawn)/m = 1
    # after round 1 the sampler holds gradients of the clients that took part, zeros elsewhere
    g = exp.sampler.grads
    assert g is not None
    assert (np.abs(g).sum(axis=1) > 0).sum() >= 1
