"""The embedded Sail engine's server, run as a child process of pgcdc (``SparkEngine.embedded``).

Why a child and not a thread of pgcdc's process: Sail 0.7.2 keeps about 100 KB for every
operation it executes, for the life of the process. Closing the Spark session, letting the
server drop the session, even stopping the server does not return it (measured in
docs/engine-notes.md); only the process exit does. In a child, closing the engine gives all of
it back, and a panic in the engine cannot take the replication client down with it.

Protocol with the parent: the server prints its port on a line of stdout once it listens, then
serves until its stdin closes, which also happens when the parent dies (even by SIGKILL), so an
orphaned server never outlives pgcdc.
"""

from __future__ import annotations

import sys

from pysail.spark import SparkConnectServer


def main() -> None:
    server = SparkConnectServer(ip="127.0.0.1", port=0)
    server.start(background=True)
    _, port = server.listening_address
    print(port, flush=True)
    try:
        sys.stdin.buffer.read()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
