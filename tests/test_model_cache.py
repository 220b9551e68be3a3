"""The converted-model cache is used only when complete; a half-written or corrupt one is rebuilt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from esrl.models.cache import RECORD, ensure, problem


def build(folder):
    """A stand-in for the GGUF conversion: a config and one safetensors file."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"w": torch.arange(1000, dtype=torch.float32)}, str(folder / "model.safetensors"))


@pytest.fixture
def built(tmp_path):
    calls = []
    out = ensure(tmp_path / "m", lambda tmp: (calls.append(tmp), build(tmp)))
    assert problem(out) is None and len(calls) == 1
    return out


def rebuilds(out) -> bool:
    calls = []
    ensure(out, lambda tmp: (calls.append(tmp), build(tmp)))
    assert problem(out) is None
    return len(calls) == 1


def test_complete_cache_is_reused(built):
    assert not rebuilds(built)
    assert not list(built.parent.glob("m.tmp*"))


def truncate(out):
    path = out / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def overwrite_header(out):
    path = out / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:20] = b"x" * 12
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [
    lambda out: (out / RECORD).unlink(),                 # an interrupted (or pre-record) conversion
    lambda out: (out / RECORD).write_text("{"),
    lambda out: (out / "config.json").unlink(),
    truncate,
    overwrite_header,
], ids=["no-record", "bad-record", "missing-file", "truncated", "bad-header"])
def test_damaged_cache_is_rebuilt_never_used(built, damage, capsys):
    damage(built)
    assert problem(built) is not None
    assert rebuilds(built)
    assert "rebuilding" in capsys.readouterr().err


def test_failed_build_leaves_nothing_behind(tmp_path):
    def crash(tmp):
        build(tmp)
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError):
        ensure(tmp_path / "m", crash)
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob("m.tmp*"))


def test_leftover_temporary_folder_is_cleared(tmp_path):
    build(tmp_path / "m.tmp12345")  # a conversion killed before it could clean up
    ensure(tmp_path / "m", build)
    assert problem(tmp_path / "m") is None and not list(tmp_path.glob("m.tmp*"))


def test_embedded_model_cache_is_checked_on_every_resolve(tmp_path, monkeypatch):
    """resolve_model_path goes through the same check: a truncated cache of the embedded model is reconverted."""
    from esrl.models import loading

    converted = []
    monkeypatch.setenv("ESRL_CACHE", str(tmp_path))
    monkeypatch.setattr(loading, "_convert_gguf", lambda gguf, tmp: (converted.append(gguf), build(tmp)))
    path = loading.resolve_model_path("smollm2-135m-instruct")
    assert loading.resolve_model_path("smollm2-135m-instruct") == path and len(converted) == 1
    truncate(tmp_path / "smollm2-135m-instruct")
    assert loading.resolve_model_path("smollm2-135m-instruct") == path and len(converted) == 2
    # the package upgraded to another GGUF file: the conversion of the old one is not served
    source = loading.embedded_source("smollm2-135m-instruct")
    monkeypatch.setattr(loading, "embedded_source", lambda name: {**source, "bytes": source["bytes"] + 1})
    assert "built from {'gguf'" in loading.embedded_problem("smollm2-135m-instruct")
    assert loading.resolve_model_path("smollm2-135m-instruct") == path and len(converted) == 3
    assert loading.embedded_problem("smollm2-135m-instruct") is None
    # a cache converted before sources were recorded serves as it is (a shared read-only one among them)
    record = Path(path) / "esrl-cache.json"
    record.write_text(json.dumps({k: v for k, v in json.loads(record.read_text()).items() if k != "source"}))
    assert loading.embedded_problem("smollm2-135m-instruct") is None


def test_esrl_cache_with_a_tilde_or_empty_is_a_folder_in_home(tmp_path, monkeypatch):
    """ESRL_CACHE="~/models" (quoted, so no shell expanded it) made a folder named ~ in the working folder, and an
    empty ESRL_CACHE made the working folder itself the cache."""
    from esrl.models.cache import cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ESRL_CACHE", "~/models")
    assert cache_dir() == tmp_path / "models"
    monkeypatch.setenv("ESRL_CACHE", "")
    assert cache_dir() == tmp_path / ".cache" / "esrl"


@pytest.fixture(params=["file", "below-a-file"])
def cache_on_a_file(request, tmp_path, monkeypatch):
    """ESRL_CACHE that is a regular file, or a path below one (it cannot be created)."""
    (tmp_path / "cachefile").write_text("not a folder\n")
    cache = tmp_path / "cachefile" / ("below" if request.param == "below-a-file" else "")
    monkeypatch.setenv("ESRL_CACHE", str(cache))
    return cache


