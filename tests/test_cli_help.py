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


@pytest.mark.parametrize("section, cls", [("model.es", "esrl.es.config.ESConfig"),
                                          ("model.grpo", "esrl.grpo.config.GRPOConfig"),
                                          ("model.rollout", "esrl.rollout.base.RolloutConfig"),
                                          ("model.policy", "esrl.policy.PolicyConfig")])
def test_every_config_field_has_its_documentation_in_the_help(section, cls):
    """Each field's docstring (the documentation under it in its dataclass) is its --help text, not only its type."""
    import dataclasses
    import importlib

    module, _, name = cls.rpartition(".")
    fields = [f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))]
    out = run_esrl("fit", f"--{section}.help", cls)
    assert out.returncode == 0, out.stderr
    entries = {}
    for entry in out.stdout.split(f"\n  --{section}.")[1:]:
        key, _, rest = entry.partition(" ")
        entries[key] = " ".join(rest.split())
    for field in fields:
        described = entries[field].split("(type:")[0].split(maxsplit=1)[1:]  # after the metavar
        assert described and len(described[0]) > 10, (field, entries[field])
