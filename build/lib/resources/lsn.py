"""PostgreSQL log sequence numbers.

An LSN is a 64-bit byte position in the WAL. PostgreSQL prints it as two
hexadecimal halves, ``X/Y``; the protocol sends it as a big-endian uint64.
Subclassing ``int`` keeps ordering and arithmetic exact and free.
"""

from __future__ import annotations

import re

_LSN_TEXT = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")


class LSN(int):
    """A WAL position; ``str()`` gives PostgreSQL's ``X/Y`` form."""

    __slots__ = ()

    MAX = 0xFFFF_FFFF_FFFF_FFFF

    def __new__(cls, value: int | str | LSN = 0) -> LSN:
        if isinstance(value, str):
            return cls.parse(value)
        if not 0 <= value <= cls.MAX:
            raise ValueError(f"LSN out of range: {value}")
        return super().__new__(cls, value)

    @classmethod
    def parse(cls, text: str) -> LSN:
        match = _LSN_TEXT.match(text.strip())
        if match is None:
            raise ValueError(f"not an LSN (expected X/Y in hexadecimal): {text!r}")
        high, low = (int(part, 16) for part in match.groups())
        return super().__new__(cls, (high << 32) | low)

    def __str__(self) -> str:
        return f"{int(self) >> 32:X}/{int(self) & 0xFFFF_FFFF:X}"

    def __repr__(self) -> str:
        return f"LSN('{self}')"

    def __add__(self, other: int) -> LSN:
        return LSN(int(self) + int(other))

    def __sub__(self, other: int) -> int:
        """Distance in bytes; subtracting two LSNs gives a plain int (may be negative)."""
        return int(self) - int(other)


INVALID_LSN = LSN(0)
