"""`--ckpt_path` checked before any model loads, so a missing, truncated or garbage checkpoint is one line naming
the file instead of a traceback from deep inside torch.load after minutes of model loading.

The check is cheap whatever the checkpoint's size: torch.save writes a zip archive, and a zip's directory sits
at its end, so reading the directory (not the tensors) finds a truncated file. `last` is resolved here first
(resolve_last: Lightning's own looks only in the fit's new version folder and finds nothing); its other special
values ("best", "hpc", "registry...") and remote URLs are left to Lightning; a DeepSpeed checkpoint is a folder.
Corrupt records inside a valid zip are found by esrl.resume's memory-mapped read. Also here: a
`trainer.default_root_dir` that cannot be a folder (below a file), named in one line before anything is written.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from esrl.errors import ConfigError, DataError

_LIGHTNING_NAMES = ("last", "best", "hpc")
RESUMABLE = ("interrupted.ckpt", "last.ckpt")
"""What a run folder resumes from: esrl's checkpoint on a signal (esrl.callbacks.interruption), ModelCheckpoint's
save_last."""


def deepspeed_folder(path: Path) -> bool:
    """A DeepSpeed checkpoint: Lightning saves one as a folder (DeepSpeed's `latest` file and its tag's folder)."""
    return path.is_dir() and ((path / "latest").is_file() or (path / "checkpoint").is_dir())


def run_checkpoints(root: str | Path) -> list[Path]:
    """A run root's RESUMABLE checkpoints, in each lightning_logs/version_N/checkpoints/ (where both are saved): files,
    or DeepSpeed's folders."""
    folders = Path(root).expanduser().glob("lightning_logs/version_*/checkpoints")
    return [folder / name for folder in folders for name in RESUMABLE
            if (folder / name).is_file() or deepspeed_folder(folder / name)]


def newest_checkpoint(paths: Iterable[Path]) -> Path | None:
    """The newest file by modification time (a tie: the first name), the pick of slurm/fit.sbatch's `ls -t` and of
    Lightning's own `last`, so that every resume (esrl study, fit.sbatch, --ckpt_path last) takes the same one."""
    found = []
    for path in paths:
        try:  # a DeepSpeed folder keeps its first time; its `latest` is rewritten at every save
            stamp = (path / "latest" if deepspeed_folder(path) else path).stat().st_mtime_ns
            found.append((-stamp, str(path), path))
        except FileNotFoundError:  # removed meanwhile (a run finishing spends its interrupted.ckpt)
            continue
    return min(found)[2] if found else None


def resolve_last(trainer: dict[str, Any]) -> str:
    """`--ckpt_path last` as the newest of the run root's run_checkpoints and of a ModelCheckpoint dirpath's
    last*.ckpt: Lightning's own looks in this fit's new version folder (a new one each fit), found nothing and
    trained from step 0 with a warning and exit 0. `trainer`: the parsed trainer section."""
    root = Path(trainer.get("default_root_dir") or "runs")  # esrl.cli's loggers' save_dir
    dirs = [str(cb["init_args"]["dirpath"]) for cb in trainer.get("callbacks") or []
            if isinstance(cb, dict) and str(cb.get("class_path", "")).endswith("ModelCheckpoint")
            and (cb.get("init_args") or {}).get("dirpath")]
    found = newest_checkpoint([*run_checkpoints(root), *(p for d in dirs for p in Path(d).glob("last*.ckpt"))])
    if found is None:
        raise DataError(f"--ckpt_path last: no checkpoint to resume in {root}/lightning_logs/version_*/checkpoints "
                        f"(last.ckpt or interrupted.ckpt){''.join(f' or {d}/last*.ckpt' for d in dirs)}; give a "
                        "checkpoint file, or start without --ckpt_path")
    return str(found)


def check_ckpt_path(ckpt_path: str | Path | None) -> None:
    if ckpt_path is None:
        return
    text = str(ckpt_path)
    if text in _LIGHTNING_NAMES or text.startswith("registry") or "://" in text:
        return
    path = Path(text).expanduser()
    if not path.exists():
        raise DataError(f"--ckpt_path {text}: no such file")
    if path.is_dir():  # a DeepSpeed checkpoint: Lightning reads its folder (DeepSpeed's `latest` and its tag's folder)
        if not deepspeed_folder(path):
            model = (" It holds a Hugging Face model (config.json): start a run from it with "
                     "--model.policy.name_or_path; resume from a run's checkpoints/*.ckpt"
                     if (path / "config.json").is_file() else "")
            raise DataError(f"--ckpt_path {text}: a folder, but not a DeepSpeed checkpoint (no `latest` file or "
                            f"checkpoint/ folder in it); give a .ckpt file.{model}")
        return
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as e:
        raise DataError(f"--ckpt_path {text}: not a readable checkpoint, truncated or not written by torch.save "
                        f"({path.stat().st_size} bytes; {e})") from None
    if not any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        raise DataError(f"--ckpt_path {text}: a zip archive but not a torch checkpoint (no data.pkl)")


def check_root_dir(root: str | Path | None, field: str = "trainer.default_root_dir", writes: bool = True) -> None:
    """An output folder (trainer.default_root_dir, a tool's --out) must be (or be creatable as) a folder: its
    nearest existing ancestor is one, and, when the command `writes` there, a folder can be made in it (a probe,
    removed at once: permissions, a read-only file system). Checked before any work, so either is one line, not
    makedirs' traceback after the models load."""
    if root is None or "://" in str(root):
        return
    path = Path(str(root)).expanduser().absolute()
    for folder in (path, *path.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ConfigError(f"{field}: {root} cannot be a folder: {folder} is a file")
            if not writes:
                return
            try:
                os.rmdir(tempfile.mkdtemp(prefix=".esrl-probe-", dir=folder))
            except OSError as e:
                raise ConfigError(f"{field}: {root} cannot be written: no folder can be made in {folder} "
                                  f"({e.strerror or e})") from None
            return
