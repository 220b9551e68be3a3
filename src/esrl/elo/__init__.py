"""`esrl elo`: a held-out judge's Elo tournament between models' completion files.

files.py (read and pair completion files), judge.py (prompt templates, verdict parsing, the OpenAI-compatible
HTTP client), cache.py (judgments saved as they arrive), tournament.py (who meets whom, in both orders, and the
tally), rating.py (Bradley-Terry on the Elo scale with bootstrap intervals; numpy only), report.py (plot and
table), cli.py (the command).
"""

from esrl.elo.cli import main

__all__ = ["main"]
