"""One-way layers, checked on the source: every module of ``src/fedfuse`` has a rank (:data:`LAYERS`, shown in
``docs/design.md``), no import goes to a higher rank, and the imports form no cycle.

Every ``import`` and ``from … import`` in ``src/fedfuse`` is read with :mod:`ast` — at module level, inside
functions (a call-time import is still an arrow) and under ``if TYPE_CHECKING`` — and resolved to the module it
names; ``importlib.import_module`` with a constant name counts too, a registry package's discovery of its
own submodules (``importlib.import_module(f"{__name__}.{name}")``) is an arrow to each of them, and importing a
module of a package is also an arrow to that package's ``__init__`` (Python runs it first).  A failure lists
the offending arrows as ``importer:line -> imported``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fedfuse
from fedfuse.structure import Member, PermGroup, UnitGroupBuilder, UnitGroups, axis

SRC = Path(fedfuse.__file__).parent
DESIGN = SRC.parent.parent / "docs" / "design.md"

# The ranking, bottom first: (layer, what it owns, its modules).  ``pkg.*`` is every module below ``pkg`` (the
# package itself excluded); an exact name wins over a ``.*`` pattern, a longer pattern over a shorter one.  A
# module may import modules of its own layer or of a lower one, never of a higher one, and never in a cycle.
LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    ("foundation", "message and federation types, structure declarations, seeded RNG, option declarations, "
                   "error types, optional extras, statistics, Markdown tables, name suggestions, the run directory's "
                   "file names",
     ("fedfuse.types", "fedfuse.structure", "fedfuse.rng", "fedfuse.options", "fedfuse.errors", "fedfuse.extras",
      "fedfuse.stats", "fedfuse.tables", "fedfuse._callable", "fedfuse.names", "fedfuse.runfiles")),
    ("plots", "figures of metric histories", ("fedfuse.plots",)),
    ("models", "model classes and their registry", ("fedfuse.models", "fedfuse.models.*")),
    ("fusion", "pure operators on named tensors", ("fedfuse.fusion", "fedfuse.fusion.*")),
    ("data", "datasets, corpora, partitions, federations, partition reports and exports",
     ("fedfuse.data", "fedfuse.data.*")),
    ("config", "the run configuration: schema, validation, its sections, YAML, run directories",
     ("fedfuse.coerce", "fedfuse.sections", "fedfuse.configfile", "fedfuse.config", "fedfuse.rundir")),
    ("run store", "a run directory read back as a Result", ("fedfuse.result",)),
    ("runtime", "the process's compute settings: training precision and memory format, thread counts",
     ("fedfuse.runtime", "fedfuse.runtime.*")),
    ("privacy", "central differential privacy and its accountant, secure aggregation's orchestration",
     ("fedfuse.privacy", "fedfuse.privacy.*")),
    ("engine", "the round loop, the contract, the sequential executor and the executor registry, client "
               "training, accounting, callbacks, checkpoints",
     ("fedfuse.engine", "fedfuse.engine.*")),
    ("executors", "the batched, process-pool and auto executors, registered by name",
     ("fedfuse.executors", "fedfuse.executors.*")),
    ("adapters", "LoRA adapters, the character tokenizer, adapter evaluation",
     ("fedfuse.adapters", "fedfuse.adapters.*")),
    ("contract", "what an algorithm is, and what the LoRA algorithms and the mean-of-deltas algorithms share",
     ("fedfuse.algorithms.base", "fedfuse.algorithms.lora_base", "fedfuse.algorithms.mean_base")),
    ("algorithms", "one module per algorithm", ("fedfuse.algorithms.*",)),
    ("registry", "every algorithm by name", ("fedfuse.algorithms",)),
    ("flower", "Flower: executor, apps, wire format, simulation, deployment", ("fedfuse.flower", "fedfuse.flower.*")),
    ("composition root", "wires algorithm, executors and output files into a run",
     ("fedfuse.outputs", "fedfuse.runner")),
    ("tools", "sweeps and the run store's tables, reports, the table a run prints",
     ("fedfuse.result_table", "fedfuse.cached_runs", "fedfuse.sweep", "fedfuse.report", "fedfuse.run_table")),
    ("records", "result records and the docs' tables rendered from them (the benchmark matrix too)",
     ("fedfuse.bench_report", "fedfuse.records")),
    ("reproductions", "paper presets, the benchmark matrix's plan",
     ("fedfuse.reproduce", "fedfuse.reproduce.*", "fedfuse.benchmark")),
    ("verification", "a record re-run with today's code and compared", ("fedfuse.verify",)),
    ("entry points", "the Python API, the command line and the catalog it lists, docs generated from the "
                     "declarations, the package root",
     ("fedfuse.catalog", "fedfuse.docgen", "fedfuse.api", "fedfuse.cli", "fedfuse.adapters.cli", "fedfuse.__main__",
      "fedfuse")),
]
# A variant may subclass another algorithm (and import nothing else from it): the rule, checked on the code, is that
# every name an algorithm module imports from another algorithm's module is an ``Algorithm`` subclass that the
# importing module subclasses (test_no_algorithm_borrows_from_another).
# Companion modules: one part of an algorithm kept in a file of its own; they belong to that algorithm.
COMPANIONS: dict[str, str] = {"fedmr_secure": "fedmr"}
# Modules of fedfuse.algorithms that are not algorithms: every algorithm may import them.  (The package itself is
# the registry of every algorithm: importing it counts as importing another algorithm.)
ALGORITHM_COMMONS = {"fedfuse.algorithms.base", "fedfuse.algorithms.lora_base", "fedfuse.algorithms.mean_base"}
# The package root resolves its public names lazily (``fedfuse.run`` → ``fedfuse.api.run``) with computed module
# names; it is the top rank, so whatever it reaches is below it.  ``fedfuse.extras`` imports an optional extra's
# module by name (third-party only: it refuses a fedfuse module).
DYNAMIC_IMPORTERS = {"fedfuse", "fedfuse.extras"}


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


def _children(package: str, root: Path) -> list[str]:
    folder = root / Path(*package.split(".")[1:])
    return sorted(f"{package}.{p.stem if p.suffix else p.name}" for p in folder.iterdir()
                  if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").is_file())


def _dynamic(node: ast.Call, importer: str, is_package: bool, root: Path) -> list[Arrow] | None:
    """Arrows of an ``importlib.import_module(...)`` call; None when the name cannot be resolved."""
    arg = node.args[0] if node.args else None
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [Arrow(importer, node.lineno, arg.value, ())] if arg.value.split(".")[0] == "fedfuse" else []
    if (is_package and isinstance(arg, ast.JoinedStr) and len(arg.values) >= 2
            and isinstance(arg.values[0], ast.FormattedValue) and getattr(arg.values[0].value, "id", "") == "__name__"):
        return [Arrow(importer, node.lineno, child, ()) for child in _children(importer, root)]
    return None


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
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module"):
            found = _dynamic(node, importer, is_package, root)
            if found is None:
                if importer not in DYNAMIC_IMPORTERS:
                    raise AssertionError(f"{importer}:{node.lineno}: import_module of a computed name; "
                                         "import what you need by name")
                continue
            out += found
    return out


def all_modules(root: Path = SRC) -> list[str]:
    return sorted(module_name(p, root) for p in root.rglob("*.py"))


def all_arrows(root: Path = SRC) -> list[Arrow]:
    out = []
    for path in sorted(root.rglob("*.py")):
        out += arrows_of(path.read_text(), module_name(path, root), path.name == "__init__.py", root)
    return out


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _report(title: str, bad: list) -> str:
    return f"{title} ({len(bad)}):\n  " + "\n  ".join(map(str, bad))


def rank_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module``'s layer (None when no pattern covers it)."""
    best: tuple[int, int] | None = None  # (specificity, rank)
    for rank, (_, _, patterns) in enumerate(LAYERS):
        for pat in patterns:
            if pat == module:
                spec = 10_000
            elif pat.endswith(".*") and module.startswith(pat[:-1]):
                spec = len(pat)
            else:
                continue
            if best is None or spec > best[0]:
                best = (spec, rank)
    return None if best is None else best[1]


