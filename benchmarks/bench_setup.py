"""What the ES benchmarks share: the models they time (the embedded one, or a 1.5B architecture with random weights),
the conciseness rows, one timed plain generate, and the memory and machine they report.

Imported by es_throughput.py, es_throughput_vllm.py, es_host_work.py, prefill_head.py and gpu/decode_profile.py
(run from benchmarks/, or with it on sys.path).
"""

from __future__ import annotations

import platform
import resource
import threading
import time

import torch


class PeakRSS:
    """Samples RSS every 2 ms in a thread: the peak above the RSS at entry."""

    def __init__(self):
        import psutil

        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.002)

    def __enter__(self):
        self.start = self.proc.memory_info().rss
        self.peak = self.start
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def delta_mb(self) -> float:
        return (self.peak - self.start) / 2**20


# Qwen2.5-1.5B's architecture (its config.json), for the GPU run with random weights: nothing is downloaded.
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")


def build_model(name: str, device: str, dtype: str):
    """The embedded model (or any esrl model id / path), or `random:qwen2.5-1.5b`: that architecture with random
    weights (seed 0). The tokenizer is always the embedded SmolLM2 one: its ids fit in Qwen's vocabulary, and with
    EOS ignored the timing does not depend on which tokens come out."""
    from esrl.models import load_causal_lm

    if name == "random:qwen2.5-1.5b":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_15B, torch_dtype=dtype)).to(getattr(torch, dtype))
        model.name_or_path = name
        return model.eval()
    return load_causal_lm(name, dtype=dtype).to(device)


def bench_rows(task, k: int) -> list:
    """k conciseness rows: its 2 training prompts first, then its 8 eval prompts, cycling beyond 10."""
    pool = list(task.train_rows) + list(task.eval_rows)
    return [pool[i % len(pool)] for i in range(k)]


def peak_memory_mb(device: str) -> float:
    """The process's peak memory: RSS high-water on CPU, the CUDA caching allocator's peak on a GPU."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def timed_generate(engine, rows: list, gen: dict) -> tuple[float, int]:
    """One plain batched greedy generate of `rows` with the base weights (the inference floor): (seconds, tokens)."""
    start = time.perf_counter()
    out = engine.generate(rows, greedy=True, **gen)
    return time.perf_counter() - start, sum(len(c.token_ids) for c in out)


def cpu_model() -> str:
    """The CPU's model name, for the machine line of a result."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
