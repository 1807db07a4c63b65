"""Sizes and bandwidths at the edges: parse user text into integers, format integers for people.

Inside the library bytes are always ``int`` and bandwidths bytes per second (``float``).
"""

from __future__ import annotations

import math
import re

from lmscli.errors import InputError

_BINARY = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SHORT = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int | float) -> int:
    """Parse ``16GiB``, ``512MiB``, ``1.5e9``, ``32GB``, ``16G`` or a number of bytes into bytes.

    Binary suffixes (KiB, MiB, GiB, TiB, and the short K/M/G/T) are powers of 1024;
    decimal ones (KB, MB, GB, TB) are powers of 1000.
    """
    if isinstance(text, bool):
        raise InputError(f"not a size: {text!r}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise InputError(f"not a size: {text!r} (write e.g. 16GiB, 512MiB, 32GB or 1.5e9)")
        value, unit = float(match.group(1)), match.group(2).lower()
    factor = _BINARY.get(unit) or _DECIMAL.get(unit) or _SHORT.get(unit)
    if factor is None:
        raise InputError(f"unknown size unit {unit!r} in {text!r} (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)")
    result = value * factor
    if not math.isfinite(result) or result < 0:
        raise InputError(f"not a size: {text!r}")
    return int(round(result))


def format_size(num_bytes: int | float | None, precision: int = 2) -> str:
    """Format bytes with binary units: ``format_size(3 << 30) == '3.00 GiB'``."""
    if num_bytes is None:
        return "unknown"
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            break
        value /= 1024
    else:  # pragma: no cover - loop always breaks
        unit = "GiB"
    if unit == "B":
        return f"{sign}{int(value)} B"
    if unit == "GiB" and value >= 1024:
        return f"{sign}{value / 1024:.{precision}f} TiB"
    return f"{sign}{value:.{precision}f} {unit}"


def format_flops(flops: int | float) -> str:
    """Floating-point operations with decimal units: ``format_flops(3.2e9) == '3.20 GFLOP'``."""
    value = float(flops)
    if value < 999.5:
        return f"{value:.0f} FLOP"
    for unit in ("kFLOP", "MFLOP", "GFLOP", "TFLOP"):
        value /= 1000
        if value < 999.995:  # (what rounds to 1000.00 is shown in the next unit)
            return f"{value:.2f} {unit}"
    return f"{value / 1000:.2f} PFLOP"


_BW_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]+)\s*/\s*s\s*$")


def parse_bandwidth(text: str) -> float:
    """Parse ``25GB/s``, ``16GiB/s`` or ``150e9B/s`` into bytes per second."""
    match = _BW_RE.match(str(text))
    if not match:
        raise InputError(f"not a bandwidth: {text!r} (write e.g. 25GB/s or 16GiB/s)")
    per_second = parse_size(match.group(1) + match.group(2))
    if per_second <= 0:
        raise InputError(f"bandwidth must be positive: {text!r}")
    return float(per_second)