def test_cache_on_a_file_is_one_line_naming_esrl_cache(cache_on_a_file, tmp_path):
    """Refused before any conversion: by `ensure`, by the fit's needs check, and by `esrl fit` itself."""
    from conftest import run_esrl, write_tiny_config

    from esrl.errors import ConfigError
    from esrl.needs import check

    with pytest.raises(ConfigError, match=r"^ESRL_CACHE: .* is a file"):
        ensure(cache_on_a_file / "smollm2-135m-instruct", lambda tmp: pytest.fail("converted into a file"))
    with pytest.raises(ConfigError, match=r"smollm2-135m-instruct needs a folder .*\(ESRL_CACHE: "):
        check({"model": {"policy": {"name_or_path": "smollm2-135m-instruct"}}})
    config = write_tiny_config(tmp_path / "c.yaml", "smollm2-135m-instruct")
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path / "run")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    (error,) = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert error.startswith("esrl") and f"ESRL_CACHE: {cache_on_a_file} cannot be a folder" in error
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (a real folder nothing is made in)")
def test_output_folders_where_no_folder_can_be_made_are_one_line_each(tmp_path, monkeypatch):
    """A run folder or ESRL_CACHE where no folder can be made (here under /proc; elsewhere a read-only file system or
    another user's folder) was makedirs' traceback, after the models loaded: now one line naming the field, before
    any work."""
    from conftest import run_esrl, write_tiny_config

    config = write_tiny_config(tmp_path / "c.yaml", "smollm2-135m-instruct")
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", "/proc/runs")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.splitlines()[-1] == ("esrl: error: trainer.default_root_dir: /proc/runs cannot be written: no "
                                           "folder can be made in /proc (No such file or directory)")

    monkeypatch.setenv("ESRL_CACHE", "/proc/esrl-cache")
    out = run_esrl("fit", "--config", config, "--trainer.default_root_dir", tmp_path / "run")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert ("(ESRL_CACHE: /proc/esrl-cache cannot be written: no folder can be made in /proc (No such file or "
            "directory); point ESRL_CACHE at a writable folder)") in out.stderr.splitlines()[-1]
    assert not (tmp_path / "run").exists()


def _read_only_mounts_work() -> bool:
    """unshare -m and a read-only bind mount (root with CAP_SYS_ADMIN: CI's machine; not most desktops)."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _read_only_mounts_work(), reason="needs root's unshare -m for a read-only mount")
def test_a_read_only_cache_serves_the_model_it_holds(tmp_path):
    """A cache shared read-only (a cluster's, converted once) was refused by `esrl fit` and `esrl env` as a folder
    no model could be converted into, though the model was there and is only read. Now it serves; a model it lacks
    is still one line naming ESRL_CACHE. The cache here is the converted model hard-linked into a folder mounted
    read-only."""
    import os
    import shutil
    import subprocess

    from conftest import ESRL, write_tiny_config

    from esrl.models.loading import resolve_model_path

    converted = Path(resolve_model_path("smollm2-135m-instruct"))
    cache = tmp_path / "cache"
    cache.mkdir()

    def link(src, dst):
        try:
            os.link(src, dst)
        except OSError:  # another file system: a copy
            shutil.copy2(src, dst)

    shutil.copytree(converted, cache / converted.name, copy_function=link)
    config = write_tiny_config(tmp_path / "c.yaml", "smollm2-135m-instruct")
    read_only = f'mount --bind "{cache}" "{cache}" && mount -o remount,ro,bind "{cache}" "{cache}" && exec "$@"'
    env = {**os.environ, "ESRL_CACHE": str(cache)}

    def esrl_read_only(*args):
        return subprocess.run(["unshare", "-m", "sh", "-c", read_only, "_", *ESRL, *args], env=env,
                              capture_output=True, text=True, timeout=300)

    out = esrl_read_only("env", "--config", config)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"smollm2-135m-instruct: cached, {cache / converted.name}" in out.stdout
    assert "- [ok] model.policy.name_or_path: smollm2-135m-instruct" in out.stdout

    shutil.rmtree(cache / converted.name)
    out = esrl_read_only("env", "--config", config)
    assert out.returncode == 2 and "Read-only file system" in out.stderr.splitlines()[-1], out.stdout + out.stderr
