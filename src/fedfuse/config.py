"""Run configuration: one flat dataclass plus four option namespaces, validated with helpful errors.

Resolution order: defaults → ``--config FILE.yaml`` → explicit CLI flags → ``--set key=value``.
``--set`` accepts a top-level field (``rounds=50``), a namespaced option (``algorithm_options.mu=0.1``), an
option of one algorithm (``fedprox.mu=0.1``: applies when that is the run's algorithm) or a bare option name
that belongs to exactly one namespace (``mu=0.1``).  In a sweep over several algorithms (``compare``) a bare or
``algorithm_options.`` option applies to every algorithm that has it (:meth:`fedfuse.sweep.Sweep.plan`).
Registry names (algorithm, dataset, partition, model) are matched ignoring case when one name matches; every
unknown name is reported with the closest known names (:mod:`fedfuse.names`).

Beside it, in the same layer: :mod:`fedfuse.coerce` (a value converted to its declared type),
:mod:`fedfuse.configfile` (a config as a YAML file) and :mod:`fedfuse.rundir` (run directories and resume).
``load_yaml``, ``dump_yaml``, ``parse_value`` and ``parse_threads`` are importable from here too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedfuse.coerce import coerce, coerce_option, parse_threads, plain
from fedfuse.coerce import parse_value as parse_value
from fedfuse.configfile import config_file
from fedfuse.configfile import dump_yaml as dump_yaml
from fedfuse.configfile import load_yaml as load_yaml
from fedfuse.errors import ConfigError, UnknownKeyError, UserError
from fedfuse.extras import require_extra
from fedfuse.options import check_value, opt
from fedfuse.sections import FaultSettings, PrivacySettings, RuntimeSettings, TrainConfig
from fedfuse.sections import faults as _faults
from fedfuse.sections import privacy as _privacy
from fedfuse.sections import runtime as _runtime
from fedfuse.sections import training as _training

NAMESPACES = ("algorithm_options", "model_options", "partition_options", "dataset_options")


# The command-line flag of each common key: flag → (config key, type, help).  Flags default to None so only what
# the user typed overrides the config file; ``fedfuse show config`` reads the help of keys declared without one.
FLAGS: dict[str, tuple[str, type, str]] = {
    "--algorithm": ("algorithm", str, "algorithm to run (fedfuse list algorithms; fedfuse show NAME for its options)"),
    "--dataset": ("dataset", str, "dataset name (fedfuse list datasets)"),
    "--partition": ("partition", str, "how the training data is split over clients (fedfuse list partitions)"),
    "--model": ("model", str, "model name, or auto for the dataset's default model (fedfuse list models)"),
    "--clients": ("clients", int, "number of clients"),
    "--clients-per-round": ("clients_per_round", int, "clients sampled for training each round"),
    "--rounds": ("rounds", int, "communication rounds"),
    "--local-epochs": ("local_epochs", int, "local epochs per round on each selected client"),
    "--batch-size": ("batch_size", int, "local mini-batch size"),
    "--lr": ("lr", float, "client learning rate"),
    "--momentum": ("momentum", float, "client SGD momentum"),
    "--weight-decay": ("weight_decay", float, "client L2 weight decay"),
    "--optimizer": ("optimizer", str, "client optimizer: sgd or adam"),
    "--seed": ("seed", int, "seed of everything random: partition, initialisation, sampling, batches"),
    "--data-dir": ("data_dir", str, "directory holding the dataset files (default: $FEDFUSE_DATA)"),
    "--out": ("out", str, "output directory (default: runs/<algorithm or compare>-<dataset>-<time>)"),
    "--device": ("device", str, "auto, cpu, cuda or cuda:N"),
    "--eval-every": ("eval_every", int, "evaluate every N rounds (the last round is always evaluated)"),
    "--threads": ("threads", str, "torch intra-op threads: auto, 0 (PyTorch's default) or a count"),
    "--precision": ("precision", str, "training precision: fp32, bf16 or auto"),
    "--memory-format": ("memory_format", str, "layout of conv models in training: auto, contiguous, channels_last"),
    "--executor": ("executor", str, "where client work runs: sequential, batched, stacked, processes or auto"),
}


#: where the full list of names of each registry is shown
LISTINGS = {"algorithm": "fedfuse list algorithms", "dataset": "fedfuse list datasets",
            "partition": "fedfuse list partitions", "model": "fedfuse list models"}


MAX_LR = 100.0  # a client learning rate above this is certainly a typo (SGD and Adam both diverge at once)
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a signed 64-bit seed
CORRUPTIONS = ("none", "nan", "inf", "shape", "scale", "count", "drop")
DP_MODES = ("none", "central", "local")
GLOBAL_EVALS = ("server", "federated", "none")


@dataclass
class RunConfig:
    """Every setting of one run.  Each field's help, choices and range are declared once (:func:`opt`)."""

    algorithm: str = opt("fedavg", "algorithm (fedfuse list algorithms)")
    dataset: str = opt("digits", "dataset (fedfuse list datasets)")
    partition: str = opt("dirichlet", "how the training samples are split among clients")
    model: str = opt("auto", "model; auto = the dataset's default model")
    clients: int = opt(10, "number of clients", ge=1)
    clients_per_round: int = opt(5, "clients sampled per round", ge=1)
    rounds: int = opt(20, "communication rounds", ge=1)
    local_epochs: int = opt(2, "local epochs per round", ge=1)
    batch_size: int = opt(32, "local mini-batch size", ge=1)
    lr: float = opt(0.1, "client learning rate", gt=0.0, le=MAX_LR)
    momentum: float = opt(0.0, "client SGD momentum", ge=0.0, lt=1.0)
    weight_decay: float = opt(0.0, "client L2 weight decay", ge=0.0)
    optimizer: str = opt("sgd", "client optimiser", choices=("sgd", "adam"))
    grad_clip: float = opt(0.0, "clip each local gradient to this L2 norm (0 = off)", ge=0.0)
    seed: int = opt(0, "seed of every random stream of the run", ge=0, le=MAX_SEED)
    data_dir: str | None = opt(None, "data directory (default: $FEDFUSE_DATA)")
    out: str | None = opt(None, "run directory")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N or mps")
    executor: str = opt("sequential", "how clients run: sequential | batched | stacked | processes | auto | flower "
                                      "(engine/executors.py)")
    precision: str = opt("fp32", "training precision: fp32, bf16 (autocast for the local forward/backward; fp32 "
                                 "weights, optimiser and server), or auto = bf16 where the hardware has native "
                                 "bf16 (docs/engine.md)", choices=("fp32", "bf16", "auto"))
    memory_format: str = opt("auto", "layout of 4-D tensors in training: auto = channels-last for the convolutional "
                                     "models measured faster that way (docs/engine.md), contiguous (NCHW) or "
                                     "channels_last (NHWC)", choices=("auto", "contiguous", "channels_last"))
    fp32_matmul: str = opt("ieee", "fp32 matrix products on a CPU: ieee = the default BLAS (MKL) in full fp32; bf16 = "
                                   "oneDNN's AVX-512 kernels with bf16 internal arithmetic "
                                   "(torch.backends.mkldnn.matmul.fp32_precision; faster, slightly less exact: "
                                   "docs/engine.md)", choices=("ieee", "bf16"))
    threads: str = opt("auto", "torch intra-op threads: auto = $FEDFUSE_THREADS if set, else min(physical cores, "
                               "cores the load average leaves idle), 1 on a busy machine; 0 = PyTorch's default; or a "
                               "count (fix it for bit-identical re-runs)")
    val_fraction: float = opt(0.1, "fraction of each client's samples held out for validation", ge=0.0, lt=1.0)
    eval_every: int = opt(1, "evaluate every this many rounds (and at the last)", ge=1)
    checkpoint_every: int = opt(1, "checkpoint every this many rounds (and at the last)", ge=1)
    eval_batch_size: int = opt(512, "batch size of evaluation", ge=1)
    global_eval: str = opt("server", "where the global model is evaluated: server = on the global test set, which "
                                     "the server holds; federated = on every client's own test split, reported as "
                                     "the size-weighted mean of the clients' results (a server without data: a "
                                     "Flower deployment, docs/deploy.md); none = not evaluated",
                           choices=GLOBAL_EVALS)
    plots: bool = opt(True, "write PNG plots into the run directory")
    sampling: str = opt("auto", "client sampling policy (fedfuse.engine.sampling): auto = the algorithm's default")
    # ---- faults and reliability (docs/reliability.md) -----------------------------------------------
    dropout: float = opt(0.0, "probability that a sampled client fails to reply in a round", ge=0.0, lt=1.0)
    stragglers: float = opt(0.0, "probability that a sampled client is slow in a round", ge=0.0, le=1.0)
    deadline: float = opt(2.0, "round deadline in units of a normal client's time; slower stragglers miss "
                               "the round (1 = every straggler misses it)", ge=1.0)
    late_replies: str = opt("drop", "a straggler's reply after the deadline: drop it, or deliver it with the next "
                                    "round (next-round; algorithms that accept stale replies: the FedAvg family)",
                            choices=("drop", "next-round"))
    quorum: int = opt(1, "fewest replies a round stage needs; with fewer the round is skipped", ge=1)
    check_updates: bool = opt(True, "check every client update before fusion and quarantine bad ones")
    norm_bound: float = opt(100.0, "quarantine an update whose norm exceeds this multiple of the round's "
                                  "median norm (0 = off; needs >= 3 replies)", ge=0.0)
    norm_max: float = opt(100.0, "quarantine an update whose L2 norm exceeds this absolute bound in a round with "
                                  "fewer than 3 replies, where norm_bound has no median (0 = off); under secagg "
                                  "every honest client checks its own update against it", ge=0.0)
    on_divergence: str = opt("stop", "non-finite loss or model: stop (keep the last good checkpoint) or "
                                     "rollback (redo the round with half the lr)", choices=("stop", "rollback"))
    corrupt: str = opt("none", "simulate faulty clients: their replies become nan, inf, wrong-shaped (shape), "
                               "1000x the update (scale), claim 1e12 examples (count), or are lost (drop)",
                       choices=CORRUPTIONS)
    corrupt_clients: list[int] = opt([], "client ids whose replies are corrupted (see corrupt)")
    # ---- privacy (docs/privacy.md; each algorithm declares which mechanisms it admits) ----------------------
    dp: str = opt("none", "differential privacy: none | central (DP-FedAvg: clipped client updates, Gaussian noise "
                          "on the server's mean) | local (DP-SGD on every client, Opacus)", choices=DP_MODES)
    dp_noise: float = opt(1.0, "DP noise multiplier z: Gaussian std z·C on the sum of clipped updates (central) or "
                               "of a batch's clipped per-sample gradients (local)", ge=0.0)
    dp_clip: float = opt(1.0, "DP clipping norm C of every client update (central; the initial clip when "
                              "adaptive) or of every per-sample gradient (local)", gt=0.0)
    dp_quantile: float = opt(0.0, "central DP adaptive clipping (Andrew et al. 2021): target quantile γ of the "
                                  "update norms (0 = fixed clip dp_clip)", ge=0.0, lt=1.0)
    dp_clip_lr: float = opt(0.2, "adaptive clipping: geometric learning rate η_C of the clip", gt=0.0)
    dp_count_noise: float = opt(0.0, "adaptive clipping: std σ_b of the noise on the unclipped-count query "
                                     "(0 = clients_per_round/20, Andrew et al.)", ge=0.0)
    dp_delta: float = opt(1e-5, "δ at which ε is reported", gt=0.0, lt=1.0)
    dp_accountant: str = opt("rdp", "privacy accountant of dp-accounting: rdp or pld (pld: sampling=poisson)",
                             choices=("rdp", "pld"))
    dp_reproducible: bool = opt(False, "research mode: central DP noise and client sampling drawn from the run seed, "
                                       "so a DP run repeats bit for bit; anyone holding the seed (config.yaml, "
                                       "records) can remove the noise: NO privacy guarantee (the outputs say so)")
    dp_debug_metrics: bool = opt(False, "central DP: publish the per-client metrics it withholds (participant ids "
                                        "and counts, clipped count, training loss): NO privacy guarantee")
    secagg: bool = opt(False, "secure aggregation (SecAgg/SecAgg+ simulated in-process; Flower's SecAgg+ on "
                              "Flower): the server receives "
                              "only masked vectors and learns only their sum")
    secagg_threshold: float = opt(0.5, "SecAgg: fraction of a client's shareholders (itself and its neighbours) "
                                       "whose shares rebuild its secrets; t = floor(fraction*holders)+1 "
                                       "(at least 0.5: t > holders/2)",
                                  gt=0.0, lt=1.0)
    secagg_min_clients: int = opt(3, "SecAgg: fewest contributions a secure sum may hold; a round with fewer "
                                     "survivors aborts (counted as skipped)", ge=3)
    secagg_max_weight: int = opt(0, "SecAgg: cap of the example count a client weights its contribution by "
                                    "(0 = its training size as the federation knows it, the only bound)", ge=0)
    secagg_neighbors: int = opt(0, "SecAgg+: degree k of the random Harary graph of pairwise masks and shares "
                                   "(0 = every pair: SecAgg)", ge=0)
    secagg_frac_bits: int = opt(24, "SecAgg: fixed-point fraction bits of the quantisation into Z_2^62 "
                                    "(step 2^-bits)", ge=8, le=40)
    algorithm_options: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] = field(default_factory=dict)
    partition_options: dict[str, Any] = field(default_factory=dict)
    dataset_options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- the sections the engine consumes (fedfuse.sections); the flat keys stay the user's interface --------
    @property
    def training(self) -> TrainConfig:
        """The local optimisation of a client step."""
        return _training(self)

    @property
    def faults(self) -> FaultSettings:
        """Injected faults and the server's defences against bad replies."""
        return _faults(self)

    @property
    def privacy(self) -> PrivacySettings:
        """Differential privacy and secure aggregation."""
        return _privacy(self)

    @property
    def runtime(self) -> RuntimeSettings:
        """Device, executor, precision and threads."""
        return _runtime(self)


