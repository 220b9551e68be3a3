"""`esrl`'s entry point: a Ctrl+C at any moment ends in one line and exit 130, as one during training does.

esrl.cli imports torch and Lightning (seconds) before its own handling exists, and Lightning answers a
KeyboardInterrupt it catches (model loading, a second Ctrl+C mid-step) with "graceful shutdown" and exit 1. Kept
apart from esrl.cli so that this module's import is instant.
"""

from __future__ import annotations

import signal
import sys

INTERRUPTED = 130


def main() -> None:
    pressed = []

    def on_sigint(signum, frame):
        pressed.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)  # esrl.callbacks.interruption takes SIGINT over during training
    try:
        from esrl.cli import main as run

        run()
    except KeyboardInterrupt:
        stopped()
    except SystemExit as e:
        from esrl.callbacks import interruption

        if e.code == 1 and (pressed or interruption.interrupted_by == "SIGINT"):  # Lightning's exit(1)
            stopped()
        raise


def stopped() -> None:
    print("esrl: interrupted (Ctrl+C)", file=sys.stderr)
    raise SystemExit(INTERRUPTED) from None
