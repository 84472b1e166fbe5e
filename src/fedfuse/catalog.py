"""What ``fedfuse list`` and ``fedfuse show`` print: every algorithm, model, dataset and partition with its options.

The registries behind it import torch (and an algorithm may import more), which costs seconds of CPU before a
command that only prints text.  So the command line reads a snapshot, ``catalog.json`` beside this module: every
component exactly as :func:`components` builds it from the registries (its options, and an algorithm's privacy
lines as ``fedfuse show`` prints them).  ``python -m fedfuse.catalog`` writes it; ``tests/test_catalog.py`` checks
that it equals what the registries say now and that ``fedfuse show`` prints the same text from either, so the
snapshot cannot drift.  When ``fedfuse/algorithms/`` holds an algorithm module the snapshot does not know (one
added in a new file, as docs/extending.md describes), the command line reads the registries instead: slower,
never stale.  The Python API (:func:`fedfuse.show`) always reads the registries.

``show config`` (the top-level keys) is built from :class:`~fedfuse.config.RunConfig` every time: the
configuration imports no torch.
"""

from __future__ import annotations

import json
import math
import shutil
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedfuse.options import OptionInfo, describe

if TYPE_CHECKING:  # pragma: no cover
    from fedfuse.types import Privacy

#: the snapshot the command line reads (written by ``python -m fedfuse.catalog``)
CATALOG_FILE = Path(__file__).with_name("catalog.json")
#: the kinds, in the order ``fedfuse list`` prints them (section title → kind)
SECTIONS = {"algorithms": "algorithm", "datasets": "dataset", "partitions": "partition", "models": "model"}
#: how a run requests each mechanism, and its name in the privacy table
MECHANISM_LABELS = {"central_dp": ("central DP", "dp=central"), "local_dp": ("local DP", "dp=local"),
                    "secagg": ("SecAgg", "secagg=true")}


# ---- one component ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    """An algorithm, model, dataset, partition or the run configuration itself, with its options."""

    kind: str  # "algorithm", "model", "dataset", "partition" or "config"
    name: str
    description: str
    namespace: str  # where its options go in a config: "algorithm_options", ... ("" for top-level keys)
    options: list[OptionInfo]
    privacy: tuple[Privacy, ...] = ()  # an algorithm's declared privacy entries (docs/privacy.md)
    #: the privacy lines as printed, for a component read from the snapshot (which holds no ``Privacy`` objects)
    privacy_text: tuple[str, ...] = field(default=(), compare=False)

    def privacy_lines(self) -> list[str]:
        """The lines ``fedfuse show`` prints under the component's name for its privacy declaration."""
        return [line for e in self.privacy for line in privacy_lines(e)] or list(self.privacy_text)

    def format(self) -> str:
        """The text ``fedfuse show`` prints."""
        head = f"{self.name} ({self.kind}): {self.description}".rstrip(": ")
        head += "".join("\n" + line for line in self.privacy_lines())
        if not self.options:
            return head + "\n  (no options)"
        prefix = self.name if self.kind == "algorithm" else self.namespace
        where = (f"set with --set {prefix}.NAME=VALUE (or NAME=VALUE), or under '{self.namespace}:' in a --config "
                 "file" if self.namespace else
                 "set with a flag, --set NAME=VALUE, or as a top-level key of a --config file")
        rows = [(o.name, o.type, show_default(o.default), _show_help(o)) for o in self.options]
        w = [max(len(r[i]) for r in [*rows, ("option", "type", "default", "")]) for i in range(3)]
        lines = [head, f"  options ({where}):",
                 f"    {'option':<{w[0]}}  {'type':<{w[1]}}  {'default':<{w[2]}}  help"]
        indent = 4 + w[0] + w[1] + w[2] + 6
        width = max(shutil.get_terminal_size((120, 24)).columns, indent + 40)
        for a, b, c, d in rows:
            wrapped = textwrap.wrap(d, width - indent) or [""]
            lines.append(f"    {a:<{w[0]}}  {b:<{w[1]}}  {c:<{w[2]}}  {wrapped[0]}".rstrip())
            lines += [" " * indent + more for more in wrapped[1:]]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The component as the snapshot stores it (privacy as its printed lines)."""
        return {"kind": self.kind, "name": self.name, "description": self.description, "namespace": self.namespace,
                "options": [[o.name, o.type, o.default, o.help, None if o.choices is None else list(o.choices),
                             o.bounds] for o in self.options],
                "privacy": self.privacy_lines()}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Component:
        opts = [OptionInfo(n, t, dflt, h, None if ch is None else tuple(ch), b)
                for n, t, dflt, h, ch, b in d["options"]]
        return cls(d["kind"], d["name"], d["description"], d["namespace"], opts,
                   privacy_text=tuple(d["privacy"]))


def when_text(entry: Privacy) -> str:
    """The options under which a privacy entry holds, as ``key=value`` pairs."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in entry.when)


