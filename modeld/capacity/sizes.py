"""Sizes and the other scalar settings, as the operator writes them.

``parse_size`` reads "60MB", "8GiB", "512k" or a byte count (``parse_size_or_auto``
also "auto", for the budgets that have one); ``format_size`` writes bytes back in
binary units. Every size modeld reads (flags, environment, config file) goes
through ``parse_size``. The fraction and token-count parsers are the
Policy's (``policy.py``), kept here so every value-from-text rule is in one place.
A parser's message quotes the value; the settings say where it came from.
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_FLOOR, Decimal, InvalidOperation

__all__ = ["AUTO", "format_size", "parse_count", "parse_fraction", "parse_size", "parse_size_or_auto"]

#: what a budget with a computed default accepts instead of a size
AUTO = "auto"

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_FORMAT_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_size(value: str | int) -> int:
    """Bytes from "60MB", "8GiB", "512k", "1.5 GiB" or a plain count.

    Decimal prefixes are powers of ten (k/kB = 1000, M/MB = 10^6, G/GB = 10^9, T/TB);
    binary ones are powers of two (Ki/KiB = 1024, Mi/MiB = 2^20, Gi/GiB, Ti/TiB).
    Units are case-insensitive; a single letter is decimal (SI), as in "512k" =
    512,000. Fractions round down to whole bytes. Raises ValueError on anything else.
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected a byte count")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value}: must be >= 0")
        return value
    if not isinstance(value, str):
        raise ValueError(f"invalid size {value!r}: expected a string or an int")
    if value.strip().startswith("-"):
        raise ValueError(f"invalid size {value!r}: must be >= 0")
    m = _SIZE_RE.match(value)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {value!r}: expected a number with an optional unit, e.g. 512k, 60MB, 1.5GiB, 8GiB"
        )
    try:
        number = Decimal(m.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"invalid size {value!r}") from exc
    scaled = number * _UNITS[unit]
    if _UNITS[unit] == 1 and scaled != scaled.to_integral_value():
        raise ValueError(f"invalid size {value!r}: a byte count must be whole")
    return int(scaled.to_integral_value(rounding=ROUND_FLOOR))


def parse_size_or_auto(value: str | int) -> int | None:
    """``parse_size``, or None for "auto" (any case): the caller computes the size itself."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return None
    return parse_size(value)


def format_size(n: int) -> str:
    """Human-readable binary size: "8GiB" when exact, else two decimals ("92.10MiB"); "512B" below 1 KiB.

    ``parse_size(format_size(n))`` is exact for multiples of the chosen unit and
    within 0.5% otherwise.
    """
    if n < 0:
        return "-" + format_size(-n)
    for suffix, unit in _FORMAT_UNITS:
        if n >= unit:
            if n % unit == 0:
                return f"{n // unit}{suffix}"
            return f"{n / unit:.2f}{suffix}"
    return f"{n}B"


def parse_fraction(value: str | float) -> float:
    """0.1, "0.1" or "10%" → 0.1, in [0, 1)."""
    try:
        if isinstance(value, str):
            s = value.strip()
            f = float(s[:-1]) / 100 if s.endswith("%") else float(s)
        elif isinstance(value, bool):
            raise ValueError
        else:
            f = float(value)
    except ValueError:
        raise ValueError(f"invalid fraction {value!r}: expected e.g. 0.1 or 10%") from None
    if not 0.0 <= f < 1.0 or math.isnan(f):
        raise ValueError(f"fraction {value!r} must be in [0, 1)")
    return f


def parse_count(value: str | float) -> int:
    """A whole token count >= 0, from 512 or "512"."""
    try:
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            raise ValueError
        n = int(value.strip()) if isinstance(value, str) else int(value)
    except ValueError:
        raise ValueError(f"invalid token count {value!r}: expected a whole number") from None
    if n < 0:
        raise ValueError(f"token count {value!r} must be >= 0")
    return n
