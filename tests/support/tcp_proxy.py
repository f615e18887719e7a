"""A small TCP proxy on 127.0.0.1 that a test controls: cut the network to PostgreSQL on command.

Every accepted client connection gets its own upstream connection and two pump threads.
``drop_all()`` closes both sides of every open connection (the client sees the connection
reset, the server sees its peer go away) and keeps accepting new ones, so a re-run goes
through the restored proxy. ``freeze()`` stops forwarding without closing anything, the
way a dead network path looks (no FIN, no RST); ``thaw()`` undoes it for new traffic.
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType


class TcpProxy:
    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._frozen = threading.Event()
        self._idle = threading.Event()  # never set: a sleep that needs no import
        self._closed = False
        self.accepted = 0
        self.dropped = 0
        self._refuse = 0
        self.refused = 0
        self._thread = threading.Thread(target=self._accept_loop, name="tcp-proxy-accept", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ control

    def dsn_for(self, dsn: str) -> str:
        """``dsn`` (a postgresql:// URL on 127.0.0.1) with its port replaced by the proxy's."""
        host, port = self.upstream
        needle = f"@{host}:{port}/"
        if needle not in dsn:
            raise ValueError(f"{dsn!r} does not point at {host}:{port}")
        return dsn.replace(needle, f"@127.0.0.1:{self.port}/")

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._pairs)

    def drop_all(self) -> int:
        """Close every open connection, both sides; returns how many were cut."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for client, server in pairs:
            for sock in (client, server):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
        self.dropped += len(pairs)
        return len(pairs)

    def refuse_next(self, connections: int) -> None:
        """Close the next ``connections`` accepted connections at once, unforwarded (PostgreSQL down
        for that long, as a client sees it); later ones are forwarded again."""
        with self._lock:
            self._refuse = connections

    def freeze(self) -> None:
        """Stop forwarding bytes in both directions without closing anything."""
        self._frozen.set()

    def thaw(self) -> None:
        self._frozen.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.drop_all()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ------------------------------------------------------------------ plumbing

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                refuse = self._refuse > 0
                if refuse:
                    self._refuse -= 1
                    self.refused += 1
            if refuse:
                client.close()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._pairs.append((client, server))
                self.accepted += 1
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                while self._frozen.is_set() and not self._closed:
                    self._idle.wait(0.05)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            with self._lock:
                self._pairs = [p for p in self._pairs if source not in p]
