"""The cells of a `fedfuse reproduce` output, for `fedfuse results record`: one line per (table, row) of
OUT/results.json whose table id matches TABLE_RE, as ``CELL<TAB>DIR DIR ...`` (the row's run directory per seed).

    python3 results/reproduction_cells.py OUT/results.json TABLE_RE CELL_TEMPLATE

CELL_TEMPLATE is formatted with TABLE_RE's named groups and ``label`` (the row), e.g.
``'mlp-sgd-(?P<clients>\\d+)clients-(?P<comms>\\d+)comms'`` with ``'clients={clients},comms={comms},method={label}'``.
The record-*.sh scripts read these lines and call `fedfuse results record` once per cell.
"""

from __future__ import annotations

import json
import re
import sys


def cells(results: dict, table_re: str, template: str) -> list[tuple[str, list[str]]]:
    """(cell, run directories) of every row of every table whose id matches ``table_re``."""
    out = []
    for tid, table in results.items():
        m = re.fullmatch(table_re, tid)
        if m:
            out += [(template.format(**m.groupdict(), label=label), [r["dir"] for r in runs])
                    for label, runs in table["runs"].items()]
    return out


if __name__ == "__main__":
    path, table_re, template = sys.argv[1:4]
    with open(path) as f:
        for cell, dirs in cells(json.load(f), table_re, template):
            print(f"{cell}\t{' '.join(dirs)}")
