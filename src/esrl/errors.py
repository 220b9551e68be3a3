"""User-facing errors: the CLI prints these as one line and exits non-zero, without a traceback."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class EsrlError(Exception):
    """Bad input from the user (config, data line, model path, scorer answer)."""


class ConfigError(EsrlError, ValueError):
    """A config field is out of range; the message names the field."""


class DataError(EsrlError, ValueError):
    """A data file or line cannot be used; the message names the file and line."""


class ModelNotFoundError(EsrlError, FileNotFoundError):
    """A model could not be found; the message says where esrl looked."""


def require(condition: bool, field: str, message: str) -> None:
    """Validate a config field early, naming it in the error."""
    if not condition:
        raise ConfigError(f"{field}: {message}")


def require_finite(config: Any, section: str) -> None:
    """Every float field of a config dataclass finite: YAML's `.inf` passes `sigma > 0` and trained on noise of
    infinite size, `.nan` fails every comparison silently where a check reads `not (x < 0)`."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{section}.{field.name}: must be a finite number, got {value}")


class ScorerError(EsrlError, RuntimeError):
    """A scorer (service or model) could not be reached or gave an unusable answer; the message names it."""


class RewardError(EsrlError, ValueError):
    """A reward function gave unusable values (a non-number, or too many non-finite ones in one step); the
    message names the function and, for non-finite values, the step."""


class NonFiniteUpdateError(EsrlError, FloatingPointError):
    """An update would have made weights non-finite: it was refused and the run stops without `final/`."""


def read_text(path, what: str = "", error: type[EsrlError] = ConfigError) -> str:
    """A user's text file (a config, a seed log, a token file) as UTF-8: a binary one given by mistake (a checkpoint,
    a model's weights) is one `error` naming it (`what`: the option before the path), not UnicodeDecodeError."""
    from pathlib import Path

    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{what}{' ' if what else ''}{path}: not a text file (UTF-8): byte {e.start} is "
                    f"0x{e.object[e.start]:02x}; a binary file given by mistake?") from None
