"""gRPC plumbing every service shares: `Server` (health, reflection, TLS or a loud plaintext warning,
interceptors, shutdown on SIGINT/SIGTERM), `channel`, keepalive and message-size options, log format.

Transport security itself lives in tether/security/ (TLS credentials, the authorization interceptor).

Each service sizes its own messages (settings: stages carry activation frames, the coordinator token ids,
admission one prompt), so a peer cannot make a small-message service buffer 64 MiB.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tether import ports, settings
from tether.security.identity import Identity
from tether.security.tls import TlsConfig

log = logging.getLogger(__name__)

def message_options(max_bytes: int) -> list[tuple[str, int | str]]:
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


# Keepalive so a peer that vanished (killed, network gone) is noticed in seconds, not at TCP timeout.
KEEPALIVE_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A peer that restarts (a coordinator, a stage) is reconnected within this, not gRPC's default backoff that
    # grows to 120 s: after 30 s down, admission noticed a restarted coordinator 15 s late.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", int(settings.PEER_RECONNECT_BACKOFF_MAX_S * 1000)),
]


def server_options(max_message_bytes: int, max_connection_age_s: float | None) -> list[tuple[str, int | str]]:
    options = message_options(max_message_bytes) + [
        ("grpc.keepalive_time_ms", int(settings.SERVER_KEEPALIVE_S * 1000)),
        ("grpc.keepalive_timeout_ms", int(settings.SERVER_KEEPALIVE_TIMEOUT_S * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.max_connection_idle_ms", int(settings.MAX_CONNECTION_IDLE_S * 1000)),
        ("grpc.so_reuseport", 0),
    ]
    if max_connection_age_s is not None:
        # The grace covers a request's whole lifetime: an aged-out connection finishes what it carries.
        options += [("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)),
                    ("grpc.max_connection_age_grace_ms", int(settings.MAX_REQUEST_LIFETIME_S * 1000) + 10_000)]
    return options


def channel(target: str, max_message_bytes: int = settings.GRPC_MAX_MESSAGE_BYTES,
            tls: TlsConfig | None = None, expect: Identity | None = None) -> grpc.aio.Channel:
    """A channel from one service to another. With `tls`: verified against its CA, presenting our certificate,
    and the server must be `expect` (required): gRPC's TLS layer verifies its certificate under
    `expect.server_name`, which only that identity's certificate carries, on every connection the channel makes
    (a server swapped in after a first check is verified again). A server that fails it is never sent a byte of
    a call; tether/security/server_check.py explains such a refusal."""
    options = message_options(max_message_bytes) + KEEPALIVE_OPTIONS
    if tls is None:
        return grpc.aio.insecure_channel(target, options=options)
    if expect is None:
        raise ValueError(f"a TLS channel to {target} must say which service identity it expects there")
    options.append(("grpc.ssl_target_name_override", expect.server_name))
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=options)


class Server:
    """A grpc.aio server with health checking and (unless reflection=False) reflection; `wait_for_signal()` runs
    until SIGINT/SIGTERM. With `tls` it serves TLS (mutual unless the config says otherwise); without, plaintext,
    and it says so once, loudly. `interceptors` (e.g. tether.security.authz.AuthzInterceptor) see every call."""

    def __init__(self, host: str, port: int, service_names: Iterable[str],
                 max_message_bytes: int = settings.GRPC_MAX_MESSAGE_BYTES,
                 max_connection_age_s: float | None = None, tls: TlsConfig | None = None,
                 reflection_on: bool = True, interceptors: Iterable[grpc.aio.ServerInterceptor] = ()) -> None:
        self.server = grpc.aio.server(options=server_options(max_message_bytes, max_connection_age_s),
                                      interceptors=list(interceptors) or None)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = list(service_names)
        if reflection_on:
            reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.names = names
        self.address = f"{host}:{port}"
        self.tls = tls
        if tls is None:
            log.warning("PLAINTEXT: %s serves %s without TLS and without authentication: anyone who can reach "
                        "the port can call every method. Only on a trusted network; see --tls-cert "
                        "(`tether certs init`)", self.address, ", ".join(names))
            bound = self._bind(lambda: self.server.add_insecure_port(self.address))
        else:
            log.info("%s serves %s over %s", self.address, ", ".join(names), tls.describe())
            bound = self._bind(lambda: self.server.add_secure_port(self.address, tls.server_credentials()))
        if bound == 0:
            raise ports.bind_error(host, port, "--port", "gRPC could not bind it")
        self.port = bound
        self._stop = asyncio.Event()   # set by SIGINT/SIGTERM or request_stop()
        # Set once the server stops (after `before_stop`): long-lived streams (a coordinator's Watch and Session)
        # end on it rather than holding the stop for its whole grace and being cancelled (logged as errors).
        self.stopping = asyncio.Event()

    def _bind(self, add: Callable[[], int]) -> int:
        """Bind a port with `add`; gRPC says only that it failed (a RuntimeError, or 0), so the port is probed
        for the reason: a port in use is ports.PortInUse, the configuration error it is."""
        try:
            return add()
        except RuntimeError as e:
            host, _, port = self.address.rpartition(":")
            raise ports.bind_error(host, int(port), "--port", e) from None

    def request_stop(self) -> None:
        """Stop as on SIGTERM (e.g. a coordinator drained by a call that asked it to exit)."""
        self._stop.set()

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.names]:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self.server.start()

    async def wait_for_signal(self, grace_s: float = 5.0,
                              before_stop: Callable[[], Awaitable[None]] | None = None) -> None:
        """Block until SIGINT/SIGTERM, then (after `before_stop`, e.g. a drain, while calls are still served)
        stop accepting, let in-flight calls finish for `grace_s`. `request_stop()` ends it as a signal would."""
        stop = self._stop
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down %s", self.address)
        await self.set_serving(False)
        if before_stop is not None:
            await before_stop()
        self.stopping.set()
        await self.server.stop(grace_s)
