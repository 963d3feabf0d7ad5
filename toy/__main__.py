"""`python -m toy [small|large]`: build the TL;DR-like world (or its larger SFT policy) if needed, and print the
numbers measured at build time."""

import json
import os
import sys

import toy


def summary(size: str = "small") -> dict:
    """Build if needed, then print and return the numbers measured at build time (`size` "large": those of
    the larger SFT policy)."""
    (toy.build_large if size == "large" else toy.build)()
    with open(os.path.join(toy.LARGE_DIR if size == "large" else toy.TOY_DIR, "summary.json")) as f:
        numbers = json.load(f)
    for name, value in numbers.items():
        print(f"{name:>32}: {value:.3f}" if isinstance(value, float) else f"{name:>32}: {value}")
    return numbers


if __name__ == "__main__":
    if sys.argv[1:] not in ([], ["small"], ["large"]):
        raise SystemExit(f"usage: python -m toy [small|large] (the SFT policy's size), got {' '.join(sys.argv[1:])}")
    summary(*sys.argv[1:])