CHOICES: dict[str, tuple[str, ...]] = {
    "optimizer": ("sgd", "adam"),
    "executor": ("sequential", "batched", "stacked", "processes", "auto", "flower"),
    "sampling": ("auto", "uniform", "size-weighted", "clustered", "clustered-size", "poisson"),
}


def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(RunConfig)


#: Where the configuration layer reads the algorithm registry from (dependency inversion: this module sits below
#: the engine, which sits below the algorithms, so it never imports an algorithm).  The package root installs a
#: lazy source when ``fedfuse`` is imported; ``fedfuse.algorithms`` registers itself directly when imported.
_ALGORITHM_SOURCE: Callable[[], Mapping[str, Any]] | None = None


def register_algorithm_source(source: Callable[[], Mapping[str, Any]]) -> None:
    """Let ``validate`` read algorithm names, Options and capabilities from ``source()`` (name → class)."""
    global _ALGORITHM_SOURCE
    _ALGORITHM_SOURCE = source


def registered_algorithms() -> Mapping[str, Any]:
    """The registered algorithm classes by name (see :func:`register_algorithm_source`)."""
    if _ALGORITHM_SOURCE is None:
        raise ConfigError("no algorithm registry: call fedfuse.config.register_algorithm_source (importing "
                          "fedfuse does it)")
    return _ALGORITHM_SOURCE()


