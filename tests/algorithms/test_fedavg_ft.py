"""FedAvg-FT: FedAvg's training and global model bit for bit; the fine-tuning changes only the personalised
evaluation."""

import torch

from fedfuse.runner import experiment
from support import small_cfg


def test_fedavg_ft_trains_as_fedavg_and_fine_tunes_only_for_evaluation(tmp_path):
    fa = experiment(small_cfg(tmp_path, out=None, algorithm="fedavg"))
    fa.run()
    ft = experiment(small_cfg(tmp_path, out=None, algorithm="fedavg-ft"), fed=fa.fed)
    ft.run()
    # same training, so the same global model; fine-tuning changes only the personalised evaluation
    for k, v in fa.state["global"].items():
        assert torch.equal(ft.state["global"][k], v), k
    assert fa.history[-1]["global_accuracy"] == ft.history[-1]["global_accuracy"]
    assert fa.history[-1]["personal_accuracy"] != ft.history[-1]["personal_accuracy"]
