"""Local differential privacy on the clients: DP-SGD (Abadi et al., CCS 2016) through Opacus (``dp=local``).

Every local step of a client samples each of its n_i training examples independently with probability
q_i = 1/⌈n_i/B⌉ (Opacus's Poisson data loader; B = ``batch_size``), clips every per-sample gradient to L2 norm
``dp_clip`` and adds Gaussian noise of std ``dp_noise``·``dp_clip`` to their sum before the optimiser step.  The
model a client sends is then (ε_i, δ)-DP with respect to each of *its own* examples, whatever the server does
with it (example-level privacy; central DP is client-level).  ε_i comes from Opacus's RDP accountant over all the
steps client i has taken in the run; ``metrics.jsonl`` reports the largest ε_i over the clients so far
(``dp_epsilon``) and the median over the clients that trained (``dp_epsilon_median``).

**Whose randomness.**  Run in process, the noise comes from the job's generator and the batches from the global
torch RNG, both seeded from the run's seed: reproducible, and so no protection against anyone who knows the seed
(it is in ``config.yaml``, the records and every Flower job).  A device that enforces its own local DP
(:mod:`fedfuse.flower.node_policy`) trains with a :func:`secure_generator` instead: :func:`train_dp_sgd` then runs
Opacus in its secure mode (the noise as the sum of four Gaussian draws halved, against floating-point attacks)
with both the noise and the Poisson batches drawn from that generator, whose state comes from ``os.urandom`` and
is never stored or sent.

**A wrapper of the client step.**  Local DP belongs to no algorithm: under ``dp=local`` the engine runs every
client step through :class:`LocalDPClient` (:func:`fedfuse.engine.personal.client_side`), which trains the
algorithm's declared :class:`~fedfuse.engine.program.ClientProgram` with DP-SGD instead of the standard loop and
builds the reply with the program's own ``finalize``.  So any algorithm whose client step is plain SGD on the task
loss (no loss term, gradient transform, feature read, SAM pass, parameter subset or substituted samples) admits it
without code of its own; a program that is more than that is refused (Opacus would clip the task gradients only),
and an opaque ``fit`` may run only if it trains nothing (FedMR's secure exchange stages).

Layers whose output mixes samples (BatchNorm in training mode) have no per-sample gradient: such a model is
refused with Opacus's reasons (use a GroupNorm or normalisation-free variant).  Opacus is an optional dependency
(``pip install fedfuse[dp]``).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import warnings
import weakref
from collections.abc import Iterator
from contextvars import ContextVar
from functools import lru_cache
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedfuse.engine.client import TrainConfig, TrainStats, task_loss
from fedfuse.engine.program import ClientProgram, cross_entropy
from fedfuse.errors import UserError
from fedfuse.extras import import_extra
from fedfuse.types import ClientData, Message, Split, TensorDict


def _opacus():  # -> module
    """Opacus, or :class:`fedfuse.extras.MissingExtra` naming ``pip install 'fedfuse[dp]'``."""
    return import_extra("opacus", "dp", "dp=local")


def check_local_dp(model: nn.Module) -> None:
    """Raise a :class:`~fedfuse.errors.UserError` with Opacus's reasons when it cannot compute per-sample
    gradients of ``model``."""
    _opacus()
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        why = "; ".join(sorted({str(e).splitlines()[0].split(". ")[0] for e in errors}))
        raise UserError(f"dp=local: Opacus cannot clip per-sample gradients of this model ({why}); BatchNorm mixes "
                         "the samples of a batch — use a model without it (e.g. a GroupNorm variant)")


def sample_rate(n: int, batch_size: int) -> float:
    """Opacus's Poisson sampling rate for ``n`` examples and batch size B: 1/⌈n/B⌉."""
    return 1.0 / max(math.ceil(n / batch_size), 1)


def planned_steps(n: int, train: TrainConfig) -> int:
    """The DP-SGD steps :func:`train_dp_sgd` takes on ``n`` examples: ``local_epochs`` × ⌈n/B⌉ (Opacus's Poisson
    loader has that many batches an epoch, empty ones included), capped by ``max_steps``."""
    steps = max(int(train.local_epochs), 0) * max(math.ceil(n / max(min(train.batch_size, max(n, 1)), 1)), 1)
    return min(steps, int(train.max_steps)) if train.max_steps else steps