def _registry_choices(key: str) -> tuple[str, ...]:
    if key == "algorithm":
        return tuple(sorted(registered_algorithms()))
    if key == "dataset":
        from fedfuse.data.datasets import DATASETS

        return tuple(sorted(DATASETS))
    if key == "partition":
        from fedfuse.data.partition import PARTITIONS

        return tuple(sorted(PARTITIONS))
    if key == "model":
        from fedfuse.models import MODELS

        return ("auto", *sorted(MODELS))
    return CHOICES.get(key, ())


def _is_hf(key: str, value: Any) -> bool:
    """``dataset: hf:PATH`` names a local Hugging Face dataset (fedfuse.data.flower_datasets), not a registry entry."""
    return key == "dataset" and isinstance(value, str) and value.startswith("hf:")


def namespace_defaults(cfg: RunConfig, namespace: str) -> dict[str, Any]:
    """Valid option names (with defaults) of the chosen algorithm/model/partition/dataset."""
    what = namespace.replace("_options", "")
    if what in ("algorithm", "dataset", "partition", "model"):
        _check_choice(what, getattr(cfg, what))
    if namespace == "algorithm_options":
        return registered_algorithms()[cfg.algorithm].option_defaults()
    if namespace == "model_options":
        from fedfuse.models import model_options

        return model_options(resolved_model(cfg))
    if namespace == "partition_options":
        from fedfuse.data.partition import partition_options

        return partition_options(cfg.partition)
    if namespace == "dataset_options":
        from fedfuse.data.datasets import dataset_options

        return dataset_options(cfg.dataset)
    raise ConfigError(f"unknown namespace {namespace!r}")


