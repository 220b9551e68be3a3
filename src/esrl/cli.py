"""`esrl`: LightningCLI with fit / validate / test, one flag (--algo) to swap ES and GRPO."""

from __future__ import annotations

import argparse
import difflib
import logging
import os
import re
import sys
from pathlib import Path
import warnings

from jsonargparse import DefaultHelpFormatter, set_parsing_settings
from lightning.pytorch.cli import LightningCLI
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

import esrl.es.strategy  # noqa: F401  registers the `es` strategy
from esrl.callbacks import interruption
from esrl.callbacks.interruption import EXIT_CODES
from esrl.checkpoints import check_ckpt_path, check_root_dir, deepspeed_folder, resolve_last
from esrl.data import PromptDataModule
from esrl.config_files import MODE as CONFIG_MODE
from esrl.errors import ConfigError, EsrlError, read_text
from esrl.module_factory import build_module, fit_trainer_to_algo
from esrl.parser_errors import help_hint, one_line
from esrl.resume import (ResumePlan, config_file_arg, explicit_fields, load_deepspeed_for_plan, load_for_plan,
                         plan_resume, resumed_version)
from esrl.needs import check as check_needs
from esrl.needs import check_scorer


# Config fields are documented by the docstring under each (TRL's style); --help shows them (no slower here).
set_parsing_settings(docstring_parse_attribute_docstrings=True)