MODULES = all_modules()


def _target(a: Arrow) -> str:
    """The module an arrow reaches (``from pkg.mod import name`` reaches ``pkg.mod``)."""
    parent = a.module.rpartition(".")[0]
    return parent if a.module not in MODULES and parent in MODULES else a.module


def with_packages(arrows: list[Arrow]) -> list[Arrow]:
    """``arrows`` plus the package ``__init__`` each import runs first: importing ``fedfuse.a.b.c`` executes
    ``fedfuse/a/__init__.py`` and ``fedfuse/a/b/__init__.py`` (an arrow to each, unless the importer is inside
    that package).  The root ``fedfuse`` is left out: every module runs it, and it imports only
    ``fedfuse.config`` at import time (its public names are resolved on first use)."""
    out = list(arrows)
    for a in arrows:
        parts = _target(a).split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            if not _under(a.importer, package):
                out.append(Arrow(a.importer, a.line, package, (f"runs {package}/__init__",)))
    return out


ARROWS = with_packages(all_arrows())


def test_the_scanner_sees_function_level_relative_and_registry_imports():
    src = ("import fedfuse.types\nfrom . import peers\n"
           "def f():\n    from fedfuse.algorithms import get_algorithm\n    return get_algorithm\n"
           "def g():\n    import importlib\n    return importlib.import_module('fedfuse.cli')\n")
    found = {(a.module, a.names) for a in arrows_of(src, "fedfuse.engine.loop")}
    assert found == {("fedfuse.types", ()), ("fedfuse.engine.peers", ()),
                     ("fedfuse.algorithms", ("get_algorithm",)), ("fedfuse.cli", ())}
    assert len({a.importer for a in ARROWS}) > 80  # the whole package was read
    # the registry package discovers every algorithm module: arrows from it to each of them
    assert {a.module for a in ARROWS if a.importer == "fedfuse.algorithms"} >= {"fedfuse.algorithms.fedavg",
                                                                                "fedfuse.algorithms.msfusion"}
    with pytest.raises(AssertionError, match="computed name"):
        arrows_of("import importlib\nimportlib.import_module(name)\n", "fedfuse.engine.loop")