def canonical_name(key: str, value: Any) -> Any:
    """A registry name (algorithm, dataset, partition, model, optimizer, ...) written in another case
    (``FedProx``, ``MNIST``) as the registry spells it, when exactly one name matches; other values unchanged."""
    if not isinstance(value, str) or _is_hf(key, value):
        return value
    choices = _registry_choices(key)
    if not choices:
        return value
    from fedfuse.names import canonical

    return canonical(value, choices) or value


def _check_choice(key: str, value: Any) -> None:
    """Raise a :class:`ConfigError` with the closest names unless ``value`` is a valid ``key``."""
    choices = _registry_choices(key)
    if value in choices or _is_hf(key, value):
        return
    from fedfuse.names import unknown

    what = {"partition": "partition", "model": "model"}.get(key, key)
    msg = unknown(what, str(value), choices, listing=LISTINGS.get(key, ""))
    raise ConfigError(f"{key}: {msg}")


def resolved_model(cfg: RunConfig) -> str:
    if cfg.model != "auto":
        return cfg.model
    from fedfuse.models import default_model

    return default_model(cfg.dataset)


def _option_hints(cfg: RunConfig, ns: str) -> tuple[type | None, dict[str, Any]]:
    """The declaring dataclass of a namespace (algorithm Options) and its field types, when there is one."""
    if ns != "algorithm_options":
        return None, {}
    cls = registered_algorithms().get(cfg.algorithm)
    if cls is None or not dataclasses.is_dataclass(cls.Options):
        return None, {}
    try:
        return cls.Options, typing.get_type_hints(cls.Options)
    except Exception:  # unresolvable annotations: fall back to the defaults' types
        return cls.Options, {}


def apply(cfg: RunConfig, updates: dict[str, Any]) -> RunConfig:
    """Apply ``updates`` (top-level keys, ``ns.key`` or bare option names) with type checking."""
    types = _field_types()
    values = cfg.to_dict()
    pending: list[tuple[str, Any]] = []
    for key, value in updates.items():
        if key in types:
            if key in NAMESPACES:
                if not isinstance(value, dict):
                    raise ConfigError(f"{key}: expected a mapping of option: value, got {value!r}")
                for k, v in value.items():
                    pending.append((f"{key}.{k}", v))
                continue
            values[key] = canonical_name(key, coerce(key, value, types[key]))
        else:
            pending.append((key, value))
    cfg = RunConfig(**values)
    for key, value in pending:
        cfg = _apply_option(cfg, key, value)
    return cfg


def algorithm_prefix(key: str) -> tuple[str, str] | None:
    """``("fedprox", "mu")`` for ``fedprox.mu`` (an option of one algorithm, any case), else None."""
    if "." not in key:
        return None
    head, name = key.split(".", 1)
    if head in NAMESPACES:
        return None
    from fedfuse.names import canonical

    algo = canonical(head, registered_algorithms())
    return (algo, name) if algo else None


def _options_of(cfg: RunConfig, ns: str) -> dict[str, Any]:
    try:
        return namespace_defaults(cfg, ns)
    except ConfigError:
        return {}


