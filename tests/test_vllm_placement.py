"""Where each process's vLLM engine runs: vLLM's external_launcher with the rank's own device under several
processes or a GPU other than 0, tensor parallelism's refusals (CPU: the arguments and views are checked; the
placement on real GPUs is not)."""

from __future__ import annotations

import os

import pytest
import torch

from esrl.errors import ConfigError
from test_vllm_engine import requires_vllm


def _rank_kwargs(rank: int, store: str, results) -> None:
    """One of two Gloo ranks: what rank_engine_kwargs gives, and what it refuses."""
    import os

    import torch.distributed as dist

    from esrl.rollout import RolloutConfig
    from esrl.rollout.vllm import rank_engine_kwargs

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        kwargs, environment = rank_engine_kwargs(RolloutConfig(engine="vllm"))
        try:
            rank_engine_kwargs(RolloutConfig(engine="vllm", vllm_kwargs={"tensor_parallel_size": 2}))
            refused = ""
        except ConfigError as err:
            refused = str(err)
        results.put((rank, kwargs, environment, os.environ.get("RANK"), refused))
    finally:
        dist.destroy_process_group()


def test_each_of_several_ranks_gets_the_external_launcher_with_its_own_rank(tmp_path):
    """With several ranks the engine runs on vLLM's external_launcher (as TRL's colocate mode), which reads the
    rank's RANK and LOCAL_RANK: its device is then the rank's own, not device 0. Tensor parallelism across ranks
    that run different members is refused in one line; one process gets no extra arguments. (The device placement
    itself needs two GPUs and vLLM built for them: checked on the CPU only.)"""
    import torch.multiprocessing as mp

    from esrl.rollout import RolloutConfig
    from esrl.rollout.vllm import rank_engine_kwargs

    assert rank_engine_kwargs(RolloutConfig(engine="vllm")) == ({}, {})
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_kwargs, args=(r, str(tmp_path / "store"), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank, (r, kwargs, environment, env_rank, refused) in enumerate(got):
        assert (r, kwargs) == (rank, {"distributed_executor_backend": "external_launcher"})
        assert environment == {"RANK": str(rank), "LOCAL_RANK": "0"} and env_rank is None  # vLLM's to read, not set
        assert "tensor_parallel_size: 2 with 2 ranks" in refused and "\n" not in refused


def _one_process_kwargs(store: str, results) -> None:
    """In a fresh process (no process group yet, none of vLLM's): rank_engine_kwargs on a faked cuda:1, without a
    process group, then inside a world-1 one, then on cuda:0."""
    import torch.distributed as dist

    import esrl.rollout.vllm as v
    from esrl.rollout import RolloutConfig

    config = RolloutConfig(engine="vllm")
    v.cuda_index = lambda: 1
    out = {"no group": v.rank_engine_kwargs(config)}
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        out["tensor parallel"] = v.rank_engine_kwargs(RolloutConfig(engine="vllm",
                                                                    vllm_kwargs={"tensor_parallel_size": 2}))
        out["group"] = v.rank_engine_kwargs(config)
        v.cuda_index = lambda: 0
        out["cuda:0"] = v.rank_engine_kwargs(config)
    finally:
        dist.destroy_process_group()
    results.put(out)


def test_one_process_on_a_gpu_other_than_0_gets_the_external_launcher_on_its_device(tmp_path):
    """`trainer.devices: [1]`: vLLM's default executor would put the engine on cuda:0, beside whatever runs there.
    The engine goes on the external_launcher backend with LOCAL_RANK 1, in the process group ES always has or, without
    one (GRPO on one device), in one of its own on a free port; device 0 and tensor parallelism keep the default.
    (The CUDA device index is faked in a child process: this checks the arguments, on the CPU only.)"""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_one_process_kwargs, args=(str(tmp_path / "store"), results))
    proc.start()
    out = results.get(timeout=120)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    launcher = {"distributed_executor_backend": "external_launcher"}
    kwargs, environment = out["no group"]
    assert kwargs == launcher and environment.pop("MASTER_ADDR") == "127.0.0.1" and int(environment.pop("MASTER_PORT"))
    assert environment == {"RANK": "0", "LOCAL_RANK": "1"}
    assert out["group"] == (launcher, {"RANK": "0", "LOCAL_RANK": "1"})
    assert out["tensor parallel"] == ({}, {}) and out["cuda:0"] == ({}, {})


