"""Resuming with `--ckpt_path`: what the user asked for meets what the checkpoint was trained with.

LightningCLI restores the model's hyperparameters from the checkpoint over the parsed config (its
`_parse_ckpt_path`, between `parse_arguments` and `before_instantiate_classes`), so without this check an explicit
`--model.es.alpha` or `--model.policy.name_or_path` would be replaced without a word. The rule, field by field:

- equal to the checkpoint's value: nothing to say;
- left at its default and not written by the user (no flag, no key in a --config / -c file or a global config's
  `fit:` section): the checkpoint's value is used (resuming needs no config but the checkpoint);
- written and different, a field in MAY_CHANGE (speed or bookkeeping, not what is trained), or a scorer's
  connection among data.task_args (SCORER_CONNECTION): the given value wins;
- given and different, any other field: the run stops with one line listing each such field and both values.

The data section (not restored by Lightning) and the run seed are compared the same way, except that a data field
left at its default but different from the checkpoint's is a conflict too (the run would train on other data).
An ES checkpoint resumed with `--algo grpo`, or the reverse, is refused. The trainer section is never restored:
`trainer.max_steps`, callbacks (evaluation) and loggers always follow the config.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict
from pathlib import Path
from typing import Any

from esrl.errors import ConfigError

# Fields a resumed run may change: they change speed, memory or checks, not what is trained. Not bit for bit: a batched
# ES mode's chunk (max_batch_size) or the compiled path can order a sum otherwise (lowrank, fp32: ~1e-6 in a logit),
# and GRPO's sampling on the HF engine splits one random stream into chunks of max_batch_size rows (other samples).
MAY_CHANGE = frozenset({
    "model.rollout.max_batch_size", "model.rollout.compile", "model.rollout.vllm_kwargs",
    "model.rollout.vllm_max_loras", "model.rollout.vllm_sleep", "model.es.checksum_every",
    "model.grpo.gradient_checkpointing", "data.eval_batch_size",
})
_DATA_FIELDS = ("task", "task_args", "prompts_per_step", "shuffle", "seed", "eval_batch_size")
SCORER_CONNECTION = frozenset({"scorer", "token", "timeout", "retries", "backoff", "max_items", "max_chars"})
"""data.task_args a resumed run may change: where and how a scorer is reached, not what it scores (a scorer service
restarted on another node after an outage has another address)."""
SUBCOMMANDS = ("fit", "validate", "test")


def _flat(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        if isinstance(value, dict) and key != "task_args" and not name.endswith("vllm_kwargs"):
            out.update(_flat(value, name))
        else:
            out[name] = value
    return out


def _model_defaults() -> dict[str, Any]:
    from esrl.es.config import ESConfig
    from esrl.grpo.config import GRPOConfig
    from esrl.policy import PolicyConfig
    from esrl.rollout import RolloutConfig

    return _flat({"policy": asdict(PolicyConfig()), "rollout": asdict(RolloutConfig()), "es": asdict(ESConfig()),
                  "grpo": asdict(GRPOConfig())}, "model")


def _data_defaults() -> dict[str, Any]:
    from esrl.data import PromptDataModule

    params = inspect.signature(PromptDataModule.__init__).parameters
    return {f"data.{k}": params[k].default for k in _DATA_FIELDS}


def config_file_arg(args: list[str], i: int) -> str | None:
    """The file (or inline YAML) of a config option at args[i] in any of LightningCLI's forms (`--config F`,
    `--config=F`, `-c F`, `-c=F`, `-cF`), else None."""
    arg = args[i]
    for flag in ("--config", "-c"):
        if arg == flag:
            return args[i + 1] if i + 1 < len(args) else ""
        if arg.startswith(flag + "="):
            return arg[len(flag) + 1:]
    return arg[2:] if arg.startswith("-c") else None


def _written_in(source: str, section: str | None) -> set[str]:
    """The model and data fields, seed_everything and algo that a config writes; `section`: a global config's
    (`esrl --config G.yaml fit`) section for the subcommand (`fit:`), which is what it gives the subcommand."""
    import yaml

    try:
        path = Path(source).expanduser()
        tree = yaml.safe_load(path.read_text() if path.is_file() else source) or {}
    except (OSError, ValueError, yaml.YAMLError):
        return set()  # the parser reported a bad config file already
    if section is not None:
        tree = tree.get(section) if isinstance(tree, dict) else None
    if not isinstance(tree, dict):
        return set()
    written = {f for key in ("model", "data") if isinstance(tree.get(key), dict) for f in _flat(tree[key], key)}
    return written | {key for key in ("seed_everything", "algo") if key in tree}


def explicit_fields(args: list[str]) -> frozenset[str]:
    """Every field the user wrote: a `--model.es.alpha` flag or a key in a config file (--config or -c, after the
    subcommand or as a global config's section before it), and their parent sections, so a value typed equal to
    the default still counts as given."""
    command = next((i for i, arg in enumerate(args) if arg in SUBCOMMANDS), len(args))
    written: set[str] = set()
    for i, arg in enumerate(args):
        source = config_file_arg(args, i)
        if source is not None:
            written |= _written_in(source, args[command] if i < command < len(args) else None)
        elif arg.startswith("--"):
            written.add(arg[2:].partition("=")[0])
    return frozenset(".".join(f.split(".")[:n]) for f in written for n in range(1, f.count(".") + 2))


def _same(field: str, a: Any, b: Any) -> bool:
    if field == "data.task_args" and isinstance(a, dict) and isinstance(b, dict):
        a, b = ({k: v for k, v in d.items() if k not in SCORER_CONNECTION} for d in (a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    if field == "model.policy.name_or_path" and a != b:  # one folder spelt two ways (relative, a symlink)
        pa, pb = Path(str(a)).expanduser(), Path(str(b)).expanduser()
        return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return float(a) == float(b)
    return a == b


def _sections_against_values(saved: dict[str, Any], given: dict[str, Any]) -> tuple[dict, dict]:
    """Flat fields where one side has a section and the other a plain value (`model.grpo.lora`: its rank, alpha...
    against None) regrouped on the section's side into one dict, so the two compare: flattened, they shared no name
    and the checkpoint's silently won (LoRA added to, or dropped from, a resumed run)."""
    def regroup(flat: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
        out = dict(flat)
        for name, value in other.items():
            children = {k[len(name) + 1:]: v for k, v in flat.items() if k.startswith(name + ".")}
            if not isinstance(value, dict) and children and name not in flat:
                out = {k: v for k, v in out.items() if not k.startswith(name + ".")}
                out[name] = children
        return out

    return regroup(saved, given), regroup(given, saved)


def checkpoint_algo(ckpt: dict[str, Any]) -> str | None:
    hparams = ckpt.get("hyper_parameters") or {}
    if "esrl_es" in ckpt or "es" in hparams:
        return "es"
    if "esrl_grpo" in ckpt or "grpo" in hparams:
        return "grpo"
    return None


def checkpoint_seed(ckpt: dict[str, Any]) -> int | None:
    for key, field in (("esrl_es", "noise_seed"), ("esrl_grpo", "run_seed")):
        if isinstance(ckpt.get(key), dict) and ckpt[key].get(field) is not None:
            return int(ckpt[key][field])
    return None


class ResumePlan:
    """What a resumed run keeps from the user's config: `overrides` (field -> value, re-applied after Lightning
    restored the checkpoint's hyperparameters) and `seed` (the run seed to use)."""

    def __init__(self, overrides: dict[str, Any], seed: int | None):
        self.overrides = overrides
        self.seed = seed
        self.run_dir: str | None = None  # the checkpoint's run folder (set by esrl.cli)


def plan_resume(ckpt_path: str, ckpt: dict[str, Any], config: dict[str, Any], seed_default: int = 0,
                explicit: frozenset[str] = frozenset()) -> ResumePlan:
    """Compare `config` (the subcommand's parsed config as a dict: algo, model, data, seed_everything) with the
    checkpoint `ckpt`; raise ConfigError with one line listing every conflict, else return the plan. `explicit`:
    the fields the user wrote (explicit_fields), given even where equal to the default."""
    algo = checkpoint_algo(ckpt)
    given_algo = config.get("algo") or "es"
    if algo is not None and algo != given_algo:
        article = "an" if algo == "es" else "a"
        raise ConfigError(f"--ckpt_path {ckpt_path}: a checkpoint of {article} {algo.upper()} run, but --algo {given_algo}; "
                          f"resume it with --algo {algo} (or start a new run without --ckpt_path)")
    conflicts: list[str] = []
    overrides: dict[str, Any] = {}
    sections = [(_flat(ckpt.get("hyper_parameters") or {}, "model"), _flat(config.get("model") or {}, "model"),
                 _model_defaults(), False)]
    data_ckpt = {f"data.{k}": v for k, v in (ckpt.get("datamodule_hyper_parameters") or {}).items()
                 if k in _DATA_FIELDS}
    sections.append((data_ckpt, {f"data.{k}": v for k, v in (config.get("data") or {}).items()}, _data_defaults(),
                     True))
    for saved, given, defaults, default_conflicts in sections:
        saved, given = _sections_against_values(saved, given)
        for field, old in saved.items():
            if field not in given or _same(field, old, given[field]):
                continue
            new = given[field]
            section = any(k.startswith(field + ".") for k in defaults)  # `model.es: null`: the default section
            written = (field in explicit or (field in defaults and not _same(field, new, defaults[field]))
                       or (field not in defaults and not section))
            if field in MAY_CHANGE:
                if written:  # yours, not a default your config left out (the checkpoint's then)
                    overrides[field] = new
            elif default_conflicts or written:
                conflicts.append(f"{field} {old!r} in the checkpoint, {new!r} given")
    seed = config.get("seed_everything")
    saved_seed = checkpoint_seed(ckpt)
    own_seed = (config.get("model") or {}).get(algo or "es", {}) or {}
    saved_own = ((ckpt.get("hyper_parameters") or {}).get(algo or "es") or {}).get("seed")  # its model.<algo>.seed
    if saved_seed is not None and own_seed.get("seed") is None and saved_own is None and seed != saved_seed:
        if seed is None or isinstance(seed, bool) or (seed == seed_default and "seed_everything" not in explicit):
            seed = saved_seed  # not given (or `true`, a random one): the checkpoint's
        else:
            conflicts.append(f"seed_everything {saved_seed} in the checkpoint, {seed} given")
    if conflicts:
        raise ConfigError(f"--ckpt_path {ckpt_path} was trained with other settings than given: "
                          + "; ".join(conflicts)
                          + ". Resume with the checkpoint's values (drop or change these) or start a new run")
    return ResumePlan(overrides, seed)


def load_deepspeed_for_plan(folder: Path) -> dict[str, Any] | None:
    """A DeepSpeed checkpoint folder's settings: Lightning hands its checkpoint, less the weights and optimizer, to
    DeepSpeed as client state, kept in the tag's mp_rank_00_model_states.pt (memory-mapped: the module's tensors
    unread). None where that file is missing or will not load safely: the resume then goes on uncompared."""
    import torch

    latest = folder / "latest"
    tag = latest.read_text().strip() if latest.is_file() else "checkpoint"
    states = folder / tag / "mp_rank_00_model_states.pt"
    try:
        ckpt = torch.load(states, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - a missing file, or DeepSpeed objects weights_only refuses
        return None
    return ckpt if isinstance(ckpt, dict) and "hyper_parameters" in ckpt else None


def load_for_plan(ckpt_path: str) -> dict[str, Any] | None:
    """The checkpoint's small entries (memory-mapped: its tensors are not read); None for what Lightning resolves
    itself (hpc, registry, URLs; `last` is esrl.checkpoints.resolve_last's) or a DeepSpeed folder."""
    import torch

    from esrl.errors import DataError

    path = Path(str(ckpt_path)).expanduser()
    if not path.is_file():
        return None
    try:  # mmap builds every tensor over its stored bytes: a record of the wrong size fails here, unread
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, RuntimeError (storage sizes), zip errors
        import pickle

        if isinstance(e, pickle.UnpicklingError):
            why = "its data.pkl does not unpickle as a checkpoint (garbage, or not written by torch.save)"
        elif "storage" in str(e):
            why = f"a tensor's stored bytes do not match its size, truncated or corrupt ({str(e).splitlines()[0]})"
        else:
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else 'unreadable'}"
        raise DataError(f"--ckpt_path {ckpt_path}: a corrupt checkpoint: {why}") from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise DataError(f"--ckpt_path {ckpt_path}: not a Lightning checkpoint (no state_dict)")
    return ckpt


def resumed_version(run_dir: str, root: str) -> str | None:
    """The version folder name a resumed run continues, when the checkpoint's run folder is
    `<root>/lightning_logs/<version>` (its metrics.csv moved aside for esrl.callbacks.interruption to carry over);
    None (a new version) otherwise."""
    from esrl.callbacks.interruption import BEFORE_RESUME

    from lightning.fabric.utilities.rank_zero import rank_zero_only

    folder = Path(run_dir or "")
    if not run_dir or folder.parent.resolve() != (Path(root) / "lightning_logs").resolve() or not folder.is_dir():
        return None
    metrics = folder / "metrics.csv"
    if metrics.is_file() and getattr(rank_zero_only, "rank", 0) == 0:  # every rank runs this; one moves it
        try:
            metrics.replace(folder / BEFORE_RESUME)
        except FileNotFoundError:
            pass
    return folder.name
