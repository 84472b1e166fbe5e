"""A plain Flower app for benchmarks/peers.py, written as Flower's PyTorch tutorials write one (flwr 1.4x).

``app`` is the ``ClientApp``: ``@app.train()`` loads the global model from the message's ``ArrayRecord``, trains
it with a plain torch loop on the node's partition and replies with the new ``ArrayRecord`` and a
``MetricRecord`` holding ``num-examples``.  :func:`make_server_app` is the ``ServerApp``: ``FedAvg.start`` from
``flwr.serverapp.strategy``.  It lives in its own module, as a tutorial's ``client_app.py``/``task.py`` do, so
Flower's Ray actors import it by reference and the node-side data cache survives between messages.

Data: the 60,000 training tensors ``peers.py`` writes to ``$PEERS_DATA`` (``torch.save((x, y))``); node
``partition-id`` c holds rows 600c .. 600c+599.
"""

from __future__ import annotations

import os
import time

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

N_CLIENTS, PER_CLIENT, PER_ROUND, EPOCHS, BATCH, LR = 100, 600, 10, 1, 50, 0.05


class Net(nn.Module):
    """The tutorial's ``Net``: here MLP 784-200-200-10 or the McMahan CNN ('same' padding), as in fedfuse."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind == "mlp":
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(784, 200), nn.ReLU(), nn.Linear(200, 200), nn.ReLU(),
                                      nn.Linear(200, 10))
        else:
            self.body = nn.Sequential(
                nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                nn.Flatten(), nn.Linear(64 * 7 * 7, 512), nn.ReLU(), nn.Linear(512, 10),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


_partitions: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def load_partition(partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The node's 600 images; the file is read once per process (as tutorials cache their FederatedDataset)."""
    if not _partitions:
        x, y = torch.load(os.environ["PEERS_DATA"])
        for c in range(N_CLIENTS):
            _partitions[c] = (x[c * PER_CLIENT : (c + 1) * PER_CLIENT], y[c * PER_CLIENT : (c + 1) * PER_CLIENT])
    return _partitions[partition_id]


def train_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, lr: float) -> float:
    """Plain torch SGD: shuffled mini-batches of BATCH, cross-entropy; the mean loss of the last epoch."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    total = 0.0
    for _ in range(epochs):
        total = 0.0
        perm = torch.randperm(len(x))
        for s in range(0, len(x), BATCH):
            idx = perm[s : s + BATCH]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss) * len(idx)
    return total / len(x)


app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    torch.set_num_threads(int(os.environ.get("PEERS_THREADS", "1")))
    config = msg.content["config"]
    model = Net(str(config["model"]))
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = load_partition(int(context.node_config["partition-id"]))
    loss = train_loop(model, x, y, int(config["local-epochs"]), float(config["lr"]))
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()),
                          "metrics": MetricRecord({"train_loss": loss, "num-examples": len(x)})})
    return Message(content=content, reply_to=msg)


def make_server_app(kind: str, rounds: int, stamps: list[float]) -> ServerApp:
    """FedAvg over 10 of the 100 nodes a round; ``stamps`` gets ``time.perf_counter()`` at the end of every round
    (through ``evaluate_fn``, which evaluates nothing)."""
    server = ServerApp()

    @server.main()
    def main(grid: Grid, context: Context) -> None:
        torch.manual_seed(0)
        strategy = FedAvg(fraction_train=PER_ROUND / N_CLIENTS, fraction_evaluate=0.0, min_available_nodes=N_CLIENTS)

        def stamp(server_round: int, arrays: ArrayRecord) -> None:
            if server_round > 0:
                stamps.append(time.perf_counter())

        strategy.start(grid=grid, initial_arrays=ArrayRecord(Net(kind).state_dict()), num_rounds=rounds,
                       train_config=ConfigRecord({"lr": LR, "local-epochs": EPOCHS, "model": kind}),
                       evaluate_fn=stamp)

    return server


# ------------------------------------------------------------------------------------------- deployment
server_app = ServerApp()


@server_app.main()
def deployed(grid: Grid, context: Context) -> None:
    """The same FedAvg as :func:`make_server_app`, deployed (``flwr run``): every connected node trains every
    round (run config ``nodes``, ``model``, ``rounds``); ``stamps`` (a file) gets ``ROUND WALLTIME`` at the end
    of every round, round 0 being the start."""
    rc = context.run_config
    kind, rounds, nodes, stamps = str(rc["model"]), int(rc["rounds"]), int(rc["nodes"]), str(rc["stamps"])
    torch.manual_seed(0)
    strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=nodes, min_train_nodes=nodes)

    def stamp(server_round: int, arrays: ArrayRecord) -> None:
        with open(stamps, "a") as fh:
            fh.write(f"{server_round} {time.time()}\n")

    strategy.start(grid=grid, initial_arrays=ArrayRecord(Net(kind).state_dict()), num_rounds=rounds,
                   train_config=ConfigRecord({"lr": LR, "local-epochs": EPOCHS, "model": kind}), evaluate_fn=stamp)
