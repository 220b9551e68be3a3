"""The seed log: base model + this file reproduce ES-trained weights bit for bit.

An ES update is a function of (iteration, noise seed, shaped fitness, alpha): the noise is regenerated
from seeds, so a run's whole history fits in a few hundred bytes per iteration. Format: JSON lines; the
first is a header (ES config, noise seed, policy, the base weights' fingerprint), then one record per iteration
{"t", "alpha", "sigma", "z"} where z is the shaped fitness as base64 little-endian float64 (exact).
Member seeds are not stored: they are population(noise_seed, t, N, antithetic), as in training.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from esrl.atomic_files import write_text
from esrl.errors import DataError, EsrlError, read_text
from esrl.models.loading import DTYPES


def encode_fitness(shaped: torch.Tensor) -> str:
    return base64.b64encode(shaped.double().contiguous().numpy().astype("<f8").tobytes()).decode()


def decode_fitness(text: str) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.frombuffer(base64.b64decode(text), dtype="<f8").copy())


def make_header(es_config, noise_seed: int, policy_config, base_fingerprint: str | None = None,
                device: str = "cpu", source: str | None = None) -> dict[str, Any]:
    """base_fingerprint: esrl.es.fingerprint of the base weights (logs written before it existed lack it). device:
    the weights' device type, whose generator drew the noise (a GPU's Philox, the CPU's Mersenne Twister): the
    same seeds replay the run only there."""
    header = {"format": "esrl-seed-log/1", "es": asdict(es_config), "noise_seed": noise_seed,
              "policy": asdict(policy_config), "device": device}
    if base_fingerprint is not None:
        header["base_fingerprint"] = base_fingerprint
    if source is not None:
        header["noise_source"] = source  # esrl.es.noise.noise_source: the GPU model, where one drew it
    return header


def make_record(iteration: int, shaped: torch.Tensor, alpha: float, sigma: float) -> dict[str, Any]:
    return {"t": iteration, "alpha": alpha, "sigma": sigma, "z": encode_fitness(shaped)}


def write_seed_log(path: Path, header: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Write the header and the records so far (a resumed run rewrites the history it restored), replacing the file
    whole: a kill mid-write leaves the old log, not a truncated one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, "".join(json.dumps(item) + "\n" for item in [header, *records]))


def append_record(path: Path, record: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _record(line: str, t: int, members: int) -> dict[str, Any] | str:
    """The record of iteration t, or why the line is not one (torn by an interrupted write, out of order, or a value
    edited into something else)."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        return f"invalid JSON ({e.msg})"
    if not isinstance(r, dict) or not {"t", "alpha", "sigma", "z"} <= r.keys():
        return "not a seed log record"
    if r["t"] != t:
        return f"expected iteration {t}, found {r['t']}"
    for key in ("alpha", "sigma"):
        if isinstance(r[key], bool) or not isinstance(r[key], (int, float)):
            return f"field '{key}' is not a number ({r[key]!r})"
    try:
        fitness = decode_fitness(r["z"])
    except (TypeError, ValueError, binascii.Error):
        fitness = None
    if fitness is None or fitness.numel() != members:
        return f"field 'z' is not {members} base64 float64 values (one per member)"
    return r


def read_seed_log(path: str | Path, steps: int | None = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and the first `steps` records (default: all). Only the lines needed are read, so a torn later
    line (a run killed mid-write) does not stop the rebuild of an earlier step; a bad needed line names itself
    and how many iterations before it are intact."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: seed log not found")
    lines = [line for line in read_text(path, error=DataError).splitlines() if line.strip()]
    try:
        header = json.loads(lines[0]) if lines else None
    except json.JSONDecodeError:
        if "esrl-seed-log/1" in lines[0]:
            raise DataError(f"{path}:1: the seed log's header is not valid JSON (cut short?)") from None
        header = None
    if not isinstance(header, dict) or header.get("format") != "esrl-seed-log/1":
        raise DataError(f"{path}:1: not an esrl seed log (no esrl-seed-log/1 header)")
    wanted = len(lines) - 1 if steps is None else steps
    if wanted < 0:
        raise DataError(f"--step {steps}: must be >= 0 (0: the base model)")
    if wanted > len(lines) - 1:
        raise DataError(f"{path}: seed log has {len(lines) - 1} iterations; cannot rebuild step {steps}")
    members = _check_header(header, path)
    records = []
    for t, line in enumerate(lines[1:wanted + 1]):
        r = _record(line, t, members)
        if isinstance(r, str):
            raise DataError(f"{path}:{t + 2}: {r}; the first {t} iterations are intact (pass --step {t} or less)")
        records.append(r)
    return header, records