def privacy_lines(entry: Privacy) -> list[str]:
    """The lines ``fedfuse show`` prints for one declared privacy entry."""
    when = f" (with {when_text(entry)})" if entry.when else ""
    lines = [f"  privacy{when}: the server must see {entry.view.value}: {entry.why}"]
    for mech, (label, flag) in MECHANISM_LABELS.items():
        v = entry.admits(mech)
        lines.append(f"    {label + ' (' + flag + ')':<28} {v.support.value}: {v.why}")
    return lines


def show_default(v: Any) -> str:
    """A default as ``fedfuse show`` prints it."""
    if v is None:
        return "none"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and math.isfinite(v):
        return human_number(v)
    return json.dumps(v) if isinstance(v, list | dict | tuple) else str(v)


def human_number(v: float) -> str:
    """A float as a person writes it: ``0.1``, ``1e-05``, ``0.8333`` (not ``0.8333333333333334``)."""
    text = repr(v)
    return text if len(text) <= 8 else f"{v:.4g}"


def _show_help(o: OptionInfo) -> str:
    extra = []
    if o.choices:
        extra.append("one of " + ", ".join(map(str, o.choices)))
    if o.bounds:
        extra.append(o.bounds)
    text = o.help or ""
    return f"{text} [{'; '.join(extra)}]".strip() if extra else text


def from_defaults(defaults: Mapping[str, Any], helps: Mapping[str, tuple[str, str]] | None = None
                  ) -> list[OptionInfo]:
    """Options declared by their defaults plus a help table (name → (type, help line)); without an entry the
    type is the default's."""
    def tname(v: Any) -> str:
        if isinstance(v, tuple | list):
            return "list"
        return "any" if v is None else type(v).__name__

    helps = helps or {}
    return [OptionInfo(k, helps.get(k, (tname(v), ""))[0], v, helps.get(k, ("", ""))[1], None, "")
            for k, v in defaults.items()]


def config_component() -> Component:
    """The top-level run keys (``fedfuse show config``), from the configuration's own declarations."""
    from fedfuse.config import FLAGS, RunConfig

    flag_help = {key: h for key, _, h in FLAGS.values()}
    opts = [o if o.help else OptionInfo(o.name, o.type, o.default, flag_help.get(o.name, ""), o.choices, o.bounds)
            for o in describe(RunConfig)]
    return Component("config", "config", "top-level run configuration keys", "", opts)


# ---- every component: from the registries, or from the snapshot -----------------------------------------------
def live() -> list[Component]:
    """Every algorithm, dataset, partition and model, read from the registries (imports them all)."""
    from fedfuse.algorithms import ALGORITHMS
    from fedfuse.data.datasets import DATASETS, dataset_options
    from fedfuse.data.datasets import OPTION_HELP as DATASET_HELP
    from fedfuse.data.partition import OPTION_HELP as PARTITION_HELP
    from fedfuse.data.partition import PARTITIONS, partition_options
    from fedfuse.models import MODELS, model_options
    from fedfuse.models.registry import OPTION_HELP as MODEL_HELP

    out = [Component("algorithm", name, cls.description, "algorithm_options", describe(cls.Options),
                     tuple(getattr(cls, "privacy", ()))) for name, cls in sorted(ALGORITHMS.items())]
    out += [Component("dataset", name, info.description, "dataset_options",
                      from_defaults(dataset_options(name), DATASET_HELP)) for name, info in sorted(DATASETS.items())]
    out += [Component("partition", name, text, "partition_options", from_defaults(partition_options(name),
                                                                                 PARTITION_HELP))
            for name, text in sorted(PARTITIONS.items())]
    out += [Component("model", name, info.description, "model_options",
                      from_defaults(model_options(name), MODEL_HELP)) for name, info in sorted(MODELS.items())]
    return out


