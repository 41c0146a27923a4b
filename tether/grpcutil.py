"""gRPC plumbing every service shares: server setup with health and reflection, channels, shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tether import settings

log = logging.getLogger(__name__)

MESSAGE_OPTIONS = [
    ("grpc.max_send_message_length", settings.GRPC_MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", settings.GRPC_MAX_MESSAGE_BYTES),
]
# Keepalive so a peer that vanished (killed, network gone) is noticed in seconds, not at TCP timeout.
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = MESSAGE_OPTIONS + [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.so_reuseport", 0),
]


def channel(target: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=MESSAGE_OPTIONS + KEEPALIVE_OPTIONS)


class Server:
    """A grpc.aio server with health checking and reflection; `serve()` runs until SIGINT/SIGTERM."""

    def __init__(self, host: str, port: int, service_names: Iterable[str]) -> None:
        self.server = grpc.aio.server(options=SERVER_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = list(service_names)
        reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.names = names
        self.address = f"{host}:{port}"
        bound = self.server.add_insecure_port(self.address)
        if bound == 0:
            raise OSError(f"cannot listen on {self.address}")
        self.port = bound

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self.names]:
            await self.health.set(name, status)

    async def start(self) -> None:
        await self.server.start()

    async def wait_for_signal(self, grace_s: float = 5.0) -> None:
        """Block until SIGINT/SIGTERM, then stop accepting, let in-flight calls finish for `grace_s`."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting down %s", self.address)
        await self.set_serving(False)
        await self.server.stop(grace_s)


def configure_logging(name: str, level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format=f"%(asctime)s {name} %(levelname)s %(message)s")
