"""The test proxy really refuses and cuts connections while stopped (what server outages use)."""

import socket
import socketserver
import threading

import pytest

from tests.contract.proxy import TcpProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(1024):
            self.request.sendall(data)


def _roundtrip(port: int) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
        s.sendall(b"ping")
        return s.recv(1024)


def test_stop_refuses_and_start_serves_again():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = TcpProxy("127.0.0.1", server.server_address[1])
    try:
        proxy.start()
        assert _roundtrip(proxy.port) == b"ping"
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=2)
        held.sendall(b"x")
        assert held.recv(16) == b"x"
        proxy.stop()
        assert held.recv(16) == b""  # the open connection was cut
        with pytest.raises(OSError):
            _roundtrip(proxy.port)
        proxy.start()
        assert _roundtrip(proxy.port) == b"ping"
    finally:
        proxy.close()
        server.shutdown()
