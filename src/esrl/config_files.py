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

from esrl.errors import ConfigError, read_text

MODE = "esrl_yaml"
_yaml_load = get_loader("yaml")


def load_yaml(stream: str, path: str = "") -> object:
    name = _full_name(path)
    try:
        value = _yaml_load(stream)
        if path and (repeated := _repeated_key(stream)) is not None:
            key, line, first, first_text = repeated
            as_written = "" if first_text == key else f" as '{first_text}'"
            raise ConfigError(f"{name}:{line}: key '{key}' given twice (first at line {first}{as_written}); YAML keeps "
                              "the last and drops the first silently: merge them")
        return value
    except yaml.YAMLError as e:
        if not path:
            raise
        mark = getattr(e, "problem_mark", None)
        where = f"{name}:{mark.line + 1}:{mark.column + 1}" if mark is not None else name
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context = getattr(e, "context", None)
        raise ConfigError(f"{where}: invalid YAML ({problem}{f', {context}' if context else ''})") from None


def _full_name(path: str) -> str:
    """jsonargparse passes a config file's base name and reads it from the file's folder: named in full."""
    return os.path.abspath(path) if path and os.path.isfile(path) else str(path)


def _repeated_key(stream: str) -> tuple[str, int, int, str] | None:
    """(key, its line, the line it first stood on and how it was written there) of a key a mapping of the document
    repeats, else None. Keys are compared as the config's loader reads them (`1e-3` and `0.001`, `on` and `true` are
    one key; `1` and `"1"` two), not as written."""
    stack = [yaml.compose(stream, Loader=yaml.SafeLoader)]
    plain = yaml.SafeLoader("")  # YAML's own tag resolution and construction
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.MappingNode):
            seen: dict[object, tuple[int, str]] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    # plain and untagged: as the config's loader resolves it; quoted or tagged (`!!str 1`): as YAML's
                    implicit = not key.style and key.tag == plain.resolve(yaml.ScalarNode, key.value, (True, False))
                    loaded = _yaml_load(key.value) if implicit else plain.construct_object(key)
                    if loaded in seen:
                        return (key.value, key.start_mark.line + 1, *seen[loaded])
                    seen[loaded] = (key.start_mark.line + 1, key.value)
                stack.append(value)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return None


def read_yaml(path: str | os.PathLike) -> object:
    """A YAML file's content; invalid YAML is a ConfigError naming file:line:column, as a --config file's is."""
    return load_yaml(read_text(path), str(path))


SECTIONS = ("model", "data", "trainer")


def _load_config(stream: str, path: str = "") -> object:
    """A config file as jsonargparse reads it, an empty file or section named: jsonargparse said only "Unexpected
    config:" of them, and kept a section of another type (`trainer: 5`) without a word, running on its defaults."""
    value = load_yaml(stream, path)
    if not path:
        return value
    name = _full_name(path)
    if value is None:
        raise ConfigError(f"{name}: the file is empty (a config is a mapping of sections: {', '.join(SECTIONS)})")
    document = yaml.safe_load(stream)  # jsonargparse's loader gives `trainer:` back as the string "trainer:"
    for section in SECTIONS if isinstance(document, dict) else ():
        given = document.get(section, {})
        if given is None:
            raise ConfigError(f"{name}: section '{section}' is empty: give its options or leave it out")
        if not isinstance(given, (dict, str)):  # a str is a file of the section's options, as `--trainer FILE`
            raise ConfigError(f"{name}: section '{section}' is {given!r}, not a mapping of its options (or the path "
                              "of a YAML file of them)")
    return value


set_loader(MODE, _load_config, exceptions=(yaml.YAMLError,))
