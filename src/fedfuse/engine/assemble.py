"""How a run is built from its configuration: the federation, the run context and the algorithm, exactly as
every engine builds them (the in-process round loop, and a Flower node rebuilding the run from the config it is
sent)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from fedfuse.config import ConfigError, RunConfig
from fedfuse.engine.context import RunContext
from fedfuse.engine.contract import Algorithm
from fedfuse.engine.federated_eval import check_server_data
from fedfuse.errors import UserError
from fedfuse.privacy.dp import DPSettings
from fedfuse.types import Federation


def build_federation(cfg: RunConfig, device: torch.device | str = "cpu") -> Federation:
    """Load the dataset, partition it, and give every client its train/val/test splits."""
    from fedfuse.data.datasets import load_dataset
    from fedfuse.data.federation import build_federation as _build
    from fedfuse.data.partition import make_partition

    ds = load_dataset(cfg.dataset, cfg.data_dir, **cfg.dataset_options)
    part = make_partition(cfg.partition, ds, cfg.clients, cfg.seed, **cfg.partition_options)
    return _build(ds, part, seed=cfg.seed, val_fraction=cfg.val_fraction, device=device)


def build_context(cfg: RunConfig, fed: Federation, device: torch.device) -> RunContext:
    """The run context of ``cfg`` on ``fed``: its training section as the clients' local training, its DP
    options as the run's :class:`~fedfuse.privacy.dp.DPSettings`."""
    return RunContext(
        model_name=cfg.model,
        model_options=dict(cfg.model_options),
        input_shape=tuple(fed.input_shape),
        num_classes=fed.num_classes,
        task=fed.task,
        train=cfg.training,
        num_clients=fed.num_clients,
        clients_per_round=cfg.clients_per_round,
        client_sizes=fed.client_sizes(),
        seed=cfg.seed,
        device=device,
        eval_batch_size=cfg.eval_batch_size,
        eval_every=cfg.eval_every,
        dp=DPSettings(**dataclasses.asdict(cfg.privacy.dp)),
        secagg=bool(cfg.secagg),
    )


def build_algorithm(cfg: RunConfig, ctx: RunContext, algorithm: type) -> Algorithm:
    """An instance of the algorithm class ``algorithm`` with the options of ``cfg`` (the engine never imports
    ``fedfuse.algorithms``: the caller hands it the class, e.g. ``fedfuse.algorithms.get_algorithm(name)``).

    The algorithm is constructed and initialised once as a dry run (algorithms inspect the model's structure
    there).  An option or model it cannot work with is a user error it raises (:class:`~fedfuse.errors.UserError`),
    reported as a :class:`ConfigError` naming the algorithm and the model; any other exception is a bug and
    propagates as it is."""
    cls: Any = algorithm
    try:
        algo = cls(ctx, cls.Options(**cfg.algorithm_options))
        with torch.random.fork_rng(devices=[]):
            algo.init_state()
    except UserError as e:
        raise ConfigError(f"algorithm {cfg.algorithm!r} (model {cfg.model!r}): {e}") from e
    return algo


def assemble(cfg: RunConfig, device: torch.device, algorithm: type, *,
             fed: Federation | None = None) -> tuple[Federation, RunContext, Algorithm]:
    """The federation, run context and algorithm of a validated config, exactly as every engine builds them
    (the in-process loop, and a Flower node rebuilding the run from the config it is sent)."""
    if fed is not None and fed.source is not None:  # another run's prepared federation: start from its data
        fed = fed.source
    fed = fed if fed is not None else build_federation(cfg, device)
    ctx = build_context(cfg, fed, device)
    algo = build_algorithm(cfg, ctx, algorithm)
    check_server_data(cfg, fed, algo)  # a federation without data (a deployed server): what it cannot run
    blinded = fed.blinded()
    prepared = algo.setup(blinded)  # an algorithm may hold data aside for the server (Fed-ET's public set)
    if prepared is not blinded:
        fed = dataclasses.replace(prepared.with_truth_of(fed), source=fed)  # it never saw the ground truth
        ctx.client_sizes = fed.client_sizes()
    return fed, ctx, algo
