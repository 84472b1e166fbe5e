"""Every option an algorithm accepts acts: each registered algorithm, run with each of its declared options moved
off its default, must not reproduce its default run bit for bit.

The runs are the conformance suite's tiny ones (digits, a 64-16-10 MLP; Simple-FedMA and the LoRA algorithms on
generated token sequences), cut to 1 round (2 when a first round cannot show the option, e.g. a momentum) and a
smaller training set.  An option is compared on a fingerprint of the run: every metric of every round (timing
aside) and every tensor of the final server and client states.  An option that cannot act in this tiny setting is
listed in ``CANNOT_ACT`` with the reason; an option that needs a companion setting to act (``trim`` acts under
``fusion=trimmed-mean``) or a particular value is listed in ``MOVES``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import pytest
import torch

from fedfuse.algorithms import ALGORITHMS
from fedfuse.config import RunConfig, apply
from fedfuse.engine.loop import strip_timing
from fedfuse.options import describe
from fedfuse.runner import experiment
from golden.make_golden import token_federation
from support import LORA, conformance_cfg

NO_BN = "the MLP and the tiny transformer have no BatchNorm"
LORA_TABLE = "one frozen base and its module names are the test's fixture"
ONE_EVAL = "the tiny run evaluates (and scores ROUGE) only at its last round"
ROUGE = "ROUGE only: the tiny untrained LM on random tokens scores ROUGE-1 = 0 whatever is generated or scored"
UNHELD = ("acts on elements no participant holds; with the MLP's one hidden layer every element is held every "
          "round (MSfusion's own tests cover deeper models)")

#: per-algorithm options of both runs that keep the tiny run tiny (a moved option starts from these values)
BASE: dict[str, dict[str, Any]] = {
    "fedgen": {"hidden_dim": 16, "noise_dim": 4, "gen_epochs": 2, "teacher_iters": 1},
    "fedet": {"server_iters": 4, "back_iters": 2},
}

#: (algorithm or "*", option) → why the option cannot change the tiny run
CANNOT_ACT: dict[tuple[str, str], str] = {
    ("*", "int_policy"): f"{NO_BN}: there is no num_batches_tracked to combine",
    ("*", "sbn"): f"{NO_BN}: there are no statistics to recompute",
    ("*", "stats_every"): f"{NO_BN}: there are no statistics to recompute",
    ("*", "base"): LORA_TABLE,
    ("*", "targets"): LORA_TABLE,
    ("*", "rouge_every"): ONE_EVAL,
    ("*", "rouge_samples"): ROUGE,
    ("*", "prompt_len"): ROUGE,
    ("*", "gen_tokens"): ROUGE,
    ("dpsgd", "mixing"): "Metropolis and uniform weights coincide when every degree is equal: ring and full graphs "
                         "and the 4-client random graph here (checked with topology=random)",
    ("fedper", "personal_layers"): "the tiny MLP has two parametrised layers: 2 personal layers would leave no base "
                                   "(refused; tests/algorithms/test_fedper.py moves it on a deeper MLP)",
    ("msfusion", "assembly"): UNHELD,
    ("msfusion", "fallback"): UNHELD,
    ("fedmerge", "heatmap_every"): "heat-maps are image files; the test run writes no files",
    ("fedmerge-lora", "size_norm"): "all 3 clients take part in the tiny LoRA run: the sampled total is the total",
    ("fedexp", "eps"): "η_g = max(1, ·) stays 1 in the tiny run even with ε = 0 (checked): nothing to extrapolate",
    ("fedexp", "eps_decay"): "η_g = max(1, ·) stays 1 in the tiny run even with ε = 0 (checked): nothing to "
                             "extrapolate",
}

#: (algorithm or "*", option) → (companion options of both runs, the moved value)
MOVES: dict[tuple[str, str], tuple[dict[str, Any], Any]] = {
    ("*", "trim"): ({"fusion": "trimmed-mean"}, 0.34),
    ("*", "clip_norm"): ({}, 0.05),
    ("*", "degree"): ({"topology": "random"}, 3),
    ("*", "mu_list"): ({}, [0.5, 1.0]),
    ("*", "cap"): ({}, 10),
    ("*", "merge_params"): ({}, "lora_B"),
    ("fedmerge", "merge_params"): ({}, "all"),
    ("fedma", "metric"): ({"matching": "hungarian"}, "l1"),
    ("oneshot-match", "metric"): ({"matching": "hungarian"}, "l1"),
    ("fedma", "last_layer_schedule"): ({"retrain_schedule": "run"}, False),
    ("fedet", "small_models"): ({}, [{"model": "mlp", "widths": [8]}]),
    ("fedet", "server_batch"): ({}, 8),
    ("fedet", "transfer"): ({}, "distill"),
    ("fedet", "back_iters"): ({"transfer": "distill"}, 3),
    ("fedgen", "gen_batch_size"): ({}, 8),
    ("fedmr", "warmup_weighting"): ({"warmup_rounds": 1}, "samples"),
    ("fedmr", "secure_send_prob"): ({"secure": True}, 0.9),
    ("fedmr", "secure_min_passes"): ({"secure": True}, 2),
    ("msfusion", "update_every"): ({}, 1),
    ("msfusion", "p"): ({"update_every": 1}, 0.5),
    ("msfusion", "dynamic"): ({"update_every": 1}, False),
    ("msfusion", "schedule_rounds"): ({"update_every": 1}, 2),
    ("oneshot-avg", "retrain_schedule"): ({"continuation": "fedavg"}, "run"),
    ("oneshot-avg", "retrain_epochs"): ({"continuation": "fedavg"}, 1),
    ("oneshot-avg", "retrain_lr"): ({"continuation": "fedavg"}, 0.2),
    ("simple-fedma", "metric"): ({"init": "distinct"}, "l2"),
    ("simple-fedma", "residual"): ({"init": "distinct"}, "no"),
}


#: (algorithm, option) → rounds needed before the option can show (default: 1, then 2)
ROUNDS: dict[tuple[str, str], int] = {
    ("msfusion", "lam"): 3,  # the contrastive term starts once a participant returns with a previous sub-model
    ("msfusion", "similarity"): 3,
    ("msfusion", "tau"): 3,  # the temperature of that term
}


def _lookup(table: dict, algorithm: str, option: str):
    return table.get((algorithm, option), table.get(("*", option)))


def _moved(info, d: Any) -> Any:
    """A value off ``d`` (the value of the default run), inside the declared choices and bounds."""
    if info.choices:
        return next(c for c in info.choices if c != d)
    if isinstance(d, bool):
        return not d
    if isinstance(d, int):
        return d + 1
    if isinstance(d, float):
        return d / 2 if d > 0 else 0.1
    raise AssertionError(f"no rule moves option {info.name}={d!r}; list it in MOVES or CANNOT_ACT")


def _digest(obj: Any, h) -> None:
    if isinstance(obj, torch.Tensor):
        h.update(str((obj.dtype, tuple(obj.shape))).encode())
        h.update(obj.detach().cpu().contiguous().view(-1).numpy().tobytes() if obj.numel() else b"")
    elif isinstance(obj, dict):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _digest(obj[k], h)
    elif isinstance(obj, list | tuple):
        for v in obj:
            _digest(v, h)
    else:
        h.update(repr(obj).encode())


_RUNS: dict[str, str] = {}


def _fingerprint(algorithm: str, options: dict[str, Any], rounds: int) -> str:
    key = json.dumps([algorithm, options, rounds], sort_keys=True, default=str)
    if key not in _RUNS:
        cfg = conformance_cfg(algorithm, "sequential")
        over: dict[str, Any] = dict(rounds=rounds, eval_every=rounds)
        if algorithm not in LORA and algorithm != "simple-fedma":
            over["dataset_options"] = {"train_limit": 240, "test_limit": 60}
        opts = {**cfg.algorithm_options, **BASE.get(algorithm, {}), **options}
        cfg = apply(cfg, {**over, "algorithm_options": opts})
        lm = algorithm == "simple-fedma" or algorithm in LORA
        exp = experiment(cfg, fed=token_federation() if lm else None)
        exp.run()
        h = hashlib.sha256()
        _digest([strip_timing(r) for r in exp.history], h)
        _digest(exp.state, h)
        _digest(exp.client_states, h)
        _RUNS[key] = h.hexdigest()
    return _RUNS[key]


def _cases() -> list[tuple[str, str]]:
    return [(a, o.name) for a, cls in sorted(ALGORITHMS.items()) for o in describe(cls.Options)]


@pytest.mark.parametrize(("algorithm", "option"), _cases())
def test_every_declared_option_acts(algorithm: str, option: str) -> None:
    if algorithm in LORA:
        pytest.importorskip("peft", reason="needs the lora extra: pip install -e '.[lora]'")
    reason = _lookup(CANNOT_ACT, algorithm, option)
    if reason is not None:
        pytest.skip(reason)
    info = next(o for o in describe(ALGORITHMS[algorithm].Options) if o.name == option)
    declared = {**conformance_cfg(algorithm, "sequential").algorithm_options, **BASE.get(algorithm, {})}
    current = declared.get(option, info.default)
    companion, value = _lookup(MOVES, algorithm, option) or ({}, _moved(info, current))
    for rounds in (1, ROUNDS.get((algorithm, option), 2)):
        if _fingerprint(algorithm, companion, rounds) != _fingerprint(algorithm, {**companion, option: value}, rounds):
            return
    pytest.fail(f"{algorithm}: {option}={value!r} (from {current!r}) leaves the run bit-identical")


def test_the_listed_exceptions_name_real_options() -> None:
    declared = {o.name for cls in ALGORITHMS.values() for o in describe(cls.Options)}
    for table in (CANNOT_ACT, MOVES, ROUNDS, {(a, o): v for a, opts in BASE.items() for o, v in opts.items()}):
        for algorithm, option in table:
            assert option in declared and (algorithm == "*" or algorithm in ALGORITHMS), (algorithm, option)


def test_fedexp_refuses_server_lr_and_fedgen_honours_it() -> None:
    """FedExP's own step size replaces FedAvg's server rule, so FedAvg's server options are not offered."""
    fedexp = {f.name for f in dataclasses.fields(ALGORITHMS["fedexp"].Options)}
    assert not fedexp & {"server_lr", "fusion", "trim", "clip_norm"}
    with pytest.raises(Exception, match="server_lr"):
        apply(RunConfig(), {"algorithm": "fedexp", "algorithm_options": {"server_lr": 0.5}})
