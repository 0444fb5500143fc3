"""The categories memory is counted in, planned and measured alike, and byte counts as people write them."""

from __future__ import annotations

import re

from fivefold.config import ConfigError

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "temporary")


def human_bytes(n: float) -> str:
    """Decimal units (GB = 1e9), the convention of the ZeRO paper's '16 bytes/param: 7B -> 112 GB'."""
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1000
    return f"{sign}{n:.2f} PB"


def parse_bytes(text: str, what: str = "--device-memory") -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '1.5TB', '512MiB', or a plain number of bytes (> 0)."""
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([KMGT]?)(i?)B?\s*", str(text), re.IGNORECASE)
    try:
        number = float(match.group(1)) if match else 0.0
    except ValueError:
        number = 0.0
    if number <= 0:
        raise ConfigError(f"{what} {text!r}: write a positive size like 80GB, 80GiB or 24e9")
    _, prefix, binary = match.groups()
    power = "KMGT".find(prefix.upper()) + 1 if prefix else 0
    return int(number * (1024 if binary else 1000) ** power)