_SECURE: weakref.WeakSet[torch.Generator] = weakref.WeakSet()
#: CPU generator state of torch 2.x: seed (8 bytes), left and seeded (4 + 4), next (8), then 624 state words of
#: 8 bytes (32 bits used each), then the cached normal draws (40 bytes)
_MT_STATE_BYTES, _MT_WORDS_AT, _MT_WORDS = 5056, 24, 624


def secure_generator() -> torch.Generator:
    """A CPU ``torch.Generator`` whose whole Mersenne-Twister state (624 words of 32 bits) is read from
    ``os.urandom``, and never stored or sent: its draws cannot be regenerated from the run's seed or anything
    else the server knows.  :func:`train_dp_sgd` recognises it and runs Opacus in secure mode with it."""
    gen = torch.Generator()
    state = gen.get_state().numpy().copy()
    if state.size == _MT_STATE_BYTES:
        words = np.frombuffer(os.urandom(4 * _MT_WORDS), dtype=np.uint32).astype(np.uint64)
        state[_MT_WORDS_AT:_MT_WORDS_AT + 8 * _MT_WORDS] = words.view(np.uint8)
        gen.set_state(torch.from_numpy(state))
    else:  # another layout: 64 bits from the OS, the most manual_seed takes
        gen.manual_seed(int.from_bytes(os.urandom(8), "little"))
    _SECURE.add(gen)
    return gen


def is_secure(gen: torch.Generator) -> bool:
    """True for a generator made by :func:`secure_generator`."""
    return gen in _SECURE


class Guard(Protocol):
    """What a device that enforces its own local DP checks at every DP-SGD call (:func:`guarded`)."""

    def admit(self, noise: float, clip: float, rate: float, steps: int) -> None:
        """Raise to refuse ``steps`` steps of noise multiplier ``noise``, clip ``clip``, sampling rate ``rate``."""

    def spent(self, steps: int) -> None:
        """The steps the admitted call took."""


_GUARD: ContextVar[Any] = ContextVar("fedfuse_local_dp_guard", default=None)


@contextlib.contextmanager
def guarded(guard: Guard) -> Iterator[None]:
    """Every :func:`train_dp_sgd` call inside is checked by ``guard`` with the parameters it really runs with
    (whatever algorithm calls it, with whatever settings), and draws from a fresh :func:`secure_generator`
    whatever generator it is handed."""
    token = _GUARD.set(guard)
    try:
        yield
    finally:
        _GUARD.reset(token)


def train_dp_sgd(model: nn.Module, split: Split, train: TrainConfig, gen: torch.Generator, *, noise: float,
                 clip: float) -> tuple[TensorDict, TrainStats]:
    """DP-SGD on a copy of ``model`` for ``train.local_epochs`` epochs of Poisson-sampled batches; returns the
    trained state and the statistics (``steps`` counts every sampling step, empty batches included: each one is
    accounted).  The noise comes from ``gen``; batch sampling from the global torch RNG (seeded per client step by
    every executor), so runs are reproducible — unless ``gen`` is a :func:`secure_generator`: then Opacus runs in
    secure mode and both the noise and the batches come from it."""
    _opacus()
    from opacus import PrivacyEngine

    guard = _GUARD.get()
    if guard is not None:  # a device enforcing its own local DP: its check, its accountant, its randomness
        n = len(split)
        guard.admit(noise, clip, sample_rate(n, min(train.batch_size, max(n, 1))), planned_steps(n, train))
        gen = secure_generator()
    work = copy.deepcopy(model).train()  # Opacus hooks the module: never touch the caller's (cached) one
    params = [p for p in work.parameters() if p.requires_grad]
    if train.optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=train.lr, weight_decay=train.weight_decay)
    else:
        opt = torch.optim.SGD(params, lr=train.lr, momentum=train.momentum, weight_decay=train.weight_decay)
    loader = DataLoader(TensorDataset(split.x, split.y), batch_size=min(train.batch_size, max(len(split), 1)))
    secure = is_secure(gen)
    with warnings.catch_warnings():  # in process the noise comes from the run's seeded generator, not a CSPRNG
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant="rdp")
        if secure:  # Opacus's secure mode with our OS-seeded generator in place of torchcsprng's
            engine.secure_mode, engine.secure_rng = True, gen
        private, popt, ploader = engine.make_private(module=work, optimizer=opt, data_loader=loader,
                                                     noise_multiplier=noise, max_grad_norm=clip,
                                                     noise_generator=None if secure else gen)
    with warnings.catch_warnings():  # Opacus's hooks on a first layer whose input needs no gradient
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        stats = _steps(private, popt, ploader, train)
    if guard is not None:
        guard.spent(stats.steps)
    state = {k: v.detach().clone() for k, v in private._module.state_dict().items()}
    return state, stats


