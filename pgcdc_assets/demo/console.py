"""The demo's console and process plumbing: where the repository is, how it talks, how it stops."""

from __future__ import annotations

import signal
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class DemoFailure(Exception):
    """A failed step of the demo: printed as one line, exit status 1."""


def say(message: str = "") -> None:
    print(message, flush=True)


def step(title: str) -> None:
    say()
    say(f"== {title}")


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def install_signal_handlers() -> None:
    """Ctrl-C and SIGTERM end the demo cleanly (stopping dagster dev and PostgreSQL).

    Also when SIGINT was inherited as ignored (a background job of a non-interactive shell);
    again after every Dagster run, which leaves SIGTERM with whatever SIGINT had.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
