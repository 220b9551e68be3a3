"""esrl's Triton kernels build for the GPUs users run, checked on a machine without one.

Triton compiles ahead of time for a named target (`triton.compile(..., target=GPUTarget("cuda", 90, 32))`) with its
bundled ptxas, no driver needed. So every kernel esrl launches, with the block sizes `launch_plan` picks and the
dtypes of real runs, is compiled here for an A100 (sm_80) and an H100 (sm_90): a kernel that only a GPU would reject
(a tl.dot shape or dtype it cannot lower, shared memory past the chip's limit) fails in CI instead of on a lent GPU.
For the bf16 models a GPU runs by default, ptxas must also place it without spilling registers to local memory (a
spill is a slow path in every decode step). The interpreter tests (test_lowrank_kernel.py, test_philox_noise.py)
check the same kernels' math; their speed is measured by benchmarks/gpu/.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton", reason="Triton not installed (the kernels then never run)")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}  # bytes of shared memory one block may use (A100, H100)
POINTER = {"bfloat16": "*bf16", "float32": "*fp32"}
PER_LINEAR = ("ys", "bt", "at", "n_out", "ys_stride")  # the kernel's arguments for each of its 1-3 linears


def _build(fn, signature: dict, consts: dict, options: dict, arch: int):
    """The compiled kernel and ptxas's report (-v) on its PTX for sm_{arch}: Triton's own ptxas and flags."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    sig = {**signature, **{k: "constexpr" for k in consts}}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", arch, 32),
                            options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        report = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2",
                                 f"--gpu-name={sm_arch_from_capability(arch)}", ptx, "-o", ptx + ".o"],
                                capture_output=True, text=True, check=True).stderr
    return kernel, report


def _spilled_bytes(report: str) -> int:
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", report))


# (rank, activations, factors, linears): factors in the model's dtype (lowrank's at ranks 1 and 2, lora's adapters at
# rank 8), and fp32 factors on a bf16 model (lora when its base layers' dtypes differ); one linear, or three (q, k and
# v in one launch); rows per member 8 (decode: 8 prompts) and n_out of a 1.5B model's MLP
CASES = [(1, "bfloat16", "bfloat16", 1), (2, "bfloat16", "bfloat16", 1), (8, "bfloat16", "bfloat16", 1),
         (8, "bfloat16", "float32", 1), (1, "float32", "float32", 1), (8, "float32", "float32", 1),
         (1, "bfloat16", "bfloat16", 3), (8, "bfloat16", "bfloat16", 3), (8, "bfloat16", "bfloat16", 2)]


def lowrank_signature(dtype: str, factor_dtype: str, linears: int, ys_dtype: str | None = None) -> tuple[dict, dict]:
    """The kernel's argument types for `linears` linears, and the unused slots as the None constants it gets."""
    types = {"ys": POINTER[ys_dtype or dtype], "bt": POINTER[factor_dtype], "at": POINTER[factor_dtype], "n_out": "i32",
             "ys_stride": "i32"}
    signature = {"xs_ptr": POINTER[dtype], "rows_per_member": "i32", "n_in": "i32", "xs_stride": "i32", "blocks": "i32",
                 **{f"{name}{i}": types[name] for i in range(linears) for name in PER_LINEAR}}
    return signature, {f"{name}{i}": None for i in range(linears, 3) for name in PER_LINEAR}


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("rank,dtype,factor_dtype,linears", CASES)
def test_the_lowrank_kernel_builds_for_the_gpus_users_run(rank, dtype, factor_dtype, linears, arch):
    from esrl.es.lowrank_kernel import launch_plan

    fn, _, consts, options = launch_plan(rank, rows_per_member=8, n_outs=(8960, 256, 256)[:linears])
    signature, unused = lowrank_signature(dtype, factor_dtype, linears)
    kernel, report = _build(fn, signature, {**consts, **unused}, options, arch)
    assert kernel.metadata.shared <= SHARED_LIMIT[arch], (kernel.metadata.shared, consts)
    if dtype == "bfloat16":
        assert _spilled_bytes(report) == 0, report


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("rank,linears", [(1, 3), (8, 3), (8, 1)])
def test_the_kernel_writing_terms_alone_builds_without_spills(rank, linears, arch):
    """StaticPopulation.overlap's build: bf16 activations and factors, the terms written alone to fp32 buffers."""
    from esrl.es.lowrank_kernel import launch_plan

    fn, _, consts, options = launch_plan(rank, rows_per_member=8, n_outs=(8960, 256, 256)[:linears], add=False)
    signature, unused = lowrank_signature("bfloat16", "bfloat16", linears, ys_dtype="float32")
    kernel, report = _build(fn, signature, {**consts, **unused}, options, arch)
    assert consts["ADD"] is False and kernel.metadata.shared <= SHARED_LIMIT[arch], (kernel.metadata.shared, consts)
    assert _spilled_bytes(report) == 0, report


@pytest.mark.parametrize("arch", [80, 90])
@pytest.mark.parametrize("linears", [1, 2, 3])
def test_the_kernel_adding_terms_written_alone_builds_without_spills(linears, arch):
    """add_terms_'s build: bf16 outputs, fp32 terms, 1-3 outputs a launch (unused slots as None constants)."""
    from esrl.es.lowrank_kernel import add_plan

    fn, _, consts, options = add_plan((8960 * 240, 256 * 240, 256 * 240)[:linears])
    used = {f"{name}{i}": kind for i in range(linears) for name, kind in
            (("ys", POINTER["bfloat16"]), ("ts", POINTER["float32"]), ("n", "i32"))}
    unused = {f"{name}{i}": None for i in range(linears, 3) for name in ("ys", "ts", "n")}
    kernel, report = _build(fn, used, {**consts, **unused}, options, arch)
    assert kernel.metadata.shared <= SHARED_LIMIT[arch] and _spilled_bytes(report) == 0, report


@pytest.mark.parametrize("arch", [80, 90])
def test_the_noise_kernel_builds_for_the_gpus_users_run_with_fp_fusion_pinned(arch, monkeypatch):
    """The draw kernel as philox launches it; its FP fusion stays on where Triton's default says off (Triton 3.10's
    default), so the noise of a seed does not change with Triton's version."""
    from esrl.es import philox

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    signature = {"out_ptr": "*fp32", "keys_ptr": "*i64", "offsets_ptr": "*i64", "n_keys": "i32", "n_groups": "i32",
                 "stream0": "i64", "size0": "i64", "stream1": "i64", "size1": "i64"}
    consts = {k: v for k, v in philox.LAUNCH.items() if k.isupper()}
    options = {k: v for k, v in philox.LAUNCH.items() if not k.isupper()}
    kernel, report = _build(philox._normal_draws, signature, consts, options, arch)
    assert kernel.metadata.shared <= SHARED_LIMIT[arch]
    assert kernel.metadata.enable_fp_fusion
    assert _spilled_bytes(report) == 0, report


def test_the_spill_count_reads_ptxas_report():
    """The parser the spill checks rely on, on ptxas's wording."""
    report = "    40 bytes stack frame, 52 bytes spill stores, 48 bytes spill loads\n"
    assert _spilled_bytes(report) == 100
    assert _spilled_bytes("    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n") == 0
