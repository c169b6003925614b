"""A local HTTP server for tests that stand in for a remote end (a lying OpenAI server, a broken environment server, a
proxy): the handler class decides the answers; this starts it on a free port and stops it."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def send(handler: BaseHTTPRequestHandler, status: int, data: bytes) -> None:
    """Answer ``status`` with ``data`` as the whole body (its length in ``Content-Length``)."""
    handler.send_response(status)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class StubServer:
    """``handler`` served on 127.0.0.1 at a free port (``url``) from a daemon thread until `close`."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
