"""`python -m esrl`: the `esrl` command (esrl.entry)."""

from esrl.entry import main

main()
