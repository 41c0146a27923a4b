"""Live stage workers on loopback for the service-level stage tests: each its own process, started with
`python -m services.stage_worker`, talked to directly over gRPC after a handshake the test sends itself."""

from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tether import reference, settings
from tether.cli.cluster import free_port, wait_serving
from tether.forkserver import client as forkserver
from tether.model.config import ModelConfig
from tether.model.loader import model_fingerprint, resolve_model
from tether.protocol import tensors
from tether.protocol.hashing import context_hash, hash_seed, sampling_digest
from tether.protocol.stamp_key import StampKey
from tether.v1 import common_pb2, stage_pb2, stage_pb2_grpc

REPO = Path(__file__).resolve().parents[3]
TINY = resolve_model("tiny")
CFG = ModelConfig.from_folder(TINY)
FINGERPRINT = model_fingerprint(TINY)
SEED = hash_seed(FINGERPRINT, "")
KEY = StampKey(bytes(range(32)))   # the pipeline's stamp key: every handshake here sends it
CALL_TIMEOUT_S = 60.0   # every stream a test opens has a deadline: a bug fails the test, never hangs it


@dataclass
class Req:
    """A test's view of one request: its context and how much of it the stage holds."""

    rid: str
    ids: list[int]
    epoch: int = 1
    fed: int = 0
    params: common_pb2.SamplingParams = field(
        default_factory=lambda: reference.sampling_params(max_tokens=64, ignore_eos=True))

    def slot(self, upto: int | None = None, sample: bool = True) -> stage_pb2.Slot:
        end = len(self.ids) if upto is None else upto
        stamp = stage_pb2.Stamp(request_id=self.rid, epoch=self.epoch, position=self.fed,
                                token_ids=self.ids[self.fed:end], parent_hash=context_hash(SEED, self.ids[:self.fed]),
                                context_hash=context_hash(SEED, self.ids[:end]),
                                sampling_digest=sampling_digest(self.params))
        return stage_pb2.Slot(stamp=stamp, sampling=self.params, sample=sample, hash_seed=SEED)

    def token_mac(self, token: int) -> int:
        """The keyed token hash the last stage owes for `token` sampled after the whole context."""
        return KEY.token_mac(context_hash(SEED, self.ids + [token]), self.rid, self.epoch, len(self.ids),
                             sampling_digest(self.params), token)

    def accept(self, token: int) -> None:
        """The slot just sent was answered with `token`: the stage holds everything before it."""
        self.fed = len(self.ids)
        self.ids.append(token)