def algorithms_with_option(name: str) -> list[str]:
    """The algorithms that declare an option called ``name``."""
    return sorted(a for a, cls in registered_algorithms().items() if name in cls.option_defaults())


def _unknown_option(name: str, what: str, owner: str, defaults: Mapping[str, Any]) -> str:
    """``unknown option 'muu' for algorithm 'fedprox'; did you mean mu?`` (or its few valid options)."""
    from fedfuse.names import unknown

    msg = unknown("option", name, sorted(defaults), listing=f"fedfuse show {owner}")
    return msg.replace(f"option {name!r}", f"option {name!r} for {what} {owner!r}", 1)


def _all_algorithm_options() -> list[str]:
    """Every option name any registered algorithm declares."""
    return sorted({k for cls in registered_algorithms().values() for k in cls.option_defaults()})


def few_names(names: list[str], n: int = 5) -> str:
    """The first ``n`` of ``names``, comma-separated, with ``, ...`` when there are more."""
    return f"{', '.join(names[:n])}{', ...' if len(names) > n else ''}"


def _apply_option(cfg: RunConfig, key: str, value: Any) -> RunConfig:
    """Set one option given as ``ALGO.name``, ``namespace.name`` or a bare ``name`` (see :func:`apply`)."""
    prefixed = algorithm_prefix(key)
    if prefixed is not None:
        return _apply_namespaced(cfg, "algorithm_options", _own_algorithm_option(cfg, key, *prefixed), value)
    if "." in key:
        ns, name = key.split(".", 1)
        return _apply_namespaced(cfg, ns, name, value)
    return _apply_bare(cfg, key, value)


def _own_algorithm_option(cfg: RunConfig, key: str, algo: str, name: str) -> str:
    """``name`` of ``ALGO.name`` when ``ALGO`` is the run's algorithm; otherwise how to run that option."""
    if algo != cfg.algorithm:
        raise UnknownKeyError(
            f"{key}: an option of {algo}, but this run's algorithm is {cfg.algorithm}; run it with "
            f"--algorithm {algo} --set {algo}.{name}=..., or compare both: fedfuse compare --algorithms "
            f"{cfg.algorithm},{algo} --set {algo}.{name}=...")
    return name


def _apply_namespaced(cfg: RunConfig, ns: str, name: str, value: Any) -> RunConfig:
    """Set option ``name`` of namespace ``ns`` (coerced to its declared type or its default's)."""
    from fedfuse.names import did_you_mean

    key = f"{ns}.{name}"
    if ns not in NAMESPACES:
        hint = did_you_mean(ns, [*NAMESPACES, *registered_algorithms()])
        raise UnknownKeyError(f"unknown key {key!r}: {ns!r} is neither an option namespace "
                              f"({', '.join(NAMESPACES)}) nor an algorithm" + (f"; {hint}" if hint else ""))
    defaults = namespace_defaults(cfg, ns)
    if name not in defaults:
        raise UnknownKeyError(_unknown_namespaced(cfg, ns, name, defaults))
    _, hints = _option_hints(cfg, ns)
    getattr(cfg, ns)[name] = coerce_option(key, value, defaults[name], hints.get(name))
    return cfg


def _unknown_namespaced(cfg: RunConfig, ns: str, name: str, defaults: Mapping[str, Any]) -> str:
    """The message for an option ``ns.name`` the run's algorithm/model/... lacks, with the algorithms that have
    an algorithm option of that name."""
    from fedfuse.names import did_you_mean

    what = ns.replace("_options", "")
    owner = resolved_model(cfg) if what == "model" else getattr(cfg, what)
    msg = _unknown_option(name, what, owner, defaults)
    others = algorithms_with_option(name) if ns == "algorithm_options" else []
    if others and not did_you_mean(name, defaults):
        msg += (f"; {name} is an option of {few_names(others)} "
                f"(e.g. --algorithm {others[0]} --set {others[0]}.{name}=...)")
    return msg


def _apply_bare(cfg: RunConfig, key: str, value: Any) -> RunConfig:
    """Set an option named without its namespace: the one namespace that has it."""
    owners = [ns for ns in NAMESPACES if key in _options_of(cfg, ns)]
    if len(owners) == 1:
        return _apply_namespaced(cfg, owners[0], key, value)
    if len(owners) > 1:
        raise ConfigError(f"option {key!r} is ambiguous: say one of {', '.join(f'{o}.{key}' for o in owners)}")
    raise UnknownKeyError(_unknown_key(cfg, key))


def _unknown_key(cfg: RunConfig, key: str) -> str:
    """The message for a key that is no field and no option of ``cfg``: the closest names, or the algorithms
    that have an option of that (or a close) name."""
    from fedfuse.names import closest, did_you_mean

    valid = list(_field_types())
    for ns in NAMESPACES:
        valid += list(_options_of(cfg, ns))
    hint = did_you_mean(key, valid)
    msg = f"unknown key {key!r}" + (f"; {hint}" if hint else "")
    near = [key] if algorithms_with_option(key) else [] if hint else closest(key, _all_algorithm_options(), 1, 0.75)
    if near:
        others = algorithms_with_option(near[0])
        what = f"{key} is" if near[0] == key else f"did you mean {near[0]}? It is"
        msg += (f"; {what} an option of {few_names(others)}, not of {cfg.algorithm}: e.g. --algorithm {others[0]} "
                f"--set {near[0]}=...")
    elif not hint:
        msg += f" (keys: fedfuse show config; options of {cfg.algorithm}: fedfuse show {cfg.algorithm})"
    return msg


