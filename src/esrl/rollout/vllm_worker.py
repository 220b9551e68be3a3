"""ESWorkerExtension: ES and weight loading inside vLLM's worker, addressed by Hugging Face parameter names.

vLLM mixes this class into its worker (`worker_extension_cls`); esrl.rollout.vllm.VLLMEngine calls its `esrl_`
methods through `collective_rpc`. It runs in vLLM's worker (the same process with the in-process engine core):

- noise: `esrl.es.noise.tensor_noise(seed, j, hf_shape)` with j the tensor's index in the HF model's
  `named_parameters()` (the driver passes the name -> (index, shape) table), so it equals the HF engine's
  noise for the same (iteration, member, tensor);
- fused tensors: vLLM stores q/k/v in `qkv_proj` and gate/up in `gate_up_proj` (the model's
  `packed_modules_mapping`); an HF tensor is a block of rows of the fused tensor, its view is edited in place;
- tensor parallelism: with tp > 1 each worker holds a shard; the full HF-shaped noise is drawn on every
  worker and the worker's slice is taken (column-parallel layers: rows, row-parallel: columns). Models
  whose KV heads are replicated across ranks (num_kv_heads < tp) or whose vocabulary is padded under tp
  are refused. tp > 1 is written but untested here (this machine has no GPUs);
- CPU: vLLM's CPU platform pre-packs linear weights (oneDNN / sgl kernels) and empties `weight`, so an
  in-place edit would not reach the kernels. The extension keeps plain weights instead: at setup it puts
  the checkpoint's weights back into plain `weight` tensors and routes the layers' `cpu_linear` to
  `torch.nn.functional.linear` on the live weight (also the tied/untied LM head, whose packed copy would
  otherwise go stale). Every later change is then an in-place edit the next forward sees. GPU weights are
  plain already;
- restore is a copy from a backup taken at perturb time: bit-exact. The update replays
  `esrl.es.update.set_es_grads` + `SGD(lr=alpha)` elementwise (g accumulated in fp32 seed by seed, divided
  by N, `p.add_((-g).to(dtype), alpha=-alpha)`), so it is bit-identical to the HF engine's update;
- population adapters: lowrank members' LoRA factors are drawn here from their seeds, exactly as
  esrl.es.lowrank draws them, and registered in memory in the worker's adapter cache.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch


class ESWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); every method is called with `collective_rpc`.

    Methods are prefixed `esrl_` so they never collide with the worker's own."""

    def _esrl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    @torch.no_grad()
    def esrl_setup(self, hf_params: list[tuple[str, tuple[int, ...]]], model_path: str) -> dict[str, Any]:
        """Map HF names onto this worker's tensors; on CPU, replace pre-packed weights by plain ones."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.platforms import current_platform

        model = self._esrl_model()
        self._esrl_hf = {name: (j, torch.Size(shape)) for j, (name, shape) in enumerate(hf_params)}
        self._esrl_backup: dict[str, torch.Tensor] = {}
        self._esrl_generator: torch.Generator | None = None
        tp_rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        plain = False
        if current_platform.is_cpu():
            plain = _esrl_unpack_cpu(model)
        self._esrl_views = _esrl_build_views(model, hf_params, tp_rank, tp)
        if plain:  # the packed kernels had the weights; put the checkpoint's back into the plain tensors
            _esrl_load_checkpoint(self, model_path)
        return {"tp_rank": tp_rank, "tp": tp, "plain_cpu_weights": plain, "mapped": len(self._esrl_views)}

    def _esrl_gen(self, device: torch.device) -> torch.Generator:
        if self._esrl_generator is None or self._esrl_generator.device != device:
            self._esrl_generator = torch.Generator(device=device)
        return self._esrl_generator

    def _esrl_noise(self, seed: int, name: str, device: torch.device) -> torch.Tensor:
        from esrl.es.noise import tensor_noise

        j, shape = self._esrl_hf[name]
        return tensor_noise(seed, j, shape, device, self._esrl_gen(device))

    @torch.no_grad()
    def esrl_perturb(self, seed: int, sign: float, sigma: float | list[float], names: list[str]) -> None:
        """theta_name += sign * s * eps(seed, index(name)), as esrl.es.update.Perturber does; s is sigma, or
        one scale per name (sigma_scaling rms: the driver computes them from the HF policy's tensors)."""
        if self._esrl_backup:
            raise RuntimeError("esrl_perturb called while the weights are already perturbed")
        scales = sigma if isinstance(sigma, (list, tuple)) else [sigma] * len(names)
        for name, scale in zip(names, scales):
            view, shard = self._esrl_views[name]
            self._esrl_backup[name] = view.clone()
            view.add_(shard(self._esrl_noise(seed, name, view.device)).to(view.dtype), alpha=sign * scale)

    @torch.no_grad()
    def esrl_restore(self) -> None:
        for name, saved in self._esrl_backup.items():
            self._esrl_views[name][0].copy_(saved)
        self._esrl_backup = {}

    @torch.no_grad()
    def esrl_update(self, seeds: list[int], signs: list[float], weights: list[float], alpha: float, n: int,
                    names: list[str]) -> None:
        """theta += alpha * (1/n) sum_i w_i sign_i eps_i, elementwise as set_es_grads + SGD(lr=alpha)."""
        if self._esrl_backup:
            raise RuntimeError("esrl_update called while the weights are perturbed")
        coef: dict[int, float] = defaultdict(float)
        for s, sg, w in zip(seeds, signs, weights):
            coef[s] += sg * w
        coef = {s: c for s, c in coef.items() if c != 0.0}
        for name in names:
            view, shard = self._esrl_views[name]
            _, shape = self._esrl_hf[name]
            g = torch.zeros(shape, dtype=torch.float32, device=view.device)
            for s, c in coef.items():
                g.add_(self._esrl_noise(s, name, view.device), alpha=c)
            grad = shard(g.div_(n).neg_()).to(view.dtype)
            view.add_(grad, alpha=-alpha)

    @torch.no_grad()
    def esrl_update_lowrank(self, seeds: list[int], signs: list[float], weights: list[float], alpha: float,
                            n: int, names: list[str], rank: int) -> None:
        """The lowrank ES update (sigma_scaling global, plain SGD): esrl.es.lowrank.lowrank_gradient on each
        named matrix, then p += alpha * g elementwise as SGD(lr=alpha) on grad = -g: bit-identical to HF."""
        from types import SimpleNamespace

        from esrl.es.lowrank import NoiseSpec, lowrank_gradient

        if self._esrl_backup:
            raise RuntimeError("esrl_update_lowrank called while the weights are perturbed")
        coef: dict[int, float] = defaultdict(float)  # as esrl.es.lowrank.folded_coefficients
        for s, sg, w in zip(seeds, signs, weights):
            coef[s] += sg * w
        coef = {s: c for s, c in coef.items() if c != 0.0}
        spec = NoiseSpec(mode="lowrank", rank=rank)
        for name in names:
            view, shard = self._esrl_views[name]
            j, shape = self._esrl_hf[name]
            g = lowrank_gradient(coef, n, j, SimpleNamespace(shape=shape, device=view.device), spec,
                                 self._esrl_gen(view.device))
            view.add_(shard(g.neg_()).to(view.dtype), alpha=-alpha)

    @torch.no_grad()
    def esrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into this worker's (fused, sharded) tensors."""
        for name, w in weights:
            view, shard = self._esrl_views[name]
            view.copy_(shard(w.to(view.device)))

    @torch.no_grad()
    def esrl_read_weights(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """This worker's tensors, un-fused to HF names (its shard under tp), copied to CPU."""
        names = list(self._esrl_views) if names is None else names
        return {n: self._esrl_views[n][0].detach().to("cpu", copy=True) for n in names}

    # -- population adapters (ES modes lowrank and lora): one in-memory LoRA adapter per member ---------------
    def _esrl_lora_manager(self):
        runner = self.model_runner
        if getattr(runner, "lora_config", None) is None or not hasattr(runner, "lora_manager"):
            raise RuntimeError("esrl: the vLLM engine was started without LoRA (enable_lora)")
        return runner.lora_manager._adapter_manager

    @torch.no_grad()
    def esrl_add_adapters(self, adapters: list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]],
                          rank: int) -> None:
        """Register in-memory adapters: (lora id, {HF module name: (lora_A (r x in), lora_B (out x r))}).

        Built as vLLM builds a PEFT checkpoint (LoRAModel.from_lora_tensors, lora_alpha = r so the scaling
        is exactly 1) and added to the worker's adapter cache; a request naming the id then finds it there
        and vLLM never looks at the request's path. vLLM packs q/k/v and gate/up into its fused layers and
        slices them under tensor parallelism itself."""
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self._esrl_lora_manager()
        if len(manager) + len(adapters) > manager.capacity:
            raise RuntimeError(f"esrl: {len(adapters)} adapters do not fit vLLM's adapter cache "
                               f"(max_cpu_loras {manager.capacity}, {len(manager)} held)")
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        mapper = mapper.get_rename_mapper() if mapper is not None else None
        config = manager.lora_config
        for lora_id, modules in adapters:
            helper = PEFTHelper.from_dict({"r": rank, "lora_alpha": rank, "target_modules": sorted(
                {m.rsplit(".", 1)[-1] for m in modules})})
            helper.validate_legal(config)
            tensors: dict[str, torch.Tensor] = {}
            for module, (lora_a, lora_b) in modules.items():  # copies: never alias a live policy tensor
                tensors[f"base_model.model.{module}.lora_A.weight"] = lora_a.detach().to("cpu", copy=True)
                tensors[f"base_model.model.{module}.lora_B.weight"] = lora_b.detach().to("cpu", copy=True)
            lora = LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=config.lora_dtype,
                                               model_vocab_size=manager.vocab_size, weights_mapper=mapper,
                                               skip_prefixes=getattr(model, "lora_skip_prefixes", None))
            manager.add_adapter(lora)  # packs q/k/v -> qkv_proj, gate/up -> gate_up_proj
            missing = sorted(set(lora.loras) - set(manager.modules))
            if missing:
                manager.remove_adapter(lora_id)
                raise RuntimeError(f"esrl: vLLM has no LoRA layer for {', '.join(missing[:3])}: exclude these "
                                   "tensors from model.es (include/exclude) or use rollout.engine: hf")

    @torch.no_grad()
    def esrl_add_lowrank_adapters(self, ids: list[int], seeds: list[int], signs: list[float], names: list[str],
                                  scales: list[float], rank: int) -> None:
        """Member k's adapter from its seed: on every HF weight W_j (out x in) named in `names`, lora_A = B^T,
        lora_B = sign * s_j / sqrt(r) * A with (A, B) = lowrank_factors(seed, j, shape, r): the same factors,
        drawn on the same device, as esrl.es.lowrank.PopulationPerturbation's hooks."""
        import math

        from esrl.es.lowrank import lowrank_factors

        sqrt_r = math.sqrt(rank)
        adapters = []
        for lora_id, seed, sign in zip(ids, seeds, signs):
            modules = {}
            sign_t = torch.tensor([sign], dtype=torch.float32)
            for name, scale in zip(names, scales):
                view, _ = self._esrl_views[name]
                j, shape = self._esrl_hf[name]
                if len(shape) != 2:
                    raise RuntimeError(f"esrl: {name} is not a matrix; a LoRA adapter cannot perturb it")
                a, b = lowrank_factors(seed, j, shape, rank, view.device, self._esrl_gen(view.device))
                # as PopulationPerturbation: A * (sign * (s / sqrt r)) in fp32, then the weights' dtype
                a = a.unsqueeze(0).mul_(sign_t.to(view.device).view(-1, 1, 1) * (scale / sqrt_r))[0]
                modules[name.removesuffix(".weight")] = (b.to(view.dtype).T.contiguous(), a.to(view.dtype))
            adapters.append((lora_id, modules))
        self.esrl_add_adapters(adapters, rank)

    def esrl_remove_adapters(self, ids: list[int]) -> None:
        manager = self._esrl_lora_manager()
        for lora_id in ids:
            manager.remove_adapter(lora_id)


