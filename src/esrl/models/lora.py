"""A policy wrapped in a PEFT LoRA adapter, shared by ES (`model.es.mode: lora`) and GRPO (`model.grpo.lora`).

Every targeted nn.Linear computes y = x W^T + (alpha / r) (x A^T) B^T with A (r x in) and B (out x r); only A
and B train, the base weights stay frozen. Initialization: B = 0, so the adapter starts as the identity (the
wrapped model IS the base model); A ~ U(-1/sqrt(in), 1/sqrt(in)) (`init: kaiming`, PEFT's default,
kaiming-uniform with a = sqrt 5) or N(0, 1/r^2) (`gaussian`, PEFT's "gaussian"). A is drawn here, on the CPU,
from a seed derived from the run's seed and the tensor index, not by PEFT from the global RNG: every process
builds the identical adapter whatever its device or RNG state.

The adapter is injected into the model in place (its targeted nn.Linear become PEFT LoRA layers), so anything
generating with the model itself (the HF engine) generates with the adapter too; an engine with its own weights
(vLLM) keeps the base weights and gets the adapter as tensors (`policy_adapter`). The final save writes the
adapter in PEFT format under `final/adapter/` and the merged model in `final/` (`save_final`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from esrl.errors import ConfigError, require
from esrl.models.layers import check_layers_exist, parse_layer_ranges
from esrl.seeding import derive_seed

# One adapter as tensors: HF module name -> (lora_A (r x in), lora_B (out x r)), with the scaling in lora_B.
Adapter = dict[str, tuple[torch.Tensor, torch.Tensor]]

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoraOptions:
    """A LoRA adapter (the `model.grpo.lora` section; ES names the same options lora_rank, lora_alpha,
    lora_target_modules, layers and lora_init in `model.es`)."""

    rank: int = 8
    """Rank r of the adapter (A: r x in, B: out x r). 8 with alpha 16 is the common alpha = 2r choice."""
    alpha: float = 16.0
    """LoRA scaling numerator: the adapted weight is W + alpha / r * B A (not a learning rate)."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Names (or name suffixes) of the nn.Linear modules that get an adapter (PEFT's target_modules); the
    default is every attention and MLP projection of Llama/Qwen-style models."""
    layers: str | None = None
    """Transformer layer ranges that get an adapter, e.g. '0-5,20' (None: every layer)."""
    init: Literal["kaiming", "gaussian"] = "kaiming"
    """Initial A: kaiming-uniform U(+-1/sqrt(in)) (PEFT's default) or N(0, 1/r^2) (PEFT's gaussian); B starts
    at 0 either way, so step 0 is the base model."""


@dataclass(frozen=True)
class LoraFields:
    """The config field each option comes from, named in errors (`switch`: the field that turns LoRA on)."""

    switch: str
    rank: str
    alpha: str
    target_modules: str
    layers: str
    init: str


GRPO_FIELDS = LoraFields(switch="model.grpo.lora", rank="model.grpo.lora.rank", alpha="model.grpo.lora.alpha",
                         target_modules="model.grpo.lora.target_modules", layers="model.grpo.lora.layers",
                         init="model.grpo.lora.init")


def validate_options(options: LoraOptions, fields: LoraFields) -> None:
    """One ConfigError line naming the field of the first bad option."""
    require(options.rank >= 1, fields.rank, f"must be >= 1, got {options.rank}")
    require(options.alpha > 0, fields.alpha, f"must be > 0, got {options.alpha}")
    require(bool(options.target_modules) and all(isinstance(m, str) and m for m in options.target_modules),
            fields.target_modules, f"must be a non-empty list of module names, got {options.target_modules!r}")
    require(options.init in ("kaiming", "gaussian"), fields.init, f"choose kaiming or gaussian, got {options.init!r}")
    try:
        parse_layer_ranges(options.layers)
    except ValueError:
        raise ConfigError(f"{fields.layers}: expected layer ranges such as '0-5,20', got {options.layers!r}") from None


def init_seed(seed: int, tensor_index: int) -> int:
    """The seed of tensor `tensor_index`'s initial lora_A."""
    return derive_seed("esrl-lora-init", seed, tensor_index)


