"""Command-line errors as one line and a hint, not ~60 lines of usage above the message.

jsonargparse raises (instead of printing usage and exiting) when its parsers are built with exit_on_error=False
(EsrlCLI.init_parser); esrl.cli.main prints `esrl: error: <the message on one line>` and where the options are.
Nested messages (a bad key inside a Union of config classes) keep their informative lines, joined.
"""

from __future__ import annotations

import re

_NOISE = re.compile(r"^(Does not validate against any of the Union subtypes|Subtypes:|Errors:|Given value type:|"
                    r"- Expected a <class 'NoneType'>|Given value: NestedArg)")


_NESTED_KEY = re.compile(r'Parser key "([^"]+)": Problem with given class_path \'[^\']+\': Parser key "([^"]+)":')


_UNKNOWN_OPTION = re.compile(r'Parser key "([^"]+)": Problem with given class_path \'[^\']+\': '
                             r"Option '([^']+)' is not accepted(?: Given value: .*)?$")


def one_line(message: str) -> str:
    lines = [line.strip() for line in str(message).splitlines()]
    kept = [line.removeprefix("- ") for line in lines if line and not _NOISE.match(line)]
    if any("Got value:" in line for line in kept):  # the bad value is named: not its whole section again
        kept = [line for line in kept if not line.startswith("Given value:")]
    text = " ".join(kept) or str(message).strip()
    while _NESTED_KEY.search(text):  # a bad field of a config class: name it whole (model.grpo.loss_type: ...)
        text = _NESTED_KEY.sub(r'Parser key "\1.\2":', text)
    text = _CLASS_OPTION.sub(_class_option, text)  # a typo in a callback's init_args
    text = _UNKNOWN_OPTION.sub(r'Parser key "\1.\2": \1 has no option \2', text)  # a typo, on a line or in a file
    return text


_CLASS_OPTION = re.compile(r'Parser key "(trainer\.callbacks)": Problem with given class_path \'([^\']+)\': '
                           r"Option '([^']+)' is not accepted.*$")


def _class_option(match: re.Match) -> str:
    """`trainer.callbacks: <class> has no option <name> (did you mean ...?)`, its options read off its signature."""
    import difflib
    import importlib
    import inspect

    key, class_path, option = match.groups()
    module, _, name = class_path.rpartition(".")
    try:
        params = list(inspect.signature(getattr(importlib.import_module(module), name)).parameters)
    except (ImportError, AttributeError, ValueError, TypeError):
        params = []
    close = difflib.get_close_matches(option, params, n=1)
    return (f"{key}: {class_path} has no option {option}" + (f" (did you mean {close[0]}?)" if close else "")
            + (f"; it takes {', '.join(params)}" if params else ""))


def help_hint(argv: list[str]) -> str:
    command = next((a for a in argv if not a.startswith("-")), None)
    return f"esrl {command} --help" if command in ("fit", "validate", "test") else "esrl --help"
