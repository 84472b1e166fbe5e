"""One-way layers, checked on the source: ``types → models → fusion → engine → algorithms → api/cli``.

Every ``import`` and ``from … import`` in ``src/fedfuse`` is read with :mod:`ast` — at module level and inside
functions (a call-time import is still an arrow) — and resolved to the module it names.  A failure lists the
offending arrows as ``importer:line -> imported``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import fedfuse

SRC = Path(fedfuse.__file__).parent

# A variant may subclass its parent algorithm (and import nothing else from it): (variant, parent) -> parent class.
ALLOWED_VARIANTS: dict[tuple[str, str], str] = {
    ("clusamp", "fedavg"): "FedAvg",
    ("dispfl", "dpsgd"): "DPSGD",
    ("fedavg_ft", "fedavg"): "FedAvg",
    ("fedexp", "fedavg"): "FedAvg",
    ("fedgen", "fedavg"): "FedAvg",
    ("fedprox", "fedavg"): "FedAvg",
    ("fedrolex", "heterofl"): "HeteroFL",
    ("fedsam", "fedavg"): "FedAvg",
}
# Modules of fedfuse.algorithms that are not algorithms: every algorithm may import them.
ALGORITHM_COMMONS = {"fedfuse.algorithms", "fedfuse.algorithms.base"}
# What sits above the engine: the engine imports none of it.
ABOVE_ENGINE = ("fedfuse.algorithms", "fedfuse.experiment", "fedfuse.api", "fedfuse.cli", "fedfuse.sweep",
                "fedfuse.reproduce", "fedfuse.adapters", "fedfuse.report")


@dataclass(frozen=True)
class Arrow:
    importer: str  # module that imports
    line: int
    module: str  # module imported (a submodule when ``from pkg import submodule``)
    names: tuple[str, ...]  # names taken with ``from … import`` (empty for ``import x``)

    def __str__(self) -> str:
        what = f" ({', '.join(self.names)})" if self.names else ""
        return f"{self.importer}:{self.line} -> {self.module}{what}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str, root: Path) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (root / rel).with_suffix(".py").is_file() or (root / rel / "__init__.py").is_file()


def arrows_of(source: str, importer: str, is_package: bool = False, root: Path = SRC) -> list[Arrow]:
    """Every import in ``source`` (module level, in functions, under ``if TYPE_CHECKING``) that names fedfuse."""
    package = importer if is_package else importer.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [Arrow(importer, node.lineno, a.name, ()) for a in node.names if a.name.split(".")[0] == "fedfuse"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.split(".")[0] != "fedfuse":
                continue
            plain = tuple(a.name for a in node.names if not _is_module(f"{mod}.{a.name}", root))
            if plain or not node.names:
                out.append(Arrow(importer, node.lineno, mod, plain))
            out += [Arrow(importer, node.lineno, f"{mod}.{a.name}", ()) for a in node.names
                    if _is_module(f"{mod}.{a.name}", root)]
    return out


def all_arrows(root: Path = SRC) -> list[Arrow]:
    out = []
    for path in sorted(root.rglob("*.py")):
        out += arrows_of(path.read_text(), module_name(path, root), path.name == "__init__.py", root)
    return out


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _report(title: str, bad: list[Arrow]) -> str:
    return f"{title} ({len(bad)} arrow(s)):\n  " + "\n  ".join(map(str, bad))


ARROWS = all_arrows()


def test_the_scanner_sees_function_level_and_relative_imports():
    src = ("import fedfuse.types\nfrom . import peers\n"
           "def f():\n    from fedfuse.algorithms import get_algorithm\n    return get_algorithm\n")
    found = {(a.module, a.names) for a in arrows_of(src, "fedfuse.engine.loop")}
    assert found == {("fedfuse.types", ()), ("fedfuse.engine.peers", ()),
                     ("fedfuse.algorithms", ("get_algorithm",))}
    assert len({a.importer for a in ARROWS}) > 80  # the whole package was read
    assert any(a.importer == "fedfuse.experiment" and a.module == "fedfuse.algorithms" for a in ARROWS)


def test_engine_imports_nothing_above_it():
    """The engine resolves an algorithm through the lookup its caller passes (``fedfuse.experiment`` binds the
    registry); no engine module imports an algorithm, the api, the CLI or anything else above it."""
    bad = [a for a in ARROWS if _under(a.importer, "fedfuse.engine") and any(_under(a.module, p) for p in ABOVE_ENGINE)]
    assert not bad, _report("fedfuse.engine imports a layer above it", bad)


def test_engine_without_a_lookup_says_how_to_get_one():
    from fedfuse.config import RunConfig
    from fedfuse.engine.loop import Experiment

    with pytest.raises(TypeError, match="algorithm_lookup"):
        Experiment(RunConfig(dataset="digits", clients=2, rounds=1))
