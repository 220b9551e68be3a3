"""Fit command lines checked as `esrl fit` checks them, without loading a model: what `esrl study` and `esrl sweep`
run before their first fit, so a bad value in run 7 of 12 (`model.es.sigma: abc`, `model.es.mode: lowrnk`, an
unknown task) is one line naming that run now, not a failed fit.log hours later.

Each command line goes through EsrlCLI as far as its checks go: the parser (types, choices, links, --ckpt_path),
before_instantiate_classes (strategy fitting, missing packages or GPUs, the output folder) and the module's and
data module's constructors (their config checks). It stops before the Trainer: models load in the module's
configure_model and data in the data module's setup, neither of which runs here.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import warnings
from collections.abc import Sequence

from esrl.errors import ConfigError, EsrlError


class _Checked(Exception):
    """The command line passed every check before the Trainer: stop there."""


def check_fit_args(runs: Sequence[tuple[str, list[str]]], defer: bool = False) -> EsrlError | None:
    """Each (run name, `esrl fit` arguments after `fit`) checked; the first refused raises ConfigError naming the run
    and esrl's own message, or with `defer` returns it (a dry run prints its plan first: planned where the runs will
    not run, a laptop without their GPUs, say). ES's notes on GRPO settings it replaces are the fit's to print."""
    try:
        _check(runs)
    except EsrlError as e:
        if not defer:
            raise
        return e
    return None


def _check(runs: Sequence[tuple[str, list[str]]]) -> None:
    if not runs:
        return
    from esrl.cli import EsrlCLI, attach_negative_numbers, one_line_classes
    from esrl.data import PromptDataModule
    from esrl.module_factory import build_module
    from esrl.parser_errors import one_line

    class CheckOnly(EsrlCLI):
        def instantiate_classes(self) -> None:
            one_line_classes(lambda: self.parser.instantiate_classes(self.config))  # their own checks, in one line
            raise _Checked

    seed_logger = logging.getLogger("lightning.fabric.utilities.seed")  # "Seed set to N", once per run
    level = seed_logger.level
    seed_logger.setLevel(logging.WARNING)
    try:
        for name, fit_args in runs:
            try:
                with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                    warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter is intended")
                    CheckOnly(build_module, PromptDataModule, seed_everything_default=0,
                              args=attach_negative_numbers(["fit", *fit_args]))
            except _Checked:
                continue
            except EsrlError as e:
                raise ConfigError(f"{name}: {e}") from None
            except argparse.ArgumentError as e:
                raise ConfigError(f"{name}: {one_line(getattr(e, 'message', e))}") from None
    finally:
        seed_logger.setLevel(level)
