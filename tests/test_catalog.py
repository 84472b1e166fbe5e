"""The catalog ``fedfuse list``/``show`` read: the snapshot equals the registries, prints the same text, and is
not used when an algorithm module it does not know is there."""

from __future__ import annotations

import json
import pkgutil

import pytest

from fedfuse import catalog
from fedfuse.cli import main


def test_snapshot_equals_the_registries():
    stored = json.loads(catalog.CATALOG_FILE.read_text(encoding="utf-8"))
    now = json.loads(json.dumps(catalog.snapshot()))
    stale = sorted({c["name"] for c in now["components"]} ^ {c["name"] for c in stored["components"]}
                   | {a["name"] for a, b in zip(now["components"], stored["components"], strict=False) if a != b})
    assert stored == now, (f"src/fedfuse/catalog.json is stale ({', '.join(stale) or 'module list'}): "
                           "run `python -m fedfuse.catalog`")


def test_show_prints_the_same_from_the_snapshot_and_the_registries():
    recorded, live = catalog.recorded(), catalog.live()
    assert recorded is not None
    assert [(c.kind, c.name) for c in recorded] == [(c.kind, c.name) for c in live]
    assert len(recorded) > 60  # every algorithm, dataset, partition and model
    for r, c in zip(recorded, live, strict=True):
        assert r.format() == c.format(), c.name
    fedmr = next(c for c in recorded if c.name == "fedmr")
    assert any("privacy" in line for line in fedmr.privacy_lines())  # privacy lines survive the snapshot


def test_snapshot_knows_the_modules_the_registry_discovers():
    import fedfuse.algorithms as registry

    discovered = sorted(m.name for m in pkgutil.iter_modules(registry.__path__)
                        if not m.name.startswith("_") and m.name not in registry.COMMONS)
    assert catalog._algorithm_files() == discovered
    assert {cls.__module__.rsplit(".", 1)[1] for cls in registry.ALGORITHMS.values()} <= set(discovered)


def test_a_new_algorithm_module_makes_the_cli_read_the_registries(monkeypatch, capsys):
    """An algorithm added in a new file (docs/extending.md) is listed at once: the snapshot does not know its
    module, so the command line reads the registries instead."""
    files = catalog._algorithm_files()
    monkeypatch.setattr(catalog, "_algorithm_files", lambda: [*files, "fedmine"])
    assert catalog.recorded() is None
    calls = []
    live = catalog.live
    monkeypatch.setattr(catalog, "live", lambda: calls.append(1) or live())
    assert main(["show", "fedprox"]) == 0
    assert calls == [1] and "proximal" in capsys.readouterr().out


def test_a_missing_or_broken_snapshot_reads_the_registries(monkeypatch, tmp_path):
    monkeypatch.setattr(catalog, "CATALOG_FILE", tmp_path / "catalog.json")
    assert catalog.recorded() is None
    (tmp_path / "catalog.json").write_text("{not json")
    assert catalog.recorded() is None
    assert [c.name for c in catalog.catalog()] == [c.name for c in catalog.live()]


def test_write_reports_whether_it_changed(tmp_path):
    path = tmp_path / "catalog.json"
    assert catalog.write(path) is True
    assert catalog.write(path) is False
    assert path.read_text(encoding="utf-8") == catalog.CATALOG_FILE.read_text(encoding="utf-8")


@pytest.mark.parametrize("name,kind,kinds", [("fedprox", None, ["algorithm"]), ("config", None, ["config"]),
                                             ("CNN", "model", ["model"]), ("Dirichlet", None, ["partition"])])
def test_find_forgives_case_and_filters_by_kind(name, kind, kinds):
    assert [c.kind for c in catalog.find(name, kind, catalog.catalog())] == kinds


def test_find_names_the_closest_on_a_typo():
    with pytest.raises(KeyError, match="did you mean fedprox"):
        catalog.find("fedprxo", None, catalog.catalog())
