"""The `tidegate` command's argument types: each turns one word of the command line into a
value, or refuses it naming the word (argparse prints the message and exits 2)."""

from __future__ import annotations

import argparse


def positive(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {raw}")
    return value


def weight(raw: str) -> int:
    """A tenant's fair queuing weight (store/tenants.py fair_weight)."""
    if not (raw.isdigit() and 1 <= int(raw) <= 1000):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a weight 1-1000")
    return int(raw)


def priority(raw: str) -> int:
    if not (raw.isdigit() and 0 <= int(raw) <= 9):
        raise argparse.ArgumentTypeError(f"{raw!r} is not a priority 0-9")
    return int(raw)


def turn_range(raw: str) -> tuple[int, int]:
    """A synthetic trace's turns per session: `3` or `2-4`."""
    low, sep, high = raw.partition("-")
    try:
        return (int(low), int(high)) if sep else (int(low), int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a turn range like 2-4") from None