def _device_type(name: str) -> bool:
    """Whether `name` is a device type torch knows ('distributed' is a torch module, not one)."""
    try:
        return torch.device(name).type == name
    except RuntimeError:
        return False


def _check_header(header: dict[str, Any], path: Path) -> int:
    """The population size of a header whose fields rebuild the run (its ES config, its policy and noise seed), or a
    DataError naming the field: an edited header failed deep in the replay (KeyError, an unknown mode)."""
    from esrl.es.config import ESConfig
    from esrl.es.modes import get_mode

    policy = header.get("policy")
    if not isinstance(policy, dict) or not {"name_or_path", "dtype"} <= policy.keys():
        raise DataError(f"{path}:1: the header's 'policy' lacks name_or_path or dtype")
    if not isinstance(policy["name_or_path"], str):
        raise DataError(f"{path}:1: the header's 'policy.name_or_path' {policy['name_or_path']!r} is not a string")
    if policy["dtype"] not in DTYPES:
        raise DataError(f"{path}:1: the header's 'policy.dtype' {policy['dtype']!r} is not one of {', '.join(DTYPES)}")
    device = header.get("device", "cpu")
    if not (isinstance(device, str) and _device_type(device) and hasattr(getattr(torch, device, None), "is_available")):
        raise DataError(f"{path}:1: the header's 'device' {device!r} is not a torch device type (cpu, cuda, ...)")
    if isinstance(header.get("noise_seed"), bool) or not isinstance(header.get("noise_seed"), int):
        raise DataError(f"{path}:1: the header's 'noise_seed' is not an integer")
    try:
        cfg = ESConfig(**header["es"])
        cfg.validate()  # ranges and include/exclude patterns, as a fit checks them
        get_mode(cfg.mode)  # a mode this esrl knows
        return cfg.population_size
    except (KeyError, TypeError, ValueError, EsrlError) as e:
        raise DataError(f"{path}:1: the header's 'es' config does not rebuild the run: {e}") from None


@torch.no_grad()
def replay(model: torch.nn.Module, header: dict[str, Any], records: list[dict[str, Any]],
           steps: int | None = None) -> torch.nn.Module:
    """Apply the first `steps` logged ES updates to `model` (the base) in place, exactly as training did.

    Returns the trained model: `model` itself, or in lora mode `model` wrapped in the run's LoRA adapter
    (rebuilt from the noise seed, then trained; its mode's save_final saves it as training's final/ does).
    """
    from esrl.es.config import ESConfig
    from esrl.es.noise import population
    from esrl.es.setup import build_optimizer, build_policy, build_selection
    from esrl.es.update import es_step

    steps = len(records) if steps is None else steps
    if not 0 <= steps <= len(records):
        raise DataError(f"seed log has {len(records)} iterations; cannot rebuild step {steps}")
    cfg = ESConfig(**header["es"])
    model = build_policy(model, cfg, header["noise_seed"])
    selection, spec = build_selection(model, cfg)
    optimizer = build_optimizer(selection.params, cfg)
    for record in records[:steps]:
        members = population(header["noise_seed"], record["t"], cfg.population_size, cfg.antithetic)
        for group in optimizer.param_groups:
            group["lr"] = record["alpha"]
        es_step(optimizer, selection, members, decode_fitness(record["z"]), spec)
    return model


def bytes_per_iteration(population_size: int) -> int:
    """Size of one record in the log (for comparing with a full checkpoint)."""
    record = make_record(999, torch.randn(population_size, dtype=torch.float64), 5e-4, 1e-3)
    return len(json.dumps(record)) + 1