def validate(cfg: RunConfig) -> RunConfig:
    """Check every field and option (type, range, choices, cross-field rules); return the config with ``model``
    resolved.  Raises :class:`ConfigError` naming the field, the value and what is allowed."""
    cfg = _checked_fields(cfg)
    cfg = dataclasses.replace(cfg, **{k: canonical_name(k, getattr(cfg, k)) for k in _REGISTRY_KEYS})
    for key in _REGISTRY_KEYS:
        _check_choice(key, getattr(cfg, key))
    _check_client_counts(cfg)
    check_device(cfg.device)
    try:
        cfg = dataclasses.replace(cfg, threads=str(parse_threads(cfg.threads)))
    except ValueError as e:
        raise ConfigError(f"threads: {e}") from None
    _check_late_replies(cfg)
    cfg = dataclasses.replace(cfg, model=resolved_model(cfg))
    resolved = {ns: _resolved_options(cfg, ns) for ns in NAMESPACES}
    _check_namespace_rules(cfg, resolved)
    check_privacy(cfg.algorithm, resolved["algorithm_options"], cfg.dp, cfg.secagg)
    if cfg.secagg:
        _check_secagg(cfg)
    if cfg.dp == "central":
        _check_central_dp(cfg)
    return dataclasses.replace(cfg, **resolved)


def required_extras(cfg: RunConfig) -> dict[str, str]:
    """The optional extras a run of ``cfg`` needs (:mod:`fedfuse.extras`): extra → the setting that needs it (the
    algorithm's declared ``extras``, ``dp=local``, ``--executor flower``, an ``hf:`` dataset, a ``flwr:`` partition)."""
    need: dict[str, str] = {}
    cls = registered_algorithms().get(cfg.algorithm)
    for extra in getattr(cls, "extras", ()):
        need.setdefault(extra, cfg.algorithm)
    if cfg.dp == "local":
        need.setdefault("dp", "dp=local")
    if cfg.executor == "flower":
        need.setdefault("flower", "executor 'flower'")
    if _is_hf("dataset", cfg.dataset):
        need.setdefault("flower", f"dataset {cfg.dataset}")
    if str(cfg.partition).startswith("flwr:"):
        need.setdefault("flower", f"partition {cfg.partition}")
    return need


def check_extras(*configs: RunConfig) -> None:
    """Raise :class:`fedfuse.extras.MissingExtra` (a usage error naming ``pip install 'fedfuse[EXTRA]'``) when a
    run of any of ``configs`` needs an extra that is not installed.  Imports nothing: call it before any work."""
    for cfg in configs:
        for extra, what in required_extras(cfg).items():
            require_extra(extra, what)


#: the fields naming a registry entry or a fixed choice: matched ignoring case, then checked
_REGISTRY_KEYS = ("algorithm", "dataset", "partition", "model", "optimizer", "executor", "sampling")


def _checked_fields(cfg: RunConfig) -> RunConfig:
    """Every top-level field coerced to its type and checked against its declared range and choices; every
    namespace a mapping."""
    types = _field_types()
    values = {}
    for f in dataclasses.fields(RunConfig):
        v = getattr(cfg, f.name)
        if f.name in NAMESPACES:
            if not isinstance(v, dict):
                raise ConfigError(f"{f.name}: expected a mapping of option: value, got {v!r}")
        else:
            v = _checked_field(f, coerce(f.name, v, types[f.name]))
        values[f.name] = v
    return RunConfig(**values)


def _checked_field(f: dataclasses.Field, v: Any) -> Any:
    """``v`` unless it is non-finite (``deadline`` may be inf) or outside field ``f``'s range or choices."""
    if isinstance(v, float) and not math.isfinite(v) and not (f.name == "deadline" and v == math.inf):
        raise ConfigError(f"{f.name}: must be a finite number, got {v!r}")
    problem = check_value(RunConfig, f.name, v)
    if problem:
        choices = f.metadata.get("choices")
        if choices:
            problem = f"unknown value {v!r}; choose one of: {', '.join(map(str, choices))}"
        raise ConfigError(f"{f.name}: {problem}")
    return v


def _check_client_counts(cfg: RunConfig) -> None:
    """clients_per_round, quorum and corrupt_clients within the number of clients."""
    if cfg.clients_per_round > cfg.clients:
        raise ConfigError(
            f"clients_per_round: {cfg.clients_per_round} exceeds clients ({cfg.clients}); choose 1..{cfg.clients}"
        )
    if cfg.quorum > cfg.clients:
        raise ConfigError(f"quorum: {cfg.quorum} exceeds clients ({cfg.clients}); choose 1..{cfg.clients}")
    bad = [c for c in cfg.corrupt_clients if not 0 <= c < cfg.clients]
    if bad:
        raise ConfigError(f"corrupt_clients: client id(s) {bad} out of range; choose ids in 0..{cfg.clients - 1}")
    if cfg.corrupt != "none" and not cfg.corrupt_clients:
        raise ConfigError(f"corrupt: {cfg.corrupt!r} needs corrupt_clients (e.g. --set corrupt_clients=[0])")


