"""WeightsWorkerExtension: weights and adapters inside vLLM's worker, addressed by Hugging Face names.

vLLM mixes this class into its worker (`worker_extension_cls`); esrl.rollout.vllm.VLLMEngine calls its `esrl_`
methods through `collective_rpc`. It runs in vLLM's worker (the same process with the in-process engine core):

- names: the driver passes the HF model's `named_parameters()` table (name -> shape) at setup;
- fused tensors: vLLM stores q/k/v in `qkv_proj` and gate/up in `gate_up_proj` (the model's
  `packed_modules_mapping`); an HF tensor is a block of rows of the fused tensor, its view is edited in place;
- tensor parallelism: with tp > 1 each worker holds a shard; a full HF-shaped tensor is sliced to the
  worker's part (column-parallel layers: rows, row-parallel: columns). Models
  whose KV heads are replicated across ranks (num_kv_heads < tp) or whose vocabulary is padded under tp
  are refused. tp > 1 is written but untested here (this machine has no GPUs);
- CPU: vLLM's CPU platform pre-packs linear weights (oneDNN / sgl kernels) and empties `weight`, so an
  in-place edit would not reach the kernels. The extension keeps plain weights instead: at setup it puts
  the checkpoint's weights back into plain `weight` tensors and routes the layers' `cpu_linear` to
  `torch.nn.functional.linear` on the live weight (also the tied/untied LM head, whose packed copy would
  otherwise go stale). Every later change is then an in-place copy the next forward sees. GPU weights are
  plain already;
- adapters: LoRA adapters given as tensors are registered in memory in the worker's adapter cache.
"""

from __future__ import annotations

from typing import Any

import torch


class WeightsWorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); every method is called with `collective_rpc`.

    Methods are prefixed `esrl_` so they never collide with the worker's own."""

    def _esrl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    @torch.no_grad()
    def esrl_setup(self, hf_params: list[tuple[str, tuple[int, ...]]], model_path: str | None) -> dict[str, Any]:
        """Map HF names onto this worker's tensors; on CPU, replace pre-packed weights by plain ones, refilled from
        the safetensors in `model_path` (None: the caller pushes them, from the HF model it holds)."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        from vllm.platforms import current_platform

        model = self._esrl_model()
        tp_rank, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        plain = False
        if current_platform.is_cpu():
            plain = _esrl_unpack_cpu(model)
        self._esrl_views = _esrl_build_views(model, hf_params, tp_rank, tp)
        if plain and model_path is not None:  # the packed kernels had the weights: the checkpoint's back in place
            _esrl_load_checkpoint(self, model_path)
        return {"tp_rank": tp_rank, "tp": tp, "plain_cpu_weights": plain, "mapped": len(self._esrl_views)}

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
    def esrl_add_adapters(self, adapters: list[tuple[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]]) -> None:
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
            rank = max(lora_a.shape[0] for lora_a, _ in modules.values())
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
        if fused and all(s in hf_shape for s in siblings):  # the parts split evenly over tp, or the views are wrong
            even = sum(hf_shape[s][0] for s in siblings) // tp
            if data.shape[0] != even:
                raise RuntimeError(f"esrl: {target} holds {data.shape[0]} rows on each of {tp} tensor-parallel GPUs, "
                                   f"not an even split of its parts' ({even}): vLLM replicates key/value heads when "
                                   "a model has fewer than tensor_parallel_size; use a smaller tensor_parallel_size")
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


def _esrl_load_checkpoint(worker: WeightsWorkerExtension, model_path: str) -> None:
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


