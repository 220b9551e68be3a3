"""`esrl --help` is where a user finds the commands beside fit: each is listed, and each listed one runs."""

from __future__ import annotations

import pytest
from cli_runner import run_esrl

from esrl.cli import SUBCOMMANDS_HELP, TOOLS


def test_main_help_lists_every_other_command_with_its_summary():
    help_text = run_esrl("--help").stdout
    for name, (_, summary) in TOOLS.items():
        assert f"esrl {name}" in help_text and summary in help_text, name
    words = " ".join(help_text.split())  # argparse wraps the subcommands' lines
    for name, summary in SUBCOMMANDS_HELP.items():  # esrl's, not the Trainer methods' docstrings (one was cut)
        assert f"{name} {summary}" in words, name
    assert "Lightning Trainer command line tool" not in help_text and "make sure you never run" not in help_text


@pytest.mark.parametrize("name", sorted(TOOLS))
def test_each_listed_command_answers_its_own_help(name):
    result = run_esrl(name, "--help")
    assert result.returncode == 0, result.stderr
    assert f"usage: esrl {name}" in result.stdout
