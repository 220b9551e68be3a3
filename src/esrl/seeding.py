"""Seeds derived from names and integers: stable across machines, processes and Python versions.

Every random stream esrl draws (ES noise, LoRA initialization, GRPO sampling) takes its seed from here, so a
stream depends on what it is for and never on the order in which streams were drawn.
"""

from __future__ import annotations

import hashlib

MASK63 = (1 << 63) - 1


def derive_seed(namespace: str, *parts: object) -> int:
    """A 63-bit seed from `namespace:part0:part1:...` (blake2b, little-endian): the same string, the same seed."""
    key = ":".join([namespace, *map(str, parts)]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & MASK63
