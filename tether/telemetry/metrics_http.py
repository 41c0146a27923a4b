"""The /metrics HTTP endpoint with a bounded number of threads.

prometheus-client's own `start_http_server` starts a thread per connection, without limit: a scrape flood (or
connections that never send a request) would grow the process's threads without bound, and each scrape would
reach the collectors. Here at most `workers` connections are served at once; one beyond them is answered
`503` and closed on the accepting thread, and a connection that sends nothing is closed after `timeout_s`.
The collectors themselves read a cached snapshot (metrics.CachedSnapshot), so even the served scrapes reach a
service's serving state at most once per refresh.
"""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from tether import settings

_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\nRetry-After: 1\r\n\r\n"


class _QuietHandler(WSGIRequestHandler):
    timeout = settings.METRICS_HTTP_TIMEOUT_S   # StreamRequestHandler: a silent connection is closed after it

    def log_message(self, format: str, *args: object) -> None:   # no line per scrape on stderr
        pass


class BoundedWSGIServer(WSGIServer):
    """A WSGI server that serves at most `workers` connections at once, each on its own daemon thread."""

    workers = settings.METRICS_HTTP_WORKERS

    def server_bind(self) -> None:
        self._slots = threading.BoundedSemaphore(self.workers)
        self.refused = 0           # connections answered 503 because every worker was busy
        super().server_bind()

    def process_request(self, request, client_address) -> None:   # request: a TCP socket here
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            try:
                request.settimeout(0.5)   # a few bytes into an empty send buffer: never blocks the accept loop
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        threading.Thread(target=self._serve_one, args=(request, client_address), daemon=True,
                         name="metrics-http").start()

    def _serve_one(self, request: socket.socket, client_address: object) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        pass   # a client that went away mid-reply is its own business; nothing to print per connection


class _IPv6Server(BoundedWSGIServer):
    address_family = socket.AF_INET6


def start(registry: CollectorRegistry, host: str, port: int,
          workers: int = settings.METRICS_HTTP_WORKERS) -> BoundedWSGIServer:
    """Serve `registry` on http://host:port/metrics from a daemon thread (port 0 picks a free one)."""
    base = _IPv6Server if ":" in host else BoundedWSGIServer
    server_class = type("MetricsServer", (base,), {"workers": workers})
    server: BoundedWSGIServer = make_server(host, port, make_wsgi_app(registry), server_class,
                                            handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-accept").start()
    return server
