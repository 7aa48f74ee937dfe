"""A real `kvtier serve` process on a free loopback port, and the flags tests start it with."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.server_process import ServerProcess

__all__ = ["ServerProcess"]

REPO_ROOT = Path(__file__).resolve().parents[2]
ADMIN_TOKEN = "test-admin-token-0123456789"
STORELESS_KEY = "sk-from-kvtier"  # the API key of the storeless server, from KVTIER_API_KEY
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
# Servers of the tiny model run eager elementwise ops: compiling the fused forms would add
# seconds to every server's start, and tests/engine/test_fused_ops.py checks them.
EAGER_OPS = "--no-fuse-elementwise"


def server_flags(model_path: str, *extra: str, num_kv_blocks: int = 256) -> list[str]:
    return [
        "--model", model_path, "--dtype", "float32", "--num-kv-blocks", str(num_kv_blocks),
        "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", MODEL_NAME,
        "--log-level", "warning", EAGER_OPS, *extra,
    ]


def scrape(http: httpx.Client) -> dict[str, dict[str, float]]:
    """family name -> {sample name + labels: value}."""
    response = http.get("/metrics")
    assert response.status_code == 200
    families = {}
    for family in text_string_to_metric_families(response.text):
        families[family.name] = family
    return families


def value(families, name: str, sample: str | None = None, **labels: str) -> float:
    family = families[name]
    sample = sample or (name + "_total" if family.type == "counter" else name)
    total = 0.0
    for s in family.samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total


class RawConnection:
    """One keep-alive HTTP/1.1 connection driven by hand (h11), to see what the server
    does to the connection itself: several requests on one socket, or a body that never
    arrives."""

    def __init__(self, url: str, source_host: str | None = None) -> None:
        import socket

        import h11

        host, port = url.removeprefix("http://").rsplit(":", 1)
        self._h11 = h11
        self.sock = socket.create_connection((host, int(port)), timeout=30,
                                             source_address=(source_host, 0) if source_host else None)
        self.conn = h11.Connection(h11.CLIENT)

    def request(self, path: str, body: bytes, content_length: int | None = None,
                headers: dict[str, str] | None = None) -> None:
        """Send the head and `body`; `content_length` may announce more than is sent."""
        h11 = self._h11
        length = len(body) if content_length is None else content_length
        headers = [("Host", "kvtier"), ("Content-Type", "application/json"), ("Content-Length", str(length)),
                   *(headers or {}).items()]
        self.sock.sendall(self.conn.send(h11.Request(method="POST", target=path, headers=headers)))
        self.sock.sendall(self.conn.send(h11.Data(data=body)))
        if len(body) == length:
            self.sock.sendall(self.conn.send(h11.EndOfMessage()))

    def response(self) -> tuple[int, bytes]:
        """The next response's status and body."""
        h11 = self._h11
        status, chunks = None, []
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                chunks.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return status, b"".join(chunks)
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the server closed the connection")

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One request on this connection; ready for the next one after it."""
        self.request(path, body, headers=headers)
        result = self.response()
        self.conn.start_next_cycle()
        return result

    def closed_by_server(self, timeout_s: float) -> bool:
        """Whether the server closes the connection within `timeout_s` seconds."""
        self.sock.settimeout(timeout_s)
        try:
            while self.sock.recv(65536):
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        return True

    def close(self) -> None:
        self.sock.close()
