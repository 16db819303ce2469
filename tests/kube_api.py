"""A stand-in for the Kubernetes API server's Node endpoint: GET /api/v1/nodes/NAME answers the
node with `spec.unschedulable` as a test sets it (what `kubectl cordon`/`uncordon` change), to
callers that present the bearer token; 401 without it, 404 for other nodes or paths. Plain
HTTP on loopback; every request is recorded."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeNodeApi:
    token: str
    cordoned: dict[str, bool] = field(default_factory=dict)
    requests: list[tuple[str, int]] = field(default_factory=list)  # (path, status)
    url: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def set_cordoned(self, node: str, value: bool) -> None:
        with self._lock:
            self.cordoned[node] = value

    def answer(self, path: str, authorization: str | None) -> tuple[int, dict[str, object]]:
        prefix = "/api/v1/nodes/"
        with self._lock:
            if authorization != f"Bearer {self.token}":
                status, body = 401, {"kind": "Status", "reason": "Unauthorized"}
            elif not path.startswith(prefix) or path[len(prefix):] not in self.cordoned:
                status, body = 404, {"kind": "Status", "reason": "NotFound"}
            else:
                name = path[len(prefix):]
                spec = {"unschedulable": True} if self.cordoned[name] else {}
                status, body = 200, {"apiVersion": "v1", "kind": "Node",
                                     "metadata": {"name": name}, "spec": spec}
            self.requests.append((path, status))
        return status, body


@contextmanager
def serving(api: FakeNodeApi) -> Iterator[FakeNodeApi]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            status, body = api.answer(self.path, self.headers.get("Authorization"))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    api.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield api
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