def test_importing_a_package_member_counts_as_importing_the_package():
    found = with_packages([Arrow("fedfuse.engine.loop", 3, "fedfuse.data.datasets.registry", ())])
    assert {a.module for a in found} == {"fedfuse.data.datasets.registry", "fedfuse.data", "fedfuse.data.datasets"}
    inside = with_packages([Arrow("fedfuse.data.datasets.cifar", 3, "fedfuse.data.datasets.common", ())])
    assert [a.module for a in inside] == ["fedfuse.data.datasets.common"]  # its own packages run already


def test_the_package_root_imports_only_the_config_when_imported():
    """Every module runs ``fedfuse/__init__.py``; at import time it may reach only the configuration layer
    (everything else it offers is imported on first use), so it closes no cycle."""
    tree = ast.parse((SRC / "__init__.py").read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    named = {n.module for n in top if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("fedfuse.")}
    named |= {f"fedfuse.{a.name}" for n in top if isinstance(n, ast.ImportFrom) and n.module == "fedfuse"
              for a in n.names}
    named |= {a.name for n in top if isinstance(n, ast.Import) for a in n.names if a.name.startswith("fedfuse")}
    assert named <= {"fedfuse.config"}, named


def test_every_module_has_exactly_one_rank_and_every_pattern_names_something():
    unranked = [m for m in MODULES if rank_of(m) is None]
    assert not unranked, _report("modules without a layer in LAYERS", unranked)
    stale = [p for _, _, pats in LAYERS for p in pats
             if not any(m == p or (p.endswith(".*") and m.startswith(p[:-1])) for m in MODULES)]
    assert not stale, _report("LAYERS patterns that name no module", stale)


def test_no_import_goes_up_a_layer():
    bad = []
    for a in ARROWS:
        target = _target(a)
        if rank_of(target) is not None and rank_of(target) > rank_of(a.importer):
            bad.append(f"{a}   [{LAYERS[rank_of(a.importer)][0]} -> {LAYERS[rank_of(target)][0]}]")
    assert not bad, _report("imports up the layers", bad)


def _cycles(arrows: list[Arrow]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a in arrows:
        target = _target(a)
        if target != a.importer:
            graph.setdefault(a.importer, set()).add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_imports_form_no_cycle():
    assert _cycles([Arrow("a", 1, "b", ()), Arrow("b", 1, "c", ()), Arrow("c", 1, "a", ())]) == [["a", "b", "c"]]
    cycles = _cycles(ARROWS)
    assert not cycles, _report("import cycles", cycles)


BENCHMARKS = SRC.parent.parent / "benchmarks"


def benchmark_arrows() -> list[Arrow]:
    """Imports between the scripts of ``benchmarks/`` (they import each other by bare name: the folder is on
    ``sys.path`` when one runs), module level and in functions."""
    names = {p.stem for p in BENCHMARKS.glob("*.py")}
    out = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            out += [Arrow(path.stem, node.lineno, m, ()) for m in mods if m.split(".")[0] in names]
    return out


def test_the_benchmarks_sit_outside_the_package_with_no_cycle():
    """``benchmarks/`` is outside the layers: its scripts may import any fedfuse module, no fedfuse module imports
    a script, and the scripts import each other without a cycle."""
    assert BENCHMARKS.is_dir()
    scripts = {p.stem for p in BENCHMARKS.glob("*.py")}
    assert not [m for m in MODULES if m.split(".")[-1] in scripts and "benchmarks" in m]
    reached = {a.module.split(".")[0] for a in all_arrows()} | {a.module for a in ARROWS}
    assert "benchmarks" not in reached and not any(m.startswith("benchmarks.") for m in reached)
    src_text = "\n".join(p.read_text() for p in SRC.rglob("*.py"))
    assert not [s for s in scripts if f"import {s}\n" in src_text or f"from {s} import" in src_text]
    arrows = benchmark_arrows()
    assert arrows, "the scanner found no import between benchmark scripts"
    cycles = _cycles(arrows)
    assert not cycles, _report("import cycles among benchmarks/", cycles)


def render_layers() -> list[str]:
    """The table of :data:`LAYERS` as ``docs/design.md`` shows it."""
    rows = ["| rank | layer | owns | modules |", "|---|---|---|---|"]
    for rank, (name, owns, pats) in enumerate(LAYERS):
        rows.append(f"| {rank} | {name} | {owns} | {', '.join(f'`{p}`' for p in pats)} |")
    return rows


def test_the_design_doc_shows_this_ranking():
    text = DESIGN.read_text()
    missing = [row for row in render_layers() if row not in text.splitlines()]
    assert not missing, "docs/design.md does not show LAYERS; paste:\n" + "\n".join(render_layers())


def test_the_engine_takes_an_algorithm_class_not_a_name():
    from fedfuse.config import RunConfig
    from fedfuse.engine.loop import Experiment

    with pytest.raises(TypeError, match="class"):
        Experiment(RunConfig(dataset="digits", clients=2, rounds=1), "fedavg")


def test_config_reads_the_algorithm_registry_without_importing_it():
    """``fedfuse.config`` validates algorithm names and Options through the registry ``fedfuse.algorithms``
    registers on import (``register_algorithm_source``)."""
    import fedfuse.algorithms
    from fedfuse.config import registered_algorithms

    assert registered_algorithms() is fedfuse.algorithms.ALGORITHMS


# ---------------------------------------------------------------------------------------------------- fusion

FUSION_MAY_IMPORT = ("fedfuse.fusion", "fedfuse.types", "fedfuse.structure", "fedfuse.options", "fedfuse.rng",
                     "fedfuse.errors")


def test_fusion_imports_no_model_and_nothing_above_it():
    """Fusion operators read what a model declares (``fedfuse.structure``), never a model class (they may raise
    the user-error types of ``fedfuse.errors``)."""
    bad = [a for a in ARROWS if _under(a.importer, "fedfuse.fusion")
           and not any(_under(a.module, p) for p in FUSION_MAY_IMPORT)]
    assert not bad, _report("fedfuse.fusion imports outside types/structure/options/rng/errors/fusion", bad)


def _model_names() -> set[str]:
    from fedfuse.models import MODELS

    classes = {type(m).__name__ for m in (_build(n) for n in ("mlp", "cnn", "cnn-cifar", "cnn-femnist", "resnet9",
                                                               "vgg16", "transformer", "lstm"))}
    return set(MODELS) | classes


def _build(name: str):
    from fedfuse.models import build_model

    shape = {"transformer": (8,), "lstm": (8,), "mlp": (16,)}.get(name, (3, 32, 32))
    return build_model(name, shape, 10)


def test_fusion_does_not_switch_on_model_names():
    """No ``type(m).__name__`` outside an error message, no comparison with a model or model-class name."""
    names = _model_names()
    bad = []
    for path in sorted((SRC / "fusion").glob("*.py")):
        tree = ast.parse(path.read_text())
        in_fstring = {id(n) for j in ast.walk(tree) if isinstance(j, ast.JoinedStr) for n in ast.walk(j)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr == "__name__" and isinstance(node.value, ast.Call)
                    and getattr(node.value.func, "id", "") == "type" and id(node) not in in_fstring):
                bad.append(f"fedfuse.fusion.{path.stem}:{node.lineno} uses type(...).__name__")
            if isinstance(node, ast.Compare | ast.MatchValue):
                consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)]
                bad += [f"fedfuse.fusion.{path.stem}:{node.lineno} compares with {c!r}" for c in consts if c in names]
    assert not bad, "fusion switches on model names:\n  " + "\n  ".join(bad)