def snapshot() -> dict[str, Any]:
    """The snapshot :func:`write` stores: every component of :func:`live` and the algorithm modules it read."""
    return {"algorithm_modules": _algorithm_files(), "components": [c.to_dict() for c in live()]}


def write(path: str | Path = CATALOG_FILE) -> bool:
    """Write the snapshot to ``path`` (default: the one the command line reads); True if it changed."""
    path = Path(path)
    text = _dumps(snapshot())
    old = path.read_text(encoding="utf-8") if path.exists() else None
    if text != old:
        path.write_text(text, encoding="utf-8")
    return text != old


def _dumps(data: dict[str, Any]) -> str:
    """The snapshot as JSON with one component field, option or privacy line per line (a change reads as the
    lines of what changed)."""
    def one(v: Any) -> str:
        return json.dumps(v, ensure_ascii=False)

    comps = []
    for c in data["components"]:
        head = ", ".join(f"{one(k)}: {one(c[k])}" for k in ("kind", "name", "description", "namespace"))
        opts = ",\n".join(f"    {one(o)}" for o in c["options"])
        priv = ",\n".join(f"    {one(line)}" for line in c["privacy"])
        comps.append(f"  {{{head},\n   \"options\": [\n{opts}\n   ],\n   \"privacy\": [\n{priv}\n   ]}}")
    return (f"{{\"algorithm_modules\": {one(data['algorithm_modules'])},\n \"components\": [\n"
            + ",\n".join(comps) + "\n ]}\n")


def _algorithm_files() -> list[str]:
    """The algorithm module names in ``fedfuse/algorithms/`` (the registry's discovery rule, without importing
    a module: its ``_``-prefixed modules and the shared ``base``/``lora_base``/``mean_base`` are not algorithms)."""
    folder = Path(__file__).with_name("algorithms")
    names = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    return sorted(n for n in names if not n.startswith("_") and n not in ("base", "lora_base", "mean_base"))


def recorded() -> list[Component] | None:
    """The components of the snapshot, or None when there is none or it does not know an algorithm module that
    is there now (or knows one that is gone)."""
    try:
        data = json.loads(CATALOG_FILE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if data.get("algorithm_modules") != _algorithm_files():
        return None
    return [Component.from_dict(d) for d in data["components"]]


def catalog(fast: bool = True) -> list[Component]:
    """Every component: from the snapshot when ``fast`` and it is current, else from the registries."""
    return (recorded() if fast else None) or live()


def listing(comps: Iterable[Component]) -> dict[str, dict[str, Component]]:
    """Section title (``algorithms``, ...) → name → component, in ``fedfuse list``'s order."""
    by_kind: dict[str, dict[str, Component]] = {title: {} for title in SECTIONS}
    titles = {kind: title for title, kind in SECTIONS.items()}
    for c in comps:
        by_kind[titles[c.kind]][c.name] = c
    return {title: dict(sorted(items.items())) for title, items in by_kind.items()}


def find(name: str, kind: str | None, comps: Sequence[Component]) -> list[Component]:
    """Every component called ``name`` (case and ``_``/``-`` forgiven; only those of ``kind`` when given), with
    ``config`` for the top-level keys.  Raises ``KeyError`` with the closest names when nothing matches."""
    from fedfuse.names import canonical, unknown

    every = sorted({*(c.name for c in comps), "config"})
    name = canonical(name, every) or name
    found: list[Component] = []
    if kind in (None, "config") and name in ("config", "run"):
        found.append(config_component())
    order = ("algorithm", "model", "dataset", "partition")
    found += sorted((c for c in comps if c.name == name and kind in (None, c.kind)), key=lambda c: order.index(c.kind))
    if not found:
        raise KeyError(unknown(kind or "name", name, every,
                               listing="fedfuse list; 'fedfuse show config' for the run's own keys"))
    return found


if __name__ == "__main__":  # python -m fedfuse.catalog: rewrite the snapshot after changing a component
    print(f"{'wrote' if write() else 'unchanged'}: {CATALOG_FILE}")
