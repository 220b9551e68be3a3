"""`esrl`'s entry point: a Ctrl+C at any moment ends in one line and exit 130, as one during training does.

esrl.cli imports torch and Lightning (seconds) before its own handling exists, and Lightning answers a
KeyboardInterrupt it catches (model loading, a second Ctrl+C mid-step) with "graceful shutdown" and exit 1, and a
library may catch it mid-import and fail later on the half-imported module (an ImportError). A
KeyboardInterrupt raised while Python runs a finalizer (a weakref callback) is lost, printed as "Exception ignored":
the press is kept in PRESSED, and esrl.callbacks.interruption stops the run after its first step instead. Kept apart
from esrl.cli so that this module's import is instant.
"""

from __future__ import annotations

import signal
import sys

INTERRUPTED = 130
PRESSED: list[int] = []
"""Ctrl+C presses seen before esrl.callbacks.interruption took SIGINT over (the signal numbers)."""


def on_sigint(signum, frame) -> None:
    """A Ctrl+C: noted in PRESSED (esrl's line and exit 130 however Lightning ends), then KeyboardInterrupt."""
    PRESSED.append(signum)
    raise KeyboardInterrupt


def _unraisable(unraisable) -> None:
    """A KeyboardInterrupt lost in a finalizer is in PRESSED, not a traceback on the terminal."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def main() -> None:
    signal.signal(signal.SIGINT, on_sigint)  # esrl.callbacks.interruption takes SIGINT over during training
    sys.unraisablehook = _unraisable
    try:
        from esrl.cli import main as run

        run()
    except KeyboardInterrupt:
        stopped()
    except SystemExit as e:
        from esrl.callbacks import interruption

        if e.code == 1 and (PRESSED or interruption.interrupted_by == "SIGINT"):  # Lightning's exit(1)
            stopped()
        raise
    except Exception:
        if PRESSED:  # what the Ctrl+C broke on its way (an import a library retried, half done): not a traceback
            stopped()
        raise


def stopped() -> None:
    print("esrl: interrupted (Ctrl+C)", file=sys.stderr)
    raise SystemExit(INTERRUPTED) from None