class TwoTower(torch.nn.Module):
    """A user's own module (not a FedModel, not a chain): a residual stream of 8 units fed by ``inp``, updated by
    ``mid`` (h + relu(mid(h))) and read by ``head``; it declares its unit and permutation groups."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.head(h + torch.relu(self.mid(h)))

    def unit_groups(self) -> UnitGroups:
        b = UnitGroupBuilder(self.state_dict())
        b.group("stream", 8)
        b.layer("inp", axis("stream"), None)
        b.layer("mid", axis("stream"), axis("stream"))
        b.layer("head", None, axis("stream"))
        return b.build("stream")

    def perm_groups(self) -> list[PermGroup]:
        members = (Member("inp.weight", 0), Member("inp.bias", 0), Member("mid.weight", 0), Member("mid.bias", 0),
                   Member("mid.weight", 1, role="out"), Member("head.weight", 1, role="out"))
        return [PermGroup("stream", 8, members)]


def test_a_user_model_declares_its_width_groups_and_fusion_slices_it():
    from fedfuse.fusion.slicing import build_submodel, slice_spec, slice_state, write_back, zero_unselected

    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = TwoTower()
    spec = slice_spec(model)
    assert spec.groups == {"stream": 8} and spec.dims["mid.weight"] == (("stream", 1, 1), ("stream", 1, 1))
    assert spec.dims["inp.weight"] == (("stream", 1, 1), None) and spec.dims["head.bias"] == (None,)
    sel = {"stream": torch.tensor([1, 4, 6])}
    full = model.state_dict()
    sub_state = slice_state(full, spec, sel)
    assert sub_state["mid.weight"].shape == (3, 3) and sub_state["head.weight"].shape == (3, 3)
    torch.testing.assert_close(sub_state["mid.weight"], full["mid.weight"][[1, 4, 6]][:, [1, 4, 6]])
    sub = build_submodel(model, spec, {"stream": 3}, tag="two-tower")
    sub.load_state_dict(sub_state)
    silenced = TwoTower()
    silenced.load_state_dict(zero_unselected(full, spec, sel))
    x = torch.randn(5, 6, generator=gen)
    torch.testing.assert_close(sub(x), silenced(x))  # the sub-model is the full model with the rest silenced
    back = write_back(full, sub_state, spec, sel)
    assert all(torch.equal(back[k], full[k]) for k in full)


def test_a_user_model_declares_its_permutation_groups_and_a_permutation_keeps_its_function():
    from fedfuse.fusion.permute import chain_spec, perm_spec, permute_all, random_group_permutations

    torch.manual_seed(1)
    model = TwoTower()
    spec = perm_spec(model)
    assert [g.name for g in spec] == ["stream"]
    perms = random_group_permutations(spec, torch.Generator().manual_seed(3))
    assert sorted(perms["stream"].tolist()) == list(range(8)) and perms["stream"].tolist() != list(range(8))
    moved = TwoTower()
    moved.load_state_dict(permute_all(model.state_dict(), spec, perms))
    x = torch.randn(4, 6)
    assert not torch.equal(moved.inp.weight, model.inp.weight)
    torch.testing.assert_close(moved(x), model(x))
    # read as a plain chain (no declaration), the residual tie is lost and its permutations change the function
    chain = chain_spec(model)
    assert [g.name for g in chain] == ["inp", "mid"]
    wrong = TwoTower()
    chain_perms = random_group_permutations(chain, torch.Generator().manual_seed(3))
    wrong.load_state_dict(permute_all(model.state_dict(), chain, chain_perms))
    assert not torch.allclose(wrong(x), model(x))


def test_a_model_without_a_declaration_is_refused_by_name_of_the_method():
    from fedfuse.fusion.slicing import slice_spec

    with pytest.raises(TypeError, match="unit_groups"):
        slice_spec(torch.nn.Sequential(torch.nn.Linear(2, 2)))


# ------------------------------------------------------------------------------------------------ algorithms


def _algorithm_of(module: str) -> str | None:
    """The algorithm module ``module`` belongs to (None for the package and its common modules)."""
    if not _under(module, "fedfuse.algorithms") or module in ALGORITHM_COMMONS:
        return None
    if module == "fedfuse.algorithms":
        return "(the registry)"
    name = module.split(".")[2]
    return COMPANIONS.get(name, name)


def _subclassed_parents(importer: str, imported: str, names: tuple[str, ...]) -> bool:
    """Whether every name ``importer`` takes from ``imported`` is an algorithm class that ``importer`` subclasses."""
    import importlib

    from fedfuse.algorithms.base import Algorithm

    if not names:  # ``import fedfuse.algorithms.x``: the whole module, not a parent class
        return False
    source, mod = importlib.import_module(imported), importlib.import_module(importer)
    own = [c for c in vars(mod).values() if isinstance(c, type) and c.__module__ == mod.__name__]
    for name in names:
        parent = getattr(source, name, None)
        if not (isinstance(parent, type) and issubclass(parent, Algorithm) and parent.__module__ == source.__name__):
            return False
        if not any(issubclass(c, parent) and c is not parent for c in own):
            return False
    return True


def test_no_algorithm_borrows_from_another():
    """Each algorithm's math lives in its own file; shared pieces live in fusion/ (tensor operators) or engine/
    (peers, topology, seeded initialisations, client-side helpers).  A variant may import another algorithm's
    class to subclass it, and nothing else from it: every name taken from another algorithm's module is an
    ``Algorithm`` subclass defined there that the importing module subclasses (no list to keep: a new FedAvg
    variant passes, a helper function or constant borrowed from another algorithm fails)."""
    bad = []
    for a in ARROWS:
        if a.importer == "fedfuse.algorithms":  # the registry discovers every algorithm
            continue
        src, dst = _algorithm_of(a.importer), _algorithm_of(a.module)
        if src is None or dst is None or src == dst:
            continue
        if dst == "(the registry)" or not _subclassed_parents(a.importer, a.module, a.names):
            bad.append(a)
    assert not bad, _report("an algorithm imports another algorithm's module for more than a parent class", bad)


def test_the_variant_rule_refuses_a_borrowed_helper_and_admits_a_subclass():
    """The rule on hand-picked arrows: FedAvg's class taken by a module that subclasses it passes; a function
    (FedProx's ``proximal_penalty``), a class the importer does not subclass and a bare module import fail."""
    assert _subclassed_parents("fedfuse.algorithms.fedbn", "fedfuse.algorithms.fedavg", ("FedAvg",))
    assert not _subclassed_parents("fedfuse.algorithms.fedbn", "fedfuse.algorithms.fedprox", ("proximal_penalty",))
    assert not _subclassed_parents("fedfuse.algorithms.fedbn", "fedfuse.algorithms.fedprox", ("FedProx",))
    assert not _subclassed_parents("fedfuse.algorithms.fedbn", "fedfuse.algorithms.fedavg", ())
