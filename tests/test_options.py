"""Declared options: help, choices and bounds come from one declaration."""

from dataclasses import dataclass

from fedfuse.options import check_value, describe, opt


@dataclass
class _Opts:
    mu: float = opt(0.01, "proximal coefficient", ge=0.0)
    topology: str = opt("full", "peer graph", choices=("full", "ring"))
    widths: list[int] = opt([64, 64], "hidden widths")
    plain: int = 3


def test_describe_and_defaults():
    info = {o.name: o for o in describe(_Opts)}
    assert info["mu"].help == "proximal coefficient" and info["mu"].bounds == ">= 0.0"
    assert info["topology"].choices == ("full", "ring")
    assert info["widths"].default == [64, 64] and info["plain"].help == ""
    a, b = _Opts(), _Opts()
    a.widths.append(1)
    assert b.widths == [64, 64]  # mutable defaults are per instance


def test_check_value():
    assert check_value(_Opts, "mu", 0.1) is None
    assert "must be >= 0.0" in check_value(_Opts, "mu", -1.0)
    assert "full, ring" in check_value(_Opts, "topology", "star")
    assert check_value(_Opts, "plain", -5) is None