def activations(rows: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> stage_pb2.Tensor:
    g = torch.Generator().manual_seed(seed)
    return tensors.encode(torch.randn(rows, CFG.hidden_size, generator=g).to(dtype))


def make_frame(slots, epoch: int, seq: int = 1, acts: stage_pb2.Tensor | None = None) -> stage_pb2.Frame:
    """A frame with the right digest for its slots and bytes."""
    f = stage_pb2.Frame(stream_seq=seq, pipeline_epoch=epoch, slots=list(slots))
    if acts is not None:
        f.activations.CopyFrom(acts)
    KEY.seal(f)
    return f


class Stream:
    """A Forward stream through the sync API: frames go in through a queue, replies come out in order."""

    def __init__(self, stub: stage_pb2_grpc.StageStub, epoch: int, timeout: float = CALL_TIMEOUT_S) -> None:
        self.q: queue.Queue = queue.Queue()
        self.epoch = epoch
        self.seq = 0
        self.call = stub.Forward(iter(self.q.get, None), timeout=timeout)

    def frame(self, slots, acts: stage_pb2.Tensor | None = None, seq: int | None = None,
              epoch: int | None = None) -> stage_pb2.Frame:
        """A well-formed frame (next seq, current epoch, right digest) unless told otherwise."""
        if seq is None:
            self.seq += 1
            seq = self.seq
        return make_frame(slots, self.epoch if epoch is None else epoch, seq, acts)

    def send(self, frame: stage_pb2.Frame) -> None:
        self.q.put(frame)

    def recv(self) -> stage_pb2.FrameReply:
        return next(self.call)

    def ask(self, frame: stage_pb2.Frame) -> stage_pb2.FrameReply:
        self.send(frame)
        reply = self.recv()
        assert reply.stream_seq == frame.stream_seq
        return reply

    def end(self) -> grpc.StatusCode:
        """Stop sending and wait for the stream's status (replies still coming are kept in `leftover`)."""
        self.q.put(None)
        self.leftover: list[stage_pb2.FrameReply] = []
        try:
            for reply in self.call:
                self.leftover.append(reply)
        except grpc.RpcError:
            pass
        return self.call.code()

    def cancel(self) -> None:
        """Cancel the call (also after it failed: frees the thread that feeds it)."""
        self.q.put(None)
        self.call.cancel()


class LiveStage:
    def __init__(self, log_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = args
        self.log_path = log_dir / f"stage-{self.port}.log"
        base = {k: v for k, v in os.environ.items() if k != settings.FAULTS_ENV}
        argv = [sys.executable, "-m", "services.stage_worker", "--port", str(self.port), "--model", "tiny",
                "--threads", "1", "--dtype", "float32", *args]   # float32 frames below; a later --dtype wins
        with open(self.log_path, "ab") as out:
            self.proc = forkserver.spawn(argv, str(REPO), {**base, "PYTHONUNBUFFERED": "1", **(env or {})}, out)
        self.channel = grpc.insecure_channel(self.address, options=[
            ("grpc.max_send_message_length", 2 * settings.GRPC_MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", settings.GRPC_MAX_MESSAGE_BYTES)])
        self.stub = stage_pb2_grpc.StageStub(self.channel)
        self.epoch = 0
        self.info: stage_pb2.StageInfo | None = None

    def wait_ready(self, timeout: float = 120.0) -> "LiveStage":
        def alive() -> None:
            if self.proc.poll() is not None:
                raise RuntimeError(f"stage exited with {self.proc.returncode} during start-up\n{self.log()}")
        if not wait_serving(self.channel, timeout, alive):
            raise TimeoutError(f"stage {self.address} not serving after {timeout:.0f}s\n{self.log()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def handshake(self, route: list["LiveStage"] | None = None) -> stage_pb2.HandshakeReply:
        """Handshake as a coordinator would. Without a route, the stage alone: if its layers do not start at 0
        it claims the place right after a (never contacted) stage that ends where it starts."""
        self.epoch = secrets.randbits(63) or 1
        if route is None:
            probe = self.stub.Handshake(stage_pb2.HandshakeRequest(model_fingerprint="probe"), timeout=10)
            start = probe.stages[0].layer_start
            addresses = ["127.0.0.1:1", self.address] if start else [self.address]
            index, prev_end = (1, start) if start else (0, 0)
        else:
            addresses, index, prev_end = [s.address for s in route], 0, 0
        reply = self.stub.Handshake(stage_pb2.HandshakeRequest(
            protocol_version=settings.PROTOCOL_VERSION, model_fingerprint=FINGERPRINT,
            route=[stage_pb2.RouteEntry(address=a) for a in addresses], index=index, prev_layer_end=prev_end,
            pipeline_epoch=self.epoch, dtype="", stamp_key=KEY.key), timeout=15)   # "": as --dtype auto
        assert reply.ok, reply.error
        self.info = reply.stages[0]
        return reply

    def stream(self, timeout: float = CALL_TIMEOUT_S) -> Stream:
        return Stream(self.stub, self.epoch, timeout)

    def held(self, *rids: str) -> list[tuple]:
        reply = self.stub.SyncState(stage_pb2.SyncRequest(request_ids=list(rids)), timeout=10)
        return [(h.request_id, h.held, h.epoch, h.length, h.context_hash) for h in reply.states]

    def stats(self) -> stage_pb2.StageStats:
        return self.stub.Stats(stage_pb2.StageStatsRequest(), timeout=10)

    def serving(self) -> bool:
        if self.proc.poll() is not None:
            return False
        status = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        return status == health_pb2.HealthCheckResponse.SERVING

    def terminate(self) -> None:
        """SIGTERM (a graceful drain) without waiting: a module's stages drain side by side (`reap` after)."""
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def reap(self) -> None:
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    """Poll until `predicate()` is truthy (returns it); never a bare sleep-and-hope."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def start_stage(tmp_path_factory):
    """start_stage(*args, env=None) -> a serving LiveStage, stopped at the end of the module."""
    log_dir = tmp_path_factory.mktemp("stage-logs")
    started: list[LiveStage] = []

    def start(*args: str, env: dict[str, str] | None = None) -> LiveStage:
        stage = LiveStage(log_dir, *args, env=env)
        started.append(stage)
        return stage.wait_ready()

    yield start
    for s in started:
        s.terminate()
    for s in started:
        s.reap()


@pytest.fixture(scope="module")
def kit():
    """The helpers above, for test modules (no package imports between test files)."""
    class Kit:
        pass
    k = Kit()
    k.Req, k.activations, k.wait_for, k.make_frame, k.CFG, k.SEED = Req, activations, wait_for, make_frame, CFG, SEED
    k.KEY = KEY
    return k
