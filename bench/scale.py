"""``python -m bench.scale <part> [options]``: the scale benchmarks (docs/benchmarks.md; not part of ``make test``).

Each part is a module ``bench/scale_<part>.py`` with a ``main(argv) -> int``; this dispatcher
imports the one named and hands it the remaining arguments, so parts can be added without
touching it. ``python -m bench.scale`` alone lists the parts present. Every part reports its
figures as ratios against a baseline measured in the same run.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from pathlib import Path

PART_PREFIX = "scale_"


def parts() -> list[str]:
    """The parts present: ``bench/scale_<part>.py`` files."""
    return sorted(
        module.name.removeprefix(PART_PREFIX)
        for module in pkgutil.iter_modules([str(Path(__file__).parent)])
        if module.name.startswith(PART_PREFIX)
    )


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    available = parts()
    if not arguments or arguments[0] not in available or not re.fullmatch(r"[a-z_]+", arguments[0]):
        named = f"unknown part {arguments[0]!r}; " if arguments and not arguments[0].startswith("-") else ""
        print(f"usage: python -m bench.scale PART [options]: {named}parts: {', '.join(available)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench.{PART_PREFIX}{arguments[0]}")
    return int(module.main(arguments[1:]))


if __name__ == "__main__":
    sys.exit(main())
