"""Sizes in and out: ``"64K"`` -> 65536 for command lines, 65536 -> ``"64 KiB"`` for tables and
error messages. One formatter for every table and message of the project."""

from __future__ import annotations

import argparse

__all__ = ["format_bytes", "parse_size"]


def format_bytes(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``"8"``, ``"64K"``, ``"4MiB"`` -> bytes (an ``argparse`` type: a bad size is its error)."""
    stripped = text.strip().upper()
    digits = stripped.rstrip("KMGIB")
    suffix = stripped[len(digits):]
    if not digits.isdigit() or suffix not in _SUFFIXES:
        raise argparse.ArgumentTypeError(f"size {text!r}: expected an integer with an optional K/M/G suffix")
    return int(digits) * _SUFFIXES[suffix]
