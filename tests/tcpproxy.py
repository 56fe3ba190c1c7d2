"""A TCP proxy in front of the test database that can make one connection die silently.

A connection whose peer vanishes without a FIN or RST (a failover to a standby, a NAT or
firewall entry dropped, a proxy's host gone) looks alive to the client: its writes are
accepted, no answer ever comes. :meth:`TCPProxy.silence` does that to one proxied
connection: the server side is closed (the server ends the session and frees its locks),
the client side stays open and whatever the client sends is swallowed.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class _Pair:
    client: socket.socket
    server: socket.socket
    #: The server-side port of the proxy's outgoing connection (``client_port`` on the server).
    port: int
    silent: threading.Event = field(default_factory=threading.Event)


class TCPProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; every connection in a thread pair."""

    def __init__(self, target: tuple[str, int], delay: float = 0.0) -> None:
        self._target = target
        #: How long the server's data waits before it is passed on to the client.
        self._delay = delay
        self._listen = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listen.getsockname()[1]
        self._pairs: list[_Pair] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="tcp-proxy", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listen.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            pair = _Pair(client, server, server.getsockname()[1])
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._pairs.append(pair)
            threading.Thread(target=self._pump, args=(pair, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(pair, False), daemon=True).start()

    def _pump(self, pair: _Pair, upstream: bool) -> None:
        source, sink = (pair.client, pair.server) if upstream else (pair.server, pair.client)
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                if pair.silent.is_set():
                    return  # the client's socket is closed at the end only
                for sock in (pair.client, pair.server):
                    _shut(sock)
                return
            if pair.silent.is_set():
                continue  # swallowed: nothing reaches the server, nothing comes back
            if self._delay and not upstream:
                time.sleep(self._delay)
            try:
                sink.sendall(data)
            except OSError:
                if not pair.silent.is_set():
                    for sock in (pair.client, pair.server):
                        _shut(sock)
                return

    def silence(self, server_port: int) -> None:
        """Cut the connection whose server side has that port, silently for its client."""
        with self._lock:
            found = [p for p in self._pairs if p.port == server_port]
        assert found, f"no proxied connection from port {server_port}"
        for pair in found:
            pair.silent.set()
            _shut(pair.server)

    def server_ports(self) -> set[int]:
        with self._lock:
            return {p.port for p in self._pairs}

    def close(self) -> None:
        """Close everything, the silenced clients too (they then hear the end)."""
        with self._lock:
            self._closed = True
            pairs = list(self._pairs)
        self._listen.close()
        for pair in pairs:
            for sock in (pair.client, pair.server):
                _shut(sock)


@contextlib.contextmanager
def delaying_proxy(host: str, port: int, delay: float) -> Iterator[int]:
    """A proxy in a process of its own (see below) delaying every answer by ``delay``
    seconds; its port. Killed on exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.tcpproxy", host, str(port), str(delay)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.communicate()


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


if __name__ == "__main__":
    # A proxy in a process of its own (one in the test's process needs its interpreter):
    # ``python -m tests.tcpproxy HOST PORT DELAY`` prints its port, serves until killed.
    proxy = TCPProxy((sys.argv[1], int(sys.argv[2])), float(sys.argv[3]))
    print(proxy.port, flush=True)
    threading.Event().wait()
