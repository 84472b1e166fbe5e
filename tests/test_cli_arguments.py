"""Argument errors are one line (no usage block) and exit 2; an unknown flag, command or choice names the
closest known ones."""

from __future__ import annotations

import argparse

import pytest

from fedfuse.cli import LAZY, command_word, main, make_parser, unrecognized


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and "usage:" not in captured.err, captured.err
    return lines[0]


def test_a_misspelled_flag_gets_did_you_mean(capsys):
    assert _error(["run", "--rouns", "5"], capsys) == ("fedfuse: error: unrecognized argument --rouns; did you mean "
                                                       "--rounds? (see 'fedfuse run --help')")
    assert "did you mean --rounds?" in _error(["run", "--rouns=5"], capsys)
    assert "did you mean --algorithm?" in _error(["run", "--algoritm", "fedavg"], capsys)


def test_several_unknown_flags_each_get_their_hint(capsys):
    line = _error(["run", "--lrr", "0.1", "--rouns", "3", "--zzzzzz"], capsys)
    assert line == ("fedfuse: error: unrecognized arguments: --lrr (did you mean --lr?), --rouns (did you mean "
                    "--rounds?), --zzzzzz (see 'fedfuse run --help')")


def test_the_hint_comes_from_the_command_that_was_parsed(capsys):
    """A nested command's flags: ``results verify`` has --table, ``run`` has not."""
    line = _error(["results", "verify", "--tabel", "x"], capsys)
    assert "did you mean --table?" in line and "'fedfuse results verify --help'" in line


def test_a_type_error_is_one_line(capsys):
    assert _error(["run", "--rounds", "x"], capsys) == ("fedfuse: error: argument --rounds: invalid int value: 'x' "
                                                        "(see 'fedfuse run --help')")
    assert "invalid float value" in _error(["compare", "--algorithms", "fedavg", "--lr", "fast"], capsys)


def test_unknown_commands_and_choices_get_did_you_mean(capsys):
    assert "unknown command 'rnu'; did you mean run?" in _error(["rnu"], capsys)
    assert "did you mean algorithms?" in _error(["list", "algoritms"], capsys)
    assert "the following arguments are required: COMMAND" in _error([], capsys)
    assert "required: --algorithms" in _error(["compare"], capsys)


def test_a_stray_word_is_named(capsys):
    assert _error(["run", "fedprox"], capsys).startswith("fedfuse: error: unrecognized argument fedprox (")


def test_unrecognized_without_a_close_option():
    assert unrecognized(["--qqqq"], ["--rounds", "--lr"]) == "unrecognized argument --qqqq"
    assert unrecognized(["a", "b"], ["--rounds"]) == "unrecognized arguments a b"


def test_command_word_skips_top_level_options():
    assert command_word(["--debug", "run", "--rounds", "3"]) == "run"
    assert command_word(["--help"]) == "" and command_word([]) == ""


def test_placeholder_commands_match_the_full_parser():
    """``main`` builds a command's arguments only when it runs it; the placeholders other commands' parsers hold
    carry the same one-line help as the full commands."""
    def helps(p: argparse.ArgumentParser) -> dict[str, str | None]:
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        return {a.dest: a.help for a in sub._choices_actions}

    full, lean = make_parser(), make_parser("")
    assert helps(full) == helps(lean)
    for name, texts in LAZY.items():
        sub = next(a for a in full._actions if isinstance(a, argparse._SubParsersAction))
        assert sub.choices[name].description == texts.get("description"), name