def _check_late_replies(cfg: RunConfig) -> None:
    """``late_replies=next-round`` only for an algorithm that accepts stale replies."""
    if cfg.late_replies != "next-round":
        return
    registry = registered_algorithms()
    if not registry[cfg.algorithm].accepts_late:
        late = sorted(n for n, c in registry.items() if c.accepts_late)
        raise ConfigError(f"late_replies: {cfg.algorithm!r} cannot fuse a reply from an earlier round; "
                          f"next-round works with {', '.join(late)}")


def _resolved_options(cfg: RunConfig, ns: str) -> dict[str, Any]:
    """Namespace ``ns`` in full: every option of the chosen algorithm/model/... at its given value (coerced and
    range-checked) or its default; an unknown given option raises :class:`UnknownKeyError`."""
    defaults = namespace_defaults(cfg, ns)
    given = getattr(cfg, ns)
    what = ns.replace("_options", "")
    for k in given:
        if k not in defaults:
            raise UnknownKeyError(_unknown_option(k, what, getattr(cfg, what), defaults))
    declared, hints = _option_hints(cfg, ns)
    merged = {}
    for k, default in defaults.items():
        v = coerce_option(f"{ns}.{k}", given[k], default, hints.get(k)) if k in given else default
        if isinstance(v, float) and not math.isfinite(v):
            raise ConfigError(f"{ns}.{k}: must be a finite number, got {v!r}")
        problem = check_value(declared, k, v) if declared is not None else None
        if problem:
            raise ConfigError(f"{ns}.{k}: {problem} ({what} {getattr(cfg, what)!r})")
        merged[k] = plain(v)
    return merged


def _check_secagg(cfg: RunConfig) -> None:
    """What simulated secure aggregation cannot be combined with."""
    if cfg.late_replies == "next-round":
        raise ConfigError("late_replies: a straggler's reply cannot join a later round's masked sum under "
                          "secagg=true (its masks belong to its own round); use late_replies=drop")
    if cfg.sampling in ("clustered",):
        raise ConfigError("sampling: clustered sampling reads every client's update, which secagg=true hides; "
                          "choose uniform, poisson, size-weighted or clustered-size")
    if cfg.secagg_threshold < 0.5:
        raise ConfigError(f"secagg_threshold: {cfg.secagg_threshold:g} gives t <= n/2 shares, so a server that "
                          "reports a client dropped to half its shareholders could rebuild both its secrets; use "
                          "a fraction in [0.5, 1)")
    if cfg.clients_per_round < cfg.secagg_min_clients:
        raise ConfigError(f"secagg_min_clients: a round samples {cfg.clients_per_round} clients, fewer than the "
                          f"{cfg.secagg_min_clients} a secure sum needs; raise clients_per_round")


def _check_central_dp(cfg: RunConfig) -> None:
    """The sampling central DP is accounted for, and the noise split of adaptive clipping."""
    if cfg.sampling not in ("auto", "uniform", "poisson"):
        raise ConfigError(f"sampling: central DP is accounted for sampling=poisson or uniform, not "
                          f"{cfg.sampling!r}")
    if cfg.dp_accountant == "pld" and cfg.sampling != "poisson":
        raise ConfigError("dp_accountant: pld covers Poisson sampling only; add --set sampling=poisson or use rdp")
    if cfg.late_replies == "next-round":
        raise ConfigError("late_replies: under dp=central a straggler's reply would join a round it was not sampled "
                          "for, which the accountant's sampling probability does not cover; use late_replies=drop")
    if cfg.quorum > 1:
        raise ConfigError(f"quorum: under dp=central every round releases the noised sum of whoever replied; skipping "
                          f"a round with fewer than quorum={cfg.quorum} replies would let one client's presence "
                          f"change the release by quorum·C, beyond the accounted sensitivity C; drop quorum")
    if cfg.dp_quantile > 0 and cfg.dp_noise > 0:
        sigma_b = cfg.dp_count_noise or cfg.clients_per_round / 20
        if 2 * sigma_b <= cfg.dp_noise:
            raise ConfigError(f"dp_count_noise: adaptive clipping splits the noise z={cfg.dp_noise:g} between the "
                              f"update and the clipped count, which needs 2σ_b > z (σ_b={sigma_b:g}); raise "
                              "dp_count_noise or clients_per_round, or lower dp_noise")


#: the run options that request each privacy mechanism of :class:`fedfuse.types.Privacy`
PRIVACY_REQUESTS = {"central_dp": ("dp=central", "central DP"), "local_dp": ("dp=local", "local DP"),
                    "secagg": ("secagg=true", "secure aggregation")}


