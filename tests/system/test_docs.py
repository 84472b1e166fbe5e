"""The documentation stays true to the code: every relative link and anchor resolves, and every ``fedfuse``
command written in a ``bash`` block of README.md or docs/ parses with today's command line (a renamed or
removed flag in a documented command is a test failure, not a surprise for a user who copies it)."""

from __future__ import annotations

import re
import shlex
import textwrap
from pathlib import Path

import pytest

from fedfuse.cli import build_config, make_parser
from fedfuse.config import ConfigError
from support import ROOT

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```bash\n(.*?)```", re.S)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)  # a '#' line in a code block is no heading
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+://|mailto:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(doc: Path) -> None:
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
    assert not broken, "\n".join(broken)


def commands(doc: Path) -> list[str]:
    """The ``fedfuse …`` commands of the doc's bash blocks: continuation lines joined; comments, optional
    ``[--flag …]`` groups and ``...`` elisions dropped (what is left must parse)."""
    out = []
    for block in FENCE.findall(doc.read_text()):
        lines, held = [], ""
        for line in block.replace("\\\n", " ").splitlines():  # a quoted value may span lines
            held = f"{held} {line}" if held else line
            if held.count("'") % 2 == 0 and held.count('"') % 2 == 0:
                lines.append(held)
                held = ""
        for line in lines:
            line = re.sub(r"\s#.*$", "", line)
            line = re.sub(r"\s\[--[^\]]*\]|\.\.\.|…", " ", line).strip()  # optional [--flag …] groups, elisions
            for part in re.split(r"&&|;|\|", line):
                part = part.strip()
                if part.startswith("fedfuse "):
                    out.append(part)
    return out


#: A value the reader fills in (a shell variable, ``<run-dir>``, NAME): such a command is not checked.
PLACEHOLDER = re.compile(r"\$|<[A-Za-z]|\bNAME\b|\bDIR\b|\bFILE\b")


def documented_commands() -> list[tuple[str, str]]:
    return [(doc.name, c) for doc in DOCS for c in commands(doc) if not PLACEHOLDER.search(c)]


def test_docs_hold_fedfuse_commands() -> None:
    """The parser test below is not vacuous: the docs hold many runnable commands."""
    assert len(documented_commands()) > 50


@pytest.mark.parametrize("doc,command", documented_commands(), ids=lambda v: v[:60] if isinstance(v, str) else v)
def test_documented_command_parses(doc: str, command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = make_parser()
    argv = shlex.split(command)[1:]
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse reports an unknown flag, a bad choice or a missing argument this way
        if e.code == 0:  # --help
            return
        pytest.fail(f"{doc}: `{command}` does not parse: {capsys.readouterr().err.strip()[-300:]} ({e.code})")
    if args.command == "run" and not (args.config or args.resume):
        try:  # the configuration it builds is valid: algorithm, model, dataset, partition, every --set key
            build_config(args)
        except (ConfigError, ValueError, KeyError) as e:
            pytest.fail(f"{doc}: `{command}` builds no valid configuration: {e}")


def python_blocks() -> list[tuple[str, int, str]]:
    return [(doc.name, i, textwrap.dedent(b))
            for doc in DOCS for i, b in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S))]


def test_python_blocks_compile() -> None:
    """Every ``python`` block of README.md and docs/ is valid Python (indented snippets dedented)."""
    blocks = python_blocks()
    assert blocks
    for doc, i, code in blocks:
        try:
            compile(code, f"{doc} block {i}", "exec")
        except SyntaxError as e:
            pytest.fail(f"{doc}, python block {i}: {e}")


def _shape(command: str) -> tuple[str, ...]:
    """A command with the values of its ``--set``/``--grid`` options left out (their keys kept)."""
    argv = shlex.split(command)
    out = []
    for i, tok in enumerate(argv):
        if i and argv[i - 1] in ("--set", "--grid") and "=" in tok:
            tok = tok.split("=", 1)[0] + "=…"
        out.append(tok)
    return tuple(out)


def test_the_same_command_has_the_same_option_values_everywhere() -> None:
    """A command shown in two places (README and docs/api.md's compare examples) that differs only in an option
    value is one of them out of date (issue #43: `--set fedprox.mu=0.01` in the README, `0.1` in docs/api.md)."""
    seen: dict[tuple[str, ...], tuple[str, str]] = {}
    clashes = []
    for doc, command in documented_commands():
        first = seen.setdefault(_shape(command), (doc, command))
        if shlex.split(first[1]) != shlex.split(command):
            clashes.append(f"{first[0]}: `{first[1]}`\n    {doc}: `{command}`")
    assert not clashes, "the same command with other option values:\n  " + "\n  ".join(clashes)