def _esrl_unpack_cpu(model: torch.nn.Module) -> bool:
    """Give pre-packed CPU linear layers plain weights again and compute them with F.linear on the live weight."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    def live_linear(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)

    changed = False
    for module in model.modules():
        if "base_layer" in module._modules:  # a LoRA wrapper (enable_lora): its base layer is unpacked itself
            continue
        if not hasattr(module, "cpu_linear") or not hasattr(module, "weight"):
            continue
        w = module.weight
        if w.numel() == 0:  # packed and emptied: rebuild the plain tensor from the shape vLLM recorded
            meta = get_layerwise_info(module).restore_metadata[0].get("weight")
            if meta is None:
                raise RuntimeError(f"esrl: cannot find the unpacked shape of {type(module).__name__}.weight")
            module.weight = torch.nn.Parameter(torch.zeros(meta.shape, dtype=meta.dtype, device=w.device),
                                               requires_grad=False)
        if getattr(module, "bias", None) is not None and module.bias.dtype != module.weight.dtype:
            module.bias.data = module.bias.data.to(module.weight.dtype)  # sgl packing made it fp32
        module.cpu_linear = live_linear
        changed = True
    return changed


def _esrl_build_views(model: torch.nn.Module, hf_params, tp_rank: int, tp: int) -> dict[str, tuple]:
    """HF name -> (view of this worker's storage, function slicing a full HF-shaped tensor to that view)."""
    # With LoRA enabled vLLM wraps layers (qkv_proj.base_layer.weight): address the base layer's tensor.
    vparams = {n.replace(".base_layer.", "."): p for n, p in model.named_parameters(remove_duplicate=False)}
    hf_shape = {n: torch.Size(s) for n, s in hf_params}
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    views: dict[str, tuple] = {}
    for name, shape in hf_shape.items():
        target, offset, fused = name, 0, False
        if name not in vparams:
            for fused_name, parts in packed.items():
                for k, part in enumerate(parts):
                    if f".{part}." in f".{name}":
                        target = name.replace(f".{part}.", f".{fused_name}.")
                        siblings = [name.replace(f".{part}.", f".{p}.") for p in parts]
                        offset = sum(hf_shape[s][0] for s in siblings[:k]) // tp
                        fused = True
                        break
                if fused:
                    break
        if target not in vparams:
            raise RuntimeError(f"esrl: the HF parameter {name!r} has no counterpart in the vLLM model "
                               f"(looked for {target!r})")
        data = vparams[target].data
        if fused:  # column-parallel: each rank holds rows/tp of every part
            rows = shape[0] // tp
            if rows * tp != shape[0]:
                raise RuntimeError(f"esrl: {name} ({shape[0]} rows) does not split over tp={tp}")
            view = data.narrow(0, offset, rows)
            views[name] = (view, _shard_fn(0, tp_rank, rows, rest=tuple(shape[1:])))
        elif data.shape == shape:
            views[name] = (data, lambda t: t)
        else:
            dims = [d for d in range(len(shape)) if data.shape[d] != shape[d]]
            if len(dims) != 1:
                raise RuntimeError(f"esrl: cannot map {name} {tuple(shape)} onto {target} {tuple(data.shape)}")
            d = dims[0]
            size = data.shape[d]
            if tp == 1 and size > shape[d]:  # padded (vocabulary): the HF rows come first
                view = data.narrow(d, 0, shape[d])
                views[name] = (view, lambda t: t)
            elif size * tp == shape[d]:
                views[name] = (data, _shard_fn(d, tp_rank, size))
            else:
                raise RuntimeError(f"esrl: {name} {tuple(shape)} maps onto {target} {tuple(data.shape)} with "
                                   f"tp={tp}: replicated or padded shards are not supported")
    return views


def _shard_fn(dim: int, rank: int, size: int, rest: tuple = ()):
    return lambda t: t.narrow(dim, rank * size, size)


def _esrl_load_checkpoint(worker: ESWorkerExtension, model_path: str) -> None:
    from pathlib import Path

    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"esrl: no safetensors files in {model_path} to restore plain CPU weights from")
    seen = set()
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in worker._esrl_views:
                    worker.esrl_load_weights([(key, st.get_tensor(key))])
                    seen.add(key)
    missing = set(worker._esrl_views) - seen
    if missing:
        raise RuntimeError(f"esrl: {model_path} lacks {sorted(missing)[:3]} (needed to unpack CPU weights)")


# -- the driver side ----------------------------------------------------------------------------------------