class EsrlCLI(LightningCLI):
    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """fit, validate and test: esrl's modules generate and score in their steps, they have no `predict`."""
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name != "predict"}

    def init_parser(self, **kwargs):
        """Every parser (main and subcommands) reads config files through esrl.config_files, so a YAML error
        names its file, and raise their errors for main() to print in one line."""
        kwargs.setdefault("parser_mode", CONFIG_MODE)
        kwargs.setdefault("exit_on_error", False)  # main() prints parser errors as one line (esrl.parser_errors)
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser, args) -> None:
        """Then --ckpt_path checked (esrl.checkpoints; `last`: the run root's newest checkpoint), before LightningCLI
        reads its hyperparameters with torch.load: a missing, truncated or garbage file is one line naming it."""
        argv = [str(a) for a in (sys.argv[1:] if args is None else args)] if args is None or isinstance(args, list) \
            else []
        for i in range(len(argv)):  # jsonargparse's reading of a binary config file was a UnicodeDecodeError
            if (path := config_file_arg(argv, i)) and os.path.isfile(path):  # False for inline YAML of any length
                read_text(path, "--config")
        if any(a == "--print_config" or a.startswith("--print_config=") for a in argv):  # printed at parse time
            print("esrl: --print_config prints the values as given; a fit checks them when it starts (before any "
                  "model loads)", file=sys.stderr)
        super().parse_arguments(parser, args)
        self._resume = None
        if self.config.get("subcommand"):
            config = self.config[self.config.subcommand]
            if config.get("ckpt_path") == "last":  # the run root's newest, not Lightning's (esrl.checkpoints)
                config.ckpt_path = resolve_last(config.trainer.as_dict())
            check_ckpt_path(config.get("ckpt_path"))
            if str(config.get("ckpt_path") or "").startswith("~"):  # LightningCLI's restore of the checkpoint's
                config.ckpt_path = str(Path(config.ckpt_path).expanduser())  # settings reads the path unexpanded
            # What the user gave vs the checkpoint's settings (esrl.resume): conflicts stop here, in one line.
            path = Path(str(config.ckpt_path)) if config.get("ckpt_path") else None  # ~ expanded above
            folder = path is not None and deepspeed_folder(path)  # DeepSpeed's: its settings in DeepSpeed's files
            ckpt = None if path is None else load_deepspeed_for_plan(path) if folder else load_for_plan(str(path))
            if ckpt is not None:
                written = explicit_fields(argv)
                self._resume = plan_resume(config.ckpt_path, ckpt, config.as_dict(), self.seed_everything_default,
                                           written)
                config.seed_everything = self._resume.seed
                self._resume.run_dir = ckpt.get("esrl_run_dir") or str(Path(config.ckpt_path).parent.parent)
            elif folder:  # its settings did not load (esrl.resume.load_deepspeed_for_plan): not compared
                self._resume = ResumePlan({}, config.get("seed_everything"))
                self._resume.run_dir = str(path.parent.parent)  # its run folder goes on (one history)

    def instantiate_classes(self) -> None:
        one_line_classes(super().instantiate_classes)

    def instantiate_trainer(self, **kwargs):
        """Lightning's Trainer; a setting it refuses (a strategy name, devices for the accelerator) is one line
        naming the trainer section, as esrl's own config errors are, not a traceback."""
        try:
            return super().instantiate_trainer(**kwargs)
        except EsrlError:
            raise
        except (ValueError, MisconfigurationException) as e:
            raise ConfigError(f"trainer: {one_line(e)}") from None

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_argument("--algo", choices=["es", "grpo"], default="es",
                            help="Optimizer family: es (evolution strategies) or grpo.")
        parser.link_arguments("algo", "model.algo", apply_on="parse")
        # --optimizer / --lr_scheduler reach the module as callables (model.optimizer, model.lr_scheduler), not
        # as LightningCLI's automatic ones: those are built over model.parameters() before fit, but esrl builds
        # the policy in configure_model (so ZeRO-3 can shard it), so the module builds them in
        # configure_optimizers, over the trainable parameters that exist by then.
        parser.add_optimizer_args((Optimizer,), link_to="model.optimizer")
        # LRScheduler alone (ReduceLROnPlateau is one since torch 2.2, refused by GRPOModule): a missing argument's
        # message then names no second base class
        parser.add_lr_scheduler_args((LRScheduler,), link_to="model.lr_scheduler")

    def _scorer_answers(self) -> None:
        """A scorer that is down: one line before any model loads (they load in trainer.fit's configure_model). Not in
        before_instantiate_classes: `esrl study`/`sweep`'s and --print_config's checks stop after the constructors."""
        check_scorer(self.config[self.subcommand].as_dict())

    before_fit = before_validate = before_test = _scorer_answers

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        for field, value in (self._resume.overrides if self._resume else {}).items():
            config[field] = value  # given values that may change on resume win over the checkpoint's (esrl.resume)
        trainer = config.trainer
        # ES needs its own strategy and no gradient settings; GRPO uses Lightning's strategies (module_factory).
        notes = fit_trainer_to_algo(config.algo, trainer)
        if config.algo == "es" and config.model.rollout and config.model.rollout.vllm_sleep:  # ES would refuse it
            config.model.rollout.vllm_sleep = False
            notes.append("model.rollout.vllm_sleep dropped (the engine sleeps through a backward)")
        if notes:
            print(f"esrl: --algo {config.algo}: {'; '.join(notes)} (GRPO settings; ES has no gradient)",
                  file=sys.stderr)
        check_needs(config.as_dict())  # a missing package or GPU: one line now, before any model loads
        check_root_dir(trainer.default_root_dir)  # below a file: one line, not makedirs' traceback at setup
        if self.subcommand == "fit" and trainer.limit_val_batches is None:
            trainer.limit_val_batches = 0  # fit evaluates through the Evaluation callback, on steps not epochs
        if trainer.logger in (None, True):
            root = trainer.default_root_dir or "runs"
            # Resumed: the checkpoint's own version folder, so metrics.csv, eval.jsonl and seed_log.jsonl stay one
            # history (esrl.callbacks.interruption); a checkpoint of another root starts a new version here.
            version = (resumed_version(self._resume.run_dir, root)
                       if self._resume and self.subcommand == "fit" else None)
            trainer.logger = [
                {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": root,
                                                                                   "version": version}},
                {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                 "init_args": {"save_dir": root, "name": "tensorboard", "version": version}},
            ]


