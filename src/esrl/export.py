"""`esrl export`: rebuild an ES-trained model at any step from its base model and seed log."""

from __future__ import annotations

import argparse
from pathlib import Path

from esrl.es.modes import get_mode
from esrl.es.seed_log import read_seed_log, replay
from esrl.models import load_causal_lm, load_tokenizer


def export(seed_log: str, out: str, base: str | None = None, step: int | None = None) -> Path:
    header, records = read_seed_log(seed_log)
    base = base or header["policy"]["name_or_path"]
    model = load_causal_lm(base, header["policy"]["dtype"])
    model = replay(model, header, records, step)  # lora: the adapter-wrapped model
    mode = get_mode(header["es"]["mode"])  # lora: out/adapter/ and the merged model in out/
    return mode.save_final(model, load_tokenizer(base), out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="esrl export", description=__doc__)
    parser.add_argument("--seed-log", required=True, help="seed_log.jsonl of an ES run")
    parser.add_argument("--base", help="base model (default: the run's policy, from the log header)")
    parser.add_argument("--step", type=int, help="number of iterations to apply (default: all)")
    parser.add_argument("--out", required=True, help="output folder (Hugging Face format)")
    args = parser.parse_args(argv)
    out = export(args.seed_log, args.out, args.base, args.step)
    header, records = read_seed_log(args.seed_log)
    step = len(records) if args.step is None else args.step
    print(f"wrote {out} (step {step} of {len(records)}, {Path(args.seed_log).stat().st_size} bytes of seed log)")