def check_privacy(algorithm: str, options: Mapping[str, Any], dp: str, secagg: bool) -> None:
    """Raise a one-line :class:`ConfigError` when ``algorithm`` (with ``options``) does not admit a requested privacy
    mechanism, with the algorithm's declared reason and the algorithms that do admit it."""
    wanted = ([] if dp == "none" else [f"{dp}_dp"]) + (["secagg"] if secagg else [])
    if not wanted:
        return
    registry = registered_algorithms()
    entry = registry[algorithm].privacy_for(options)
    for mech in wanted:
        flag, label = PRIVACY_REQUESTS[mech]
        verdict = entry.admits(mech) if entry is not None else None
        if verdict is not None and verdict.ok:
            continue
        able = sorted(n for n, c in registry.items() if (e := c.privacy_for()) is not None and e.admits(mech).ok)
        why = f"{verdict.support.value}: {verdict.why}" if verdict is not None else "it declares no privacy entry"
        raise ConfigError(f"{flag}: {algorithm!r} does not admit {label} ({why}); "
                          f"it works with: {', '.join(able) or 'no algorithm yet'}")


def _check_namespace_rules(cfg: RunConfig, resolved: dict[str, dict[str, Any]]) -> None:
    """Partition and dataset option ranges (declared next to their code), as ConfigErrors."""
    from fedfuse.data.datasets import check_dataset_options
    from fedfuse.data.partition import check_partition_options

    for ns, check, name in (("partition_options", check_partition_options, cfg.partition),
                            ("dataset_options", check_dataset_options, cfg.dataset)):
        try:
            check(name, resolved[ns])
        except UserError as e:
            raise ConfigError(f"{ns}: {e}") from None


def check_device(name: str) -> None:
    """Raise :class:`ConfigError` unless ``name`` is a device this machine has (auto, cpu, cuda[:N], mps)."""
    import torch

    if name in ("auto", "cpu"):
        return
    if name == "cuda" or name.startswith("cuda:"):
        index = name[5:] or "0"
        if not index.isdigit():
            raise ConfigError(f"device: bad value {name!r}; use cuda or cuda:N with N a GPU index")
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {name!r} requested but CUDA is not available on this machine "
                              f"(torch {torch.__version__}); use --device cpu or auto")
        if int(index) >= torch.cuda.device_count():
            raise ConfigError(f"device: {name!r} does not exist; this machine has {torch.cuda.device_count()} "
                              f"GPU(s): cuda:0..cuda:{torch.cuda.device_count() - 1}")
        return
    if name == "mps":
        if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
            raise ConfigError("device: 'mps' requested but MPS is not available on this machine; use --device cpu")
        return
    raise ConfigError(f"device: unknown value {name!r}; choose auto, cpu, cuda, cuda:N or mps")


def resolve_device(name: str) -> Any:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ---- building a config from what a user gives ------------------------------------------------------------------
ConfigLike = RunConfig | Mapping[str, Any] | str | Path | None


def make_config(config: ConfigLike = None, /, **options: Any) -> RunConfig:
    """A validated, fully resolved :class:`RunConfig`: defaults → ``config`` (object, mapping or YAML path) →
    ``options``.  Raises :class:`ConfigError` naming a bad key or value."""
    cfg = RunConfig()
    if isinstance(config, RunConfig):
        cfg = apply(RunConfig(), config.to_dict())
    elif isinstance(config, str | Path):
        cfg = apply(cfg, config_file(config))
    elif config is not None:
        cfg = apply(cfg, dict(config))
    top = {k: v for k, v in options.items() if k in RunConfig.__dataclass_fields__}
    cfg = apply(cfg, top)
    for k, v in options.items():  # one at a time, after the algorithm/model/... are chosen
        if k not in top:
            cfg = apply(cfg, {k: v})
    return validate(cfg)


_HASH_NEUTRAL_DEFAULTS: dict[str, object] = {
    "precision": "fp32", "memory_format": "auto", "fp32_matmul": "ieee",
    "secagg_frac_bits": 24, "secagg_neighbors": 0, "secagg_threshold": 0.5,
    "secagg_min_clients": 3, "secagg_max_weight": 0, "norm_max": 100.0,
    "dp_reproducible": False, "dp_debug_metrics": False, "global_eval": "server",
}
"""Run keys added after configs were first hashed: left out of :func:`config_hash` while at these defaults (a
run that leaves them alone computes what it did before they existed), so earlier caches and result records keep
their hashes.  A new key with a behaviour-neutral default belongs here."""


def config_hash(cfg: RunConfig) -> str:
    """SHA-256 of everything in a resolved config that can change a run's metrics.

    Excluded: where outputs go and how they are produced (``out``, ``plots``, ``checkpoint_every``), where the
    data files are (``data_dir``: the same files give the same run) and ``threads``.
    """
    d = cfg.to_dict()
    for k in ("out", "plots", "checkpoint_every", "data_dir", "threads"):
        d.pop(k, None)
    for k, default in _HASH_NEUTRAL_DEFAULTS.items():  # keys added later, at their defaults: old hashes stay valid
        if k in d and d[k] == default:
            d.pop(k)
    text = json.dumps(d, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
