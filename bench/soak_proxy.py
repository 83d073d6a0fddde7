"""A loopback TCP proxy in front of the vLLM server that cuts or delays one HTTP request on demand.

The soak's trainer talks to the server only through this proxy (``url``), so two network faults
can be injected without touching weightsync or vLLM:

* ``arm("cut", route)``: the next request whose path contains ``route`` is forwarded to the server
  (it acts on it) and then both sockets are closed before the answer reaches the client -- the worst
  case of a dropped connection (the server did the work, the client never hears it);
* ``arm("delay", None, delay_s)``: every request waits ``delay_s`` before it is forwarded (a slow
  server), until ``disarm()``.

``retarget(port)`` points the proxy at a restarted server, so the trainer's URL never changes.

Invariants: it listens on 127.0.0.1 only; every socket has a timeout (``IDLE_S``), so no thread waits
forever; each fault fires a bounded number of times (``fired`` counts them), and the soak checks that
the fault it armed actually fired -- an armed fault that never fired is reported, not counted.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

__all__ = ["FaultProxy"]

logger = logging.getLogger("weightsync.bench.soak.proxy")

#: seconds a proxied socket may stay silent before the proxy gives up on it
IDLE_S = 120.0


class FaultProxy:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._lock = threading.Lock()
        self._mode: str | None = None
        self._route: str | None = None
        self._delay_s = 0.0
        self.fired = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        threading.Thread(target=self._accept, name="soak-proxy", daemon=True).start()

    # ---- control -------------------------------------------------------------------------------

    def retarget(self, upstream_port: int) -> None:
        with self._lock:
            self.upstream_port = upstream_port

    def arm(self, mode: str, route: str | None = None, delay_s: float = 0.0) -> None:
        assert mode in ("cut", "delay"), mode
        with self._lock:
            self._mode, self._route, self._delay_s, self.fired = mode, route, delay_s, 0

    def disarm(self) -> int:
        """Stop injecting; returns how many requests the fault hit."""
        with self._lock:
            self._mode, self._route, self._delay_s = None, None, 0.0
            return self.fired

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    # ---- data path -----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), name="soak-proxy-conn", daemon=True).start()

    def _decide(self, head: bytes) -> tuple[str | None, float]:
        """What to do with the request whose first bytes are ``head`` (consumes a one-shot cut)."""
        try:
            path = head.split(b"\r\n", 1)[0].split(b" ")[1].decode()
        except (IndexError, UnicodeDecodeError):
            path = ""
        with self._lock:
            if self._mode == "delay":
                self.fired += 1
                return "delay", self._delay_s
            if self._mode == "cut" and self._route is not None and self._route in path:
                self._mode = None  # one shot
                self.fired += 1
                logger.info("proxy: cutting %s after forwarding it", path)
                return "cut", 0.0
        return None, 0.0

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(IDLE_S)
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=IDLE_S)
        except OSError:
            client.close()
            return
        try:
            head = client.recv(65536)
            if not head:
                return
            action, delay_s = self._decide(head)
            if action == "delay":
                time.sleep(delay_s)
            upstream.sendall(head)
            if action == "cut":
                # forward the rest of the body the client is sending, give the server a moment to
                # act on it, then drop both ends before any answer reaches the client
                client.settimeout(0.2)
                try:
                    while chunk := client.recv(65536):
                        upstream.sendall(chunk)
                except (socket.timeout, OSError):
                    pass
                time.sleep(0.3)
                return
            back = threading.Thread(target=_pump, args=(upstream, client), daemon=True)
            back.start()
            _pump(client, upstream)
            back.join(IDLE_S)
        except OSError:
            pass
        finally:
            for s in (client, upstream):
                try:
                    s.close()
                except OSError:
                    pass


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while chunk := src.recv(65536):
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
