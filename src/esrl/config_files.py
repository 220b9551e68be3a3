"""YAML config files whose syntax errors name the file: `esrl: error: /path/run.yaml:3:8: invalid YAML (...)`.

jsonargparse parses a --config file's text with its parser mode's loader, so a YAML error would name
"<unicode string>". `set_loader` (jsonargparse's documented extension point) registers the `esrl_yaml` mode: the
same YAML loader, given the file's name, raising ConfigError for a file. Values typed on the command line have no
file name and keep jsonargparse's own handling.
"""

from __future__ import annotations

import os

import yaml
from jsonargparse import get_loader, set_loader

from esrl.errors import ConfigError

MODE = "esrl_yaml"
_yaml_load = get_loader("yaml")


def load_yaml(stream: str, path: str = "") -> object:
    try:
        return _yaml_load(stream)
    except yaml.YAMLError as e:
        if not path:
            raise
        # jsonargparse passes the file's base name and reads it from the file's folder: name it in full.
        name = os.path.abspath(path) if os.path.isfile(path) else str(path)
        mark = getattr(e, "problem_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        raise ConfigError(f"{where}: invalid YAML ({problem}{f', {context}' if context else ''})") from None


def read_yaml(path: str | os.PathLike) -> object:
    """A YAML file's content; invalid YAML is a ConfigError naming file:line:column, as a --config file's is."""
    with open(path, encoding="utf-8") as f:
        return load_yaml(f.read(), str(path))


set_loader(MODE, load_yaml, exceptions=(yaml.YAMLError,))