def wrap_lora(model: torch.nn.Module, options: LoraOptions, seed: int, fields: LoraFields) -> torch.nn.Module:
    """`model` wrapped in a fresh LoRA adapter (a peft PeftModel), initialized from `seed` (see the module doc)."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise ConfigError(f"{fields.switch} needs the peft package (pip install 'esrl[peft]')") from None
    layers = parse_layer_ranges(options.layers)
    check_layers_exist(layers, model, fields.layers, options.layers)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = head is not None and head.weight is getattr(model.get_input_embeddings(), "weight", None)
    head_name = next((n for n, m in model.named_modules() if m is head), None) if tied else None
    if head_name and any(head_name == t or head_name.endswith(f".{t}") for t in options.target_modules):
        raise ConfigError(f"{fields.target_modules}: {head_name} is tied to the input embeddings in this model; its "
                          "adapter would untie them in the merged final/ model, which a tied config then loads "
                          "without it (vLLM, transformers 4): leave it out of the targets")
    config = LoraConfig(r=options.rank, lora_alpha=options.alpha, target_modules=list(options.target_modules),
                        layers_to_transform=sorted(layers) if layers is not None else None, lora_dropout=0.0,
                        bias="none", task_type="CAUSAL_LM")
    try:
        # PEFT's own init draws from the global RNG (on a GPU the CUDA one: Lightning's configure_model runs under
        # the root device), and ours replaces it: neither generator moves
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            peft_model = get_peft_model(model, config)
    except ValueError as e:  # e.g. "Target modules {...} not found in the base model"
        name = fields.target_modules + ("" if layers is None else f" / {fields.layers}")
        raise ConfigError(f"{name}: {e}".splitlines()[0]) from None
    embedding = next((n for n, _ in peft_model.named_parameters() if ".lora_embedding_" in n), None)
    if embedding is not None:  # unseeded by init_adapter, and a tied head keeps the base matrix in the merge
        module = embedding.split(".lora_embedding_")[0].removeprefix("base_model.model.")
        raise ConfigError(f"{fields.target_modules}: {module} is an embedding; esrl's adapters go on linear layers: "
                          "leave it out of the targets")
    init_adapter(peft_model, seed, options.init)
    return peft_model


@torch.no_grad()
def init_adapter(model: torch.nn.Module, seed: int, init: str = "kaiming") -> None:
    """A from a seeded CPU generator (per tensor index), B = 0: the identity adapter, the same on any device."""
    generator = torch.Generator(device="cpu")
    for j, (name, p) in enumerate(model.named_parameters()):
        if ".lora_B." in name:
            p.zero_()
        elif ".lora_A." in name:
            generator.manual_seed(init_seed(seed, j))
            r, fan_in = p.shape
            if init == "kaiming":
                bound = 1.0 / math.sqrt(fan_in)
                a = torch.rand(p.shape, generator=generator, dtype=torch.float32, device="cpu")
                a = a.mul_(2 * bound).sub_(bound)
            elif init == "gaussian":
                a = torch.randn(p.shape, generator=generator, dtype=torch.float32, device="cpu").div_(r)
            else:
                raise ValueError(f"unknown lora init {init!r}")
            p.copy_(a.to(p.device, p.dtype))


def is_peft(model: torch.nn.Module) -> bool:
    """True for a PEFT-wrapped model (False when peft is not installed)."""
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def peft_lora_modules(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter, float]]:
    """HF module name -> (lora_A weight (r x in), lora_B weight (out x r), scaling) of every PEFT LoRA layer
    (adapter `default`) of a PEFT-wrapped policy."""
    from peft.tuners.lora import LoraLayer

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            out[name.removeprefix("base_model.model.")] = (module.lora_A["default"].weight,
                                                           module.lora_B["default"].weight,
                                                           float(module.scaling["default"]))
    if not out:
        raise RuntimeError("esrl: the policy has no PEFT LoRA layer (adapter 'default')")
    return out


@torch.no_grad()
def policy_adapter(model: torch.nn.Module) -> Adapter:
    """The policy's current adapter as tensors (lora_A, scaling * lora_B), for an engine's set_default_adapter.

    Engines such as vLLM fold the scaling into lora_B the same way (LoRALayerWeights.optimize); PEFT multiplies
    after lora_B instead, which is the same number when the scaling is a power of two (the default alpha = 2 r)
    and may differ in the last bit else."""
    return {n: (a, b * s if s != 1.0 else b) for n, (a, b, s) in peft_lora_modules(model).items()}


def save_final(policy: torch.nn.Module, tokenizer, out: str | Path) -> Path:
    """A trained model in Hugging Face format under `out` (loadable by from_pretrained).

    A PEFT-wrapped policy also leaves its adapter in PEFT format under `out/adapter/`
    (PeftModel.from_pretrained(base, out/adapter)); `out` then holds the merged model (`merged_state_dict`: the
    policy itself keeps its adapter).
    """
    out = Path(out)
    if is_peft(policy):
        for config in policy.peft_config.values():  # the base as given: a relative folder read from elsewhere (or
            base = config.base_model_name_or_path  # AutoPeftModelForCausalLM on final/adapter) found nothing
            if base and Path(base).expanduser().exists():
                config.base_model_name_or_path = str(Path(base).expanduser().resolve())
        policy.save_pretrained(out / "adapter", safe_serialization=True)
        policy.get_base_model().save_pretrained(out, state_dict=merged_state_dict(policy), safe_serialization=True)
    else:
        policy.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@torch.no_grad()
def merged_state_dict(policy: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A PEFT policy's merged weights under the base model's names, in CPU memory: each adapted linear's
    W + scaling B A as PEFT's merge_and_unload computes it (LoraLayer.get_delta_weight, added in W's dtype), bit
    for bit, merged one linear at a time. Not merge_and_unload on a copy, which holds a second model on the policy's
    device (a 7B in bf16: 14 GB more on the GPU at the end of a run). Tied weights stay one tensor."""
    from peft.tuners.lora import LoraLayer

    base = policy.get_base_model()
    layers = {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    out: dict[str, torch.Tensor] = {}
    on_cpu: dict[tuple, torch.Tensor] = {}  # one CPU tensor per device storage: tied weights stay tied
    for key, tensor in base.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        layer_name = owner.removesuffix(".base_layer")
        if owner.endswith(".base_layer") and layer_name in layers:
            layer = layers[layer_name]
            key = f"{layer_name}.{leaf}"
            if leaf == "weight" and "default" in layer.lora_A and "default" not in layer.merged_adapters:
                out[key] = (tensor + layer.get_delta_weight("default")).to("cpu", tensor.dtype)
                continue  # a new tensor, its own
        elif any(key.startswith(f"{name}.") for name in layers):
            continue  # the adapter's own tensors (lora_A, lora_B), saved under adapter/
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.shape, tensor.dtype)
        if storage not in on_cpu:
            on_cpu[storage] = tensor.to("cpu", copy=True)
        out[key] = on_cpu[storage]
    return out