def _steps(private: nn.Module, popt: torch.optim.Optimizer, ploader: DataLoader, train: TrainConfig) -> TrainStats:
    stats = TrainStats()
    for _ in range(train.local_epochs):
        for x, y in ploader:
            stats.steps += 1
            popt.zero_grad(set_to_none=True)
            if len(x) == 0:  # an empty Poisson batch: a zero gradient, and the step still adds its noise
                task_loss(private(x), y, reduction="sum").backward()
                popt.step()
                continue
            loss = task_loss(private(x), y)
            loss.backward()
            popt.step()
            stats.samples += len(x)
            stats.loss_sum += float(loss.detach()) * len(x)
            if train.max_steps and stats.steps >= train.max_steps:
                return stats  # a cap on the steps of the whole client step, as in engine.client
    return stats


def beyond_plain_sgd(program: ClientProgram) -> list[str]:
    """What makes ``program`` more than plain SGD on the task loss (empty: DP-SGD can run it)."""
    return [what for what, more in (
        ("loss terms " + ", ".join(t.name for t in program.terms), bool(program.terms)),
        ("its own loss", program.loss is not cross_entropy), ("a gradient transform", program.transform is not None),
        ("the model's features", program.features), ("a trained subset", program.trainable is not None),
        ("substituted samples", program.train is not None),
        (f"{program.spec.two_pass} two-pass steps", bool(program.spec.two_pass))) if more]


class LocalDPClient:
    """Local DP as a wrapper of the client step (``dp=local``; see the module docstring): what the executors run in
    place of ``inner`` (an algorithm, or its :class:`~fedfuse.engine.personal.ClientSide`).  It declares no program,
    so every executor calls :meth:`fit`, which trains the inner program with DP-SGD (noise multiplier ``noise``,
    clip ``clip``); everything else is the inner client side's."""

    def __init__(self, inner: Any, noise: float, clip: float) -> None:
        self.inner, self.noise, self.clip = inner, float(noise), float(clip)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def client_program(self, payload: Message, client_state: Any, data: ClientData) -> ClientProgram | None:
        """None: no executor may run the step's plain loop (they call :meth:`fit`)."""
        return None

    def fit(self, payload: Message, client_state: Any, data: ClientData,
            gen: torch.Generator) -> tuple[Message, Any]:
        """The inner program trained with DP-SGD from its ``init`` on the client's training split, its reply built
        by the program's ``finalize``.  Raises :class:`~fedfuse.errors.UserError` for a program DP-SGD cannot run
        as declared, or an opaque step that trained outside DP-SGD."""
        program = self.inner.client_program(payload, client_state, data)
        if program is None:  # an opaque step: allowed only when it trains nothing
            reply, state = self.inner.fit(payload, client_state, data, gen)
            if reply.stats is not None and reply.stats.steps > 0:
                raise UserError("dp=local: the client step trained outside DP-SGD (an opaque fit); it admits local DP "
                                "only as a declared plain program")
            return reply, state
        more = beyond_plain_sgd(program)
        if more:
            raise UserError(f"dp=local: DP-SGD wraps plain SGD on the task loss; this client step adds "
                            f"{'; '.join(more)}")
        program.model.load_state_dict(program.init, strict=True)
        trained, stats = train_dp_sgd(program.model, data.train, program.spec, gen, noise=self.noise, clip=self.clip)
        return program.finalize(trained, stats)


@lru_cache(maxsize=65536)
def local_epsilon(noise: float, rate: float, steps: int, delta: float) -> float:
    """ε at ``delta`` of ``steps`` DP-SGD steps of sampling rate ``rate`` and noise ``noise`` (Opacus's RDP
    accountant)."""
    from opacus.accountants import RDPAccountant

    if steps <= 0:
        return 0.0
    if noise <= 0:
        return math.inf
    acc = RDPAccountant()
    acc.history = [(noise, rate, steps)]
    return float(acc.get_epsilon(delta))