ENGINE_ON_ANOTHER_DEVICE = """
import json, os, sys
import esrl.rollout.vllm as v
from esrl.models.loading import load_causal_lm, load_tokenizer
from esrl.rollout import HFEngine, RolloutConfig, build_engine
v.cuda_index = lambda: 1  # as on cuda:1: no process group yet (GRPO on one device)
path = sys.argv[1]
model, tok = load_causal_lm(path), load_tokenizer(path)
import torch
torch.set_default_dtype(torch.bfloat16)
with torch.device("meta"):  # as Lightning's configure_model on a GPU: the root device's and the precision's defaults
    engine = build_engine(RolloutConfig(engine="vllm", vllm_kwargs={"max_model_len": 256,
                                                                     "kv_cache_memory_bytes": 64 << 20}), model, tok)
torch.set_default_dtype(torch.float32)
from vllm.distributed.parallel_state import get_world_group
prompts = [[{"role": "user", "content": "Say something short."}], [{"role": "user", "content": "Hi!"}]]
greedy = dict(max_new_tokens=8, greedy=True)
print(json.dumps({"local_rank": get_world_group().local_rank,
                  "equal": [c.token_ids for c in engine.generate(prompts, **greedy)]
                           == [c.token_ids for c in HFEngine(model, tok).generate(prompts, **greedy)],
                  "left": [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k in os.environ]}))
"""


@requires_vllm
def test_an_engine_built_for_another_device_without_a_process_group_generates_as_the_hf_engine(tmp_path):
    """The external_launcher path where no process group exists (GRPO on one device, cuda:1 faked): vLLM starts
    its own, places the engine by LOCAL_RANK 1, generates the HF engine's greedy tokens, and the environment it read
    is gone afterwards. Built inside a default device and dtype (meta and bf16 here; Lightning's configure_model sets
    the GPU's and the precision's), which vLLM's own tensors once took ("Cannot copy out of meta tensor"). On the
    CPU: the device placement itself is not checked here."""
    import json
    import subprocess
    import sys

    from esrl.models import tiny_llama

    path = tiny_llama(tmp_path / "llama256", hidden_size=256)  # head_dim 64: vLLM's CPU attention has a kernel
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", ENGINE_ON_ANOTHER_DEVICE, str(path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"local_rank": 1, "equal": True, "left": []}


def test_fused_projections_that_do_not_split_evenly_over_tensor_parallel_gpus_are_refused():
    """With fewer key/value heads than tensor_parallel_size vLLM replicates them: each GPU's qkv_proj then holds
    q/tp plus whole k and v heads, and the even-split views would write the wrong rows (silently, the row counts
    still dividing by tp). Here two "GPUs" over q 8 rows and one KV head of 2 rows: 4 + 2 + 2 rows each, not 6."""
    from esrl.rollout.vllm_worker import _esrl_build_views

    hf = [("layers.0.self_attn.q_proj.weight", (8, 4)), ("layers.0.self_attn.k_proj.weight", (2, 4)),
          ("layers.0.self_attn.v_proj.weight", (2, 4))]

    def worker(rows: int) -> torch.nn.Module:
        """A tensor-parallel worker's model as vLLM lays it out: q, k and v fused into qkv_proj, this GPU's rows."""
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([torch.nn.Module()])
        model.layers[0].self_attn = torch.nn.Module()
        model.layers[0].self_attn.qkv_proj = torch.nn.Linear(4, rows, bias=False)
        model.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}
        return model

    views = _esrl_build_views(worker(6), hf, tp_rank=1, tp=2)  # an even split: q 4, k 1, v 1 rows on this GPU
    assert [v.shape[0] for v, _ in views.values()] == [4, 1, 1]
    with pytest.raises(RuntimeError, match="holds 8 rows on each of 2 tensor-parallel GPUs, not an even split"):
        _esrl_build_views(worker(8), hf, tp_rank=1, tp=2)