# Commands beside LightningCLI's fit/validate/test: name -> ("module:function(argv)", what `esrl --help` says of it).
TOOLS = {
    "export": ("esrl.export:main", "rebuild an ES-trained model at any step from its base and seed log"),
    "serve-scorer": ("esrl.scoring.service:main", "a scorer (reward, cost, judge models) behind HTTP"),
    "analyze": ("esrl.analysis.cli:main", "weight-space analyses of trained checkpoints (JSON and PNG plots)"),
    "sweep": ("esrl.sweep:main", "a small grid over any config keys, run locally, summarized in a table"),
    "study": ("esrl.study.cli:main", "every (algorithm, grid point, seed) as its own fit, then one report"),
    "elo": ("esrl.elo:main", "a held-out judge's Elo tournament between models' completion files"),
    "env": ("esrl.env:main", "versions, devices and caches for a bug report; what a config needs here"),
}
TOOLS_HELP = "other commands (each with --help):\n" + "\n".join(
    f"  esrl {name:<13} {summary}" for name, (_, summary) in TOOLS.items())


DESCRIPTION = "esrl: post-train a language model with Evolution Strategies or GRPO (--algo) on one Lightning Trainer."
SUBCOMMANDS_HELP = {  # instead of the Trainer methods' first docstring lines, which say nothing of esrl (and cut one)
    "fit": "train with --algo es or grpo, evaluating through the Evaluation callback; --ckpt_path resumes",
    "validate": "evaluate the policy on the task's eval prompts, without training",
    "test": "the same evaluation, logged as test",
}


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, with the epilog's lines (TOOLS_HELP) kept as written and esrl's subcommand lines."""

    def _get_help_string(self, action) -> str:
        if isinstance(action.dest, str) and action.dest in SUBCOMMANDS_HELP and not action.option_strings:
            return SUBCOMMANDS_HELP[action.dest]
        return super()._get_help_string(action)


def misplaced_command(argv: list[str]) -> str | None:
    """What is wrong with a command line whose command is unknown ("analysis") or comes after options
    (`esrl --config x.yaml fit`), else None: the parser would list Trainer subcommands only, or blame an option."""
    commands = ["fit", "validate", "test", *TOOLS]
    if not argv or argv[0] in commands or argv[0] in ("-h", "--help", "--version"):
        return None
    if not argv[0].startswith("-"):
        close = difflib.get_close_matches(argv[0], commands, n=1)
        return (f"unknown command {argv[0]!r}" + (f" (did you mean {close[0]}?)" if close else "")
                + f"; the commands: {', '.join(commands)}")
    later = next((a for a in argv if a in commands), None)
    if later is None or argv[0] not in ("--config", "-c") or len(argv) < 2 or _has_section(argv[1], later):
        return None  # LightningCLI's own global config (a `fit:` section) is fine before the command
    return f"options go after the command: esrl {later} {' '.join(a for a in argv if a != later)}".rstrip()


def _has_section(config: str, command: str) -> bool:
    """Whether a config file holds a `command:` section (LightningCLI's global config form); False if unreadable."""
    import yaml

    try:
        data = yaml.safe_load(Path(config).read_text() if Path(config).is_file() else config)  # a file, or inline
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and command in data


def _run_tool(name: str, argv: list[str]) -> None:
    import importlib

    module, _, func = TOOLS[name][0].partition(":")
    getattr(importlib.import_module(module), func)(argv)


def one_line_classes(instantiate) -> None:
    """The config's classes instantiated; one that refuses its arguments inside a list jsonargparse tries as a Union
    (a callback's own check: Evaluation's pass_k) is one line naming it, not jsonargparse's Union report."""
    try:
        instantiate()
    except ValueError as e:
        cause = e
        while cause.__cause__ is not None and not isinstance(cause, EsrlError):
            cause = cause.__cause__
        if cause is e:
            raise
        where = re.search(r"class_path='([^']+)'", str(e))
        raise ConfigError(f"trainer.callbacks{f' ({where.group(1)})' if where else ''}: {cause}") from None


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


def attach_negative_numbers(argv: list[str]) -> list[str]:
    """`--model.es.sigma -1e-3` as `--model.es.sigma=-1e-3`: Python 3.11's argparse takes a negative number in
    scientific notation for an option (and says the flag before it "expected one argument"); the value is left for
    the field's own check to judge."""
    out: list[str] = []
    for arg in argv:
        if out and _NEGATIVE_NUMBER.match(arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


LIGHTNING_NOISE = re.compile("|".join([
    r"💡 Tip:",  # "try installing litlogger": an advertisement in every run's log
    r"Detected KeyboardInterrupt",  # "attempting graceful shutdown": esrl.entry says "esrl: interrupted (Ctrl+C)"
    r"Received SIGTERM",  # its SIGTERM handler, which esrl.callbacks.interruption calls after its own line (Ctrl+C too)
    r"MEMBER: 1/1$", r"Starting with 1 processes\n",  # ES's strategy makes a process group of one on one device
    r"override existing callbacks passed to Trainer: RichProgressBar$",  # esrl's step bar (PolicyModule)
]))
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.pytorch.trainer.connectors.signal_connector",
                     "lightning.fabric.utilities.distributed")


def not_lightning_noise(record: logging.LogRecord) -> bool:
    """Lightning's log lines that say nothing to an esrl user, or the wrong thing (LIGHTNING_NOISE)."""
    return not LIGHTNING_NOISE.search(record.getMessage())


def main(args: list[str] | None = None) -> None:
    argv = attach_negative_numbers(sys.argv[1:] if args is None else [str(a) for a in args])
    misplaced = misplaced_command(argv)
    if misplaced:
        print(f"esrl: error: {misplaced}", file=sys.stderr)
        raise SystemExit(2)
    if argv and argv[0] in TOOLS:
        try:
            _run_tool(argv[0], argv[1:])
        except EsrlError as e:
            print(f"esrl {argv[0]}: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
        return
    # Generation runs the policy in eval mode on purpose; ES logs one row per step on purpose.
    warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
    warnings.filterwarnings("ignore", message=r".*smaller than the logging interval.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
    # ES steps its optimizer by hand; the checkpoint after the step is the one it resumes from (esrl.resume)
    warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")
    for name in LIGHTNING_LOGGERS:
        logging.getLogger(name).addFilter(not_lightning_noise)
    # argv is sys.argv's own (attach_negative_numbers may have joined a flag and its value): not a mistake
    warnings.filterwarnings("ignore", message=r".*LightningCLI's args parameter is intended to run from within")
    try:
        EsrlCLI(
            build_module, PromptDataModule,
            seed_everything_default=0,
            trainer_defaults={"num_sanity_val_steps": 0, "log_every_n_steps": 1},
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": DESCRIPTION, "epilog": TOOLS_HELP,  # the main parser's
                           "formatter_class": _HelpFormatter},
            args=argv,
        )
    except EsrlError as e:
        rank = getattr(rank_zero_only, "rank", 0) or 0  # every process raises a config's error: say whose line
        print(f"esrl: error{f' [rank {rank}]' if rank else ''}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except SIGTERMException:  # Lightning's graceful stop exits 0; an interrupted run is no success
        raise SystemExit(EXIT_CODES[interruption.interrupted_by or "SIGTERM"]) from None
    except argparse.ArgumentError as e:
        print(f"esrl: error: {one_line(e.message if hasattr(e, 'message') else e)}\n"
              f"(`{help_hint(argv)}` lists the options)", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as e:  # W&B's own refusals (no API key, no network): the logger named, in one line
        if not type(e).__module__.startswith("wandb."):
            raise
        print(f"esrl: error: trainer.logger WandbLogger: {one_line(e)} (or run offline: WANDB_MODE=offline)",
              file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
