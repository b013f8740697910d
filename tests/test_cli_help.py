"""Every subcommand's help: each flag documented, its default shown once; errors in a
subcommand print that subcommand's usage; serve refuses a bad model before it listens."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from rltjax.entrypoints.cli import build_parser, main


def flags(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "convert"])
def test_every_flag_has_one_help_line_with_its_default_once(command):
    _, commands = build_parser()
    parser = commands[command]
    formatter = parser._get_formatter()
    for action in flags(parser) + [a for a in parser._actions if not a.option_strings]:
        assert action.help, f"{command} {action.option_strings or action.dest}: no help"
        text = formatter._expand_help(action)
        assert text.count("default") <= 1, f"{command} {action.option_strings}: {text!r}"
        assert "\n" not in text and len(text) < 160, f"{command} {action.option_strings}: {text!r}"
        shown = action.default not in (None, False, argparse.SUPPRESS, [])
        if shown and action.option_strings and not isinstance(action.default, bool):
            assert "default" in text, f"{command} {action.option_strings}: its default {action.default!r} is not shown"


def test_a_subcommands_error_shows_its_own_usage():
    res = subprocess.run([sys.executable, "-m", "rltjax", "generate", "--bogus"], capture_output=True, text=True)
    assert res.returncode == 2
    assert "usage: rltjax generate" in res.stderr and "unrecognized arguments: --bogus" in res.stderr


def test_serve_refuses_a_missing_model_before_listening(tmp_path, capsys):
    rc = main(["serve", str(tmp_path / "missing"), "--port", "0", "--compilation-cache-dir", ""])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("does not exist") == 1 and "Uvicorn" not in err and "Started server" not in err
