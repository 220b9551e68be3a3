"""What README.md and ARCHITECTURE.md name exists: their files, their `esrl.` objects and the config keys and flags
they tell users to set. A rename that leaves the docs behind fails here, not in a newcomer's shell."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import typing

import pytest
from conftest import ROOT

DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md"]
TEXT = {doc.name: doc.read_text() for doc in DOCS}
NOT_IN_THE_TREE = {
    "src/esrl/es/modes/sparse.py": "the README's worked example of a new noise mode, written by the reader",
    "tests/FILE": "the README's placeholder for a test file",
}


def _named(pattern: str) -> list[tuple[str, str]]:
    """(doc, match) for each distinct match of `pattern` in the docs."""
    return sorted({(name, m.group(1)) for name, text in TEXT.items() for m in re.finditer(pattern, text)})


PATHS = _named(r"(?<![\w/.])((?:src|benchmarks|tests|configs|requirements|docs|slurm|notebooks)/[\w./-]*\w/?)")
FILE_NAMES = _named(r"`(?:esrl/)?((?:[a-z_]+/)*[a-z_]+\.py)`")  # ARCHITECTURE.md's `es/noise.py`, relative to esrl
OBJECTS = _named(r"\b(esrl(?:\.\w+)+)")
SECTION_KEYS = [(doc, key) for doc, key in _named(r"[`\s](?:--)?(?:model\.)?((?:es|grpo|rollout|policy)\.[a-z_]+)"
                                                  r"(?![\w*])") if not key.endswith(".py")]  # policy.py: a file
TOP_LEVEL_FLAGS = _named(r"(--(?:trainer|data)\.[a-z_]+)")


@pytest.mark.parametrize("doc,path", PATHS, ids=[p for _, p in PATHS])
def test_every_path_the_docs_name_exists(doc, path):
    if path in NOT_IN_THE_TREE:
        assert not (ROOT / path).exists(), f"{path} exists now: drop it from NOT_IN_THE_TREE"
        return
    assert (ROOT / path).exists(), f"{doc} names {path}, which is not in the tree"


@pytest.mark.parametrize("doc,name", FILE_NAMES, ids=[n for _, n in FILE_NAMES])
def test_every_source_file_the_docs_name_exists(doc, name):
    """`loss.py` or `modes/lowrank.py` names a file somewhere in esrl (the docs say which package around it);
    `benchmarks/x.py` and the like are PATHS'."""
    if name.split("/")[0] in ("src", "benchmarks", "tests", "requirements", "configs"):
        return
    tree = ROOT / "src" / "esrl"
    found = any(f.as_posix().endswith(f"/{name}") for f in tree.rglob(name.rsplit("/", 1)[-1]))
    assert found, f"{doc} names {name}, which is not a file under src/esrl"


@pytest.mark.parametrize("doc,dotted", OBJECTS, ids=[d for _, d in OBJECTS])
def test_every_esrl_object_the_docs_name_imports(doc, dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"{doc} names {dotted}: {'.'.join(parts[:cut])} has no {attr}"
            obj = getattr(obj, attr)
        return
    raise AssertionError(f"{doc} names {dotted}, which does not import")


def _section_fields() -> dict[str, set[str]]:
    """model.<section> -> its config dataclass's fields, from build_module's signature (what `esrl fit` parses)."""
    from esrl.module_factory import build_module

    fields = {}
    for name, hint in typing.get_type_hints(build_module).items():
        classes = [t for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)]
        if classes:
            fields[name] = {f.name for f in dataclasses.fields(classes[0])}
    return fields


@pytest.mark.parametrize("doc,key", SECTION_KEYS, ids=[k for _, k in SECTION_KEYS])
def test_every_config_key_the_docs_name_is_a_field(doc, key):
    section, field = key.split(".")
    fields = _section_fields()
    assert section in fields, f"{doc} names {key}: `esrl fit` has no model.{section} section"
    assert field in fields[section] or field == "help", f"{doc} names {key}, not a field of model.{section}"


@pytest.mark.parametrize("doc,flag", TOP_LEVEL_FLAGS, ids=[f for _, f in TOP_LEVEL_FLAGS])
def test_every_trainer_and_data_flag_the_docs_name_is_a_parameter(doc, flag):
    import lightning as L

    from esrl.data import PromptDataModule

    section, name = flag.removeprefix("--").split(".")
    target = {"trainer": L.Trainer, "data": PromptDataModule}[section]
    parameters = inspect.signature(target.__init__).parameters
    assert name in parameters, f"{doc} names {flag}: not a {target.__name__} argument"


def test_the_docs_name_enough_to_check():
    """The patterns still find what the docs hold (a reworded doc must not empty a check silently)."""
    assert len(PATHS) >= 20 and len(FILE_NAMES) >= 10 and len(OBJECTS) >= 5
    assert len(SECTION_KEYS) >= 10 and len(TOP_LEVEL_FLAGS) >= 4
