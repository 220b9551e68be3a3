"""`esrl export`: rebuild an ES-trained model at any step from its base model and seed log."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from esrl.atomic_files import partial_dir, write_final
from esrl.checkpoints import check_root_dir
from esrl.errors import ConfigError, DataError
from esrl.es.fingerprint import weights_fingerprint
from esrl.es.modes import get_mode
from esrl.es.noise import noise_source, other_noise_source
from esrl.es.seed_log import read_seed_log, replay
from esrl.models import load_causal_lm, load_tokenizer


def check_base(model, base: str, header: dict, seed_log: str) -> None:
    """The seeds only reproduce the run on the model it started from: another --base is refused in one line. Logs
    written before the header carried a fingerprint are exported with a warning."""
    expected = header.get("base_fingerprint")
    if expected is None:
        print(f"esrl export: warning: {seed_log} records no base fingerprint (an older log): cannot check that "
              f"{base} is the run's base model", file=sys.stderr)
        return
    found = weights_fingerprint(model)
    if found != expected:
        raise DataError(f"--base {base}: not the base model of {seed_log} (weights fingerprint {found}, the log's "
                        f"{expected}; the run started from {header['policy']['name_or_path']})")


def replay_device(header: dict, seed_log: str) -> str:
    """Where the run drew its noise: a GPU's generator (Triton's Philox) and the CPU's draw different numbers from
    one seed, so a run trained on a GPU replays on one, or is refused in one line rather than rebuilt wrong."""
    device = header.get("device")
    if device is None:
        print(f"esrl export: warning: {seed_log} records no device (an older log): replayed on the CPU, which "
              "rebuilds a run trained on the CPU only", file=sys.stderr)
        return "cpu"
    if device != "cpu" and not getattr(torch, device).is_available():
        raise DataError(f"{seed_log}: the run drew its noise on {device}, whose generator the CPU's does not "
                        f"repeat; export it on a machine with {device}")
    if why := other_noise_source(header.get("noise_source"), noise_source(device)):
        print(f"esrl export: warning: {seed_log}: {why}; export on that GPU model, or compare with the run's final/",
              file=sys.stderr)
    return device


def check_out(out: str) -> None:
    """--out, before the seed log is read: a new folder or an empty one."""
    check_root_dir(out, "--out")  # transformers only warns when saving into a file, and writes nothing
    if Path(out).is_dir() and any(Path(out).iterdir()):  # another model's files would be replaced, or mixed in
        raise ConfigError(f"--out {out}: a folder with files in it; export writes a new folder (or an empty one)")


def export(seed_log: str, out: str, base: str | None = None, step: int | None = None) -> Path:
    """The weights after `step` logged iterations (default: all) saved under `out`, which appears only complete;
    step K needs lines up to K intact, whatever follows them."""
    check_out(out)
    header, records = read_seed_log(seed_log, step)
    base = base or header["policy"]["name_or_path"]
    model = load_causal_lm(base, header["policy"]["dtype"])
    check_base(model, base, header, seed_log)
    model = model.to(replay_device(header, seed_log))
    model = replay(model, header, records)  # lora: the adapter-wrapped model
    mode = get_mode(header["es"]["mode"])  # lora: out/adapter/ and the merged model in out/
    tokenizer = load_tokenizer(base)
    return _save_complete(lambda folder: mode.save_final(model, tokenizer, folder), Path(out).resolve())


def _save_complete(save, out: Path) -> Path:
    """A new `out` appears whole (esrl.atomic_files.write_final). An empty folder that exists (`--out .`, one the user
    made) is kept, not replaced: the model is saved whole beside it, then moved in, config.json last, so the folder
    never looks like a loadable model before it is one."""
    if not out.exists():
        return write_final(save, out)
    whole = write_final(save, partial_dir(out))
    for item in sorted(whole.iterdir(), key=lambda item: item.name == "config.json"):
        item.rename(out / item.name)
    whole.rmdir()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="esrl export", description=__doc__)
    parser.add_argument("--seed-log", required=True, help="seed_log.jsonl of an ES run")
    parser.add_argument("--base", help="base model (default: the run's policy, from the log header)")
    parser.add_argument("--step", type=int, help="number of iterations to apply (default: all)")
    parser.add_argument("--out", required=True, help="output folder (Hugging Face format), new or empty")
    args = parser.parse_args(argv)
    check_out(args.out)
    steps = len(read_seed_log(args.seed_log, args.step)[1])  # fixed now: a live run's log grows meanwhile
    out = export(args.seed_log, args.out, args.base, steps)
    print(f"wrote {out} (step {steps}, {Path(args.seed_log).stat().st_size} bytes of seed log)")
