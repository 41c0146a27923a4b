"""Hostile input on the stage protocol, against live stage processes (docs/PROTOCOL.md "Hostile input").

Malformed or truncated frames, wrong dtype or shape, NaN/Inf, frames over the size limit, unknown request
ids, replayed old frames, clients that open streams and never send (or never read): each is refused with the
right status or RejectReason, the stage keeps serving, what it holds (SyncState, KV use) does not change, and
its Stats count the rejections.
"""

from __future__ import annotations

import dataclasses

import math
import os
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from tether import settings
from tether.model import numerics
from tether.model.config import ModelConfig
from tether.model.loader import model_fingerprint, resolve_model
from tether.v1 import stage_pb2
from tests.helpers import second_dtype

RejectReason = stage_pb2.RejectReason
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tail(start_stage):
    """Layers [2, 4) of tiny: takes activations, holds the head."""
    s = start_stage("--layers", "1/2")
    s.handshake()
    return s


@pytest.fixture(scope="module")
def full(start_stage):
    """All layers: embeds token ids, samples."""
    s = start_stage()
    s.handshake()
    return s


def reasons(reply) -> list[str]:
    return [RejectReason.Name(r.reason) if not r.ok else "ok" for r in reply.results]


def fingerprint(stage, *rids):
    """Everything a hostile frame must not change: what the stage holds and its KV use."""
    st = stage.stats()
    return stage.held(*rids), st.kv_used_tokens, st.requests_held


def prefill(stream, kit, req, acts=True):
    rows = len(req.ids) - req.fed
    reply = stream.ask(stream.frame([req.slot()], kit.activations(rows, seed=rows) if acts else None))
    assert reasons(reply) == ["ok"], reply
    req.accept(reply.results[0].token_id)
    return reply


# --- tensors -----------------------------------------------------------------------------------------------
def tensor(dtype: str, shape, data: bytes) -> stage_pb2.Tensor:
    return stage_pb2.Tensor(dtype=dtype, shape=list(shape), data=data)


def bad_tensors(rows: int, hidden: int) -> dict[str, stage_pb2.Tensor | None]:
    good = torch.randn(rows, hidden)
    raw = good.numpy().tobytes()
    nan, inf = good.clone(), good.clone()
    nan[rows - 1, 3] = math.nan
    inf[0, 0] = -math.inf
    return {
        "float16 bytes": tensor("float16", [rows, hidden], good.half().numpy().tobytes()),
        "unknown dtype": tensor("float64", [rows, hidden], good.double().numpy().tobytes()),
        "no dtype": tensor("", [rows, hidden], raw),
        "wider rows": tensor("float32", [rows, hidden + 1], torch.randn(rows, hidden + 1).numpy().tobytes()),
        "fewer rows": tensor("float32", [rows - 1, hidden], raw[: (rows - 1) * hidden * 4]),
        "3-d shape": tensor("float32", [rows, hidden, 1], raw),
        "1-d shape": tensor("float32", [rows * hidden], raw),
        "truncated bytes": tensor("float32", [rows, hidden], raw[:-4]),
        "extra bytes": tensor("float32", [rows, hidden], raw + b"\0\0\0\0"),
        "odd byte count": tensor("float32", [rows, hidden], raw[:-1]),
        "NaN": tensor("float32", [rows, hidden], nan.numpy().tobytes()),
        "-Inf": tensor("float32", [rows, hidden], inf.numpy().tobytes()),
        "+Inf": tensor("float32", [rows, hidden], raw[:-4] + struct.pack("<f", math.inf)),
        "absent": None,
    }


def test_bad_tensors_are_rejected_per_slot_without_touching_state(tail, kit):
    stream = tail.stream()
    held = kit.Req("held", list(b"hello there"))
    prefill(stream, kit, held)
    before = fingerprint(tail, "held", "newcomer")
    rejected_before = tail.stats().rejections.get("BAD_TENSOR", 0)
    cases = bad_tensors(rows=len(held.ids) - held.fed + 3, hidden=kit.CFG.hidden_size)
    for name, acts in cases.items():
        newcomer = kit.Req("newcomer", [1, 2, 3])
        reply = stream.ask(stream.frame([held.slot(), newcomer.slot()], acts))
        assert reasons(reply) == ["BAD_TENSOR", "BAD_TENSOR"], name
        assert all(r.stage_index == 1 and r.detail.startswith("activations:") for r in reply.results), name
        assert fingerprint(tail, "held", "newcomer") == before, name
    assert tail.stats().rejections["BAD_TENSOR"] == rejected_before + 2 * len(cases)
    # the stream and the request are still good
    rows = len(held.ids) - held.fed
    reply = stream.ask(stream.frame([held.slot()], kit.activations(rows)))
    assert reasons(reply) == ["ok"]
    assert stream.end() == grpc.StatusCode.OK


def test_digest_mismatch_and_first_stage_activations(tail, full, kit):
    stream = tail.stream()
    req = kit.Req("digest", [7, 8, 9])
    frame = stream.frame([req.slot()], kit.activations(3))
    frame.payload_digest ^= 1
    before = fingerprint(tail, "digest")
    n = tail.stats().rejections.get("DIGEST_MISMATCH", 0)
    assert reasons(stream.ask(frame)) == ["DIGEST_MISMATCH"]
    assert fingerprint(tail, "digest") == before
    assert tail.stats().rejections["DIGEST_MISMATCH"] == n + 1
    stream.end()

    s0 = full.stream()
    assert reasons(s0.ask(s0.frame([req.slot()], kit.activations(3)))) == ["BAD_FRAME"]
    assert full.held("digest") == [("digest", False, 0, 0, 0)]
    s0.end()


# --- stamps ------------------------------------------------------------------------------------------------
def test_unknown_requests_and_bad_slots(full, kit):
    stream = full.stream()
    ghost = kit.Req("ghost", list(b"abcdef"), fed=3)         # claims the stage holds 3 tokens: it holds none
    vocab = kit.CFG.vocab_size
    beyond = kit.Req("beyond", [1, vocab, 2])                # consistent hashes over an id outside the vocab
    empty = kit.Req("", [1, 2])
    window = kit.Req("window", [1], fed=0)
    slot_window = window.slot()
    slot_window.stamp.position = kit.CFG.max_position_embeddings   # beyond the context window
    before = fingerprint(full, "ghost", "beyond", "window")
    reply = stream.ask(stream.frame([ghost.slot(), beyond.slot(), empty.slot(), slot_window]))
    assert reasons(reply) == ["UNKNOWN_REQUEST", "BAD_FRAME", "BAD_FRAME", "BAD_FRAME"]
    assert "vocabulary" in reply.results[1].detail
    assert fingerprint(full, "ghost", "beyond", "window") == before
    dup = kit.Req("dup", [4, 5])
    assert sorted(reasons(stream.ask(stream.frame([dup.slot(), dup.slot()])))) == ["BAD_FRAME", "ok"]
    stats = full.stats()
    assert stats.rejections["UNKNOWN_REQUEST"] >= 1 and stats.rejections["BAD_FRAME"] >= 4
    assert full.serving()
    stream.end()


def test_replayed_frames(full, kit):
    stream = full.stream()
    req = kit.Req("replay", list(b"once upon a time"))
    first = stream.frame([req.slot()])
    reply = stream.ask(first)
    assert reasons(reply) == ["ok"]
    req.accept(reply.results[0].token_id)
    before = fingerprint(full, "replay")
    # the same frame again, same seq: out of sequence
    assert reasons(stream.ask(first)) == ["BAD_SEQUENCE"]
    # the old frame under a fresh seq: the stage already holds those tokens
    again = stage_pb2.Frame()
    again.CopyFrom(first)
    stream.seq += 1
    again.stream_seq = stream.seq
    assert reasons(stream.ask(again)) == ["POSITION_GAP"]
    # an old pipeline epoch
    assert reasons(stream.ask(stream.frame([req.slot()], epoch=full.epoch ^ 1))) == ["STALE_EPOCH"]
    # an older request epoch after a rebuild
    rebuilt = kit.Req("replay", list(req.ids), epoch=2)
    reply = stream.ask(stream.frame([rebuilt.slot()]))
    assert reasons(reply) == ["ok"]
    rebuilt.accept(reply.results[0].token_id)
    after_rebuild = fingerprint(full, "replay")
    assert reasons(stream.ask(stream.frame([req.slot()]))) == ["STALE_EPOCH"]
    assert fingerprint(full, "replay") == after_rebuild != before
    stream.end()


# --- the wire ----------------------------------------------------------------------------------------------
def raw_status(stage, messages: list[bytes]) -> tuple[grpc.StatusCode, str, list[bytes]]:
    """Send raw bytes on Forward (no serializer: a generic stream call) and return how the stream ended."""
    call = stage.channel.stream_stream("/tether.v1.Stage/Forward")(iter(messages), timeout=30)
    replies = []
    try:
        for r in call:
            replies.append(r)
    except grpc.RpcError:
        pass
    return call.code(), call.details() or "", replies


def test_undecodable_and_truncated_frames(tail, kit):
    req = kit.Req("trunc", [3, 1, 4, 1, 5])
    frame = kit.make_frame([req.slot()], tail.epoch, acts=kit.activations(5))
    wire = frame.SerializeToString()
    before = fingerprint(tail, "trunc")
    for garbage in [b"\xff\xff\xff\xff\x0f", b"\x0a\xff\xff\xff\xff\x0f", b"\x08", b"\x1a\x05\x0a\x03",
                    bytes(range(256))]:
        code, details, _ = raw_status(tail, [garbage])
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (garbage, code, details)
        assert "malformed Frame" in details
    cuts = sorted({1, 2, 5, 9, 10, 11, 20, len(wire) // 2, len(wire) - 100, len(wire) - 1})
    outcomes = set()
    for cut in cuts:
        code, details, replies = raw_status(tail, [wire[:cut]])
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            outcomes.add("invalid")
            continue
        # A cut at a field boundary is a valid (shorter) message: it must be answered with rejections only.
        assert code == grpc.StatusCode.OK, (cut, code, details)
        for r in replies:
            reply = stage_pb2.FrameReply.FromString(r)
            assert all(not res.ok for res in reply.results), (cut, reply)
        outcomes.add("rejected")
    assert "invalid" in outcomes
    assert fingerprint(tail, "trunc") == before
    assert tail.serving()
    s = tail.stream()
    assert reasons(s.ask(s.frame([req.slot()], kit.activations(5)))) == ["ok"]
    s.end()


def test_frames_over_the_size_limit(tail, kit):
    req = kit.Req("huge", [1, 2])
    frame = kit.make_frame([req.slot()], tail.epoch)
    frame.activations.CopyFrom(stage_pb2.Tensor(dtype="float32", shape=[2, kit.CFG.hidden_size],
                                                data=b"\0" * (settings.GRPC_MAX_MESSAGE_BYTES + 1024)))
    code, details, _ = raw_status(tail, [frame.SerializeToString()])
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
    assert tail.held("huge") == [("huge", False, 0, 0, 0)]
    assert tail.serving()


def test_no_pickle_or_eval_on_the_wire():
    pattern = re.compile(r"\b(pickle|cPickle|marshal|dill|shelve)\b|(?<![\w.])(eval|exec)\(")
    offenders = []
    for root in ("services", "tether"):
        for path in (REPO / root).rglob("*.py"):
            if "/v1/" in str(path):
                continue   # generated protobuf code
            for i, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if pattern.search(code) and "never pickle" not in line:
                    offenders.append(f"{path.relative_to(REPO)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# --- streams -----------------------------------------------------------------------------------------------
def test_forward_before_handshake_is_refused(start_stage):
    s = start_stage()
    code = s.stream().end()
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def test_stream_cap(start_stage, kit):
    s = start_stage("--max-streams", "2")
    s.handshake()
    a, b = s.stream(), s.stream()
    for st in (a, b):   # an answered empty frame proves the stream is open
        assert list(st.ask(st.frame([])).results) == []
    assert s.stats().forward_streams == 2
    c = s.stream()
    with pytest.raises(grpc.RpcError) as e:
        c.recv()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit 2" in e.value.details()
    c.cancel()
    a.cancel()
    kit.wait_for(lambda: s.stats().forward_streams == 1, what="the cancelled stream to close")
    d = s.stream()
    assert list(d.ask(d.frame([])).results) == []
    assert d.end() == grpc.StatusCode.OK and b.end() == grpc.StatusCode.OK
    kit.wait_for(lambda: s.stats().forward_streams == 0, what="all streams closed")


def test_idle_streams_are_closed(start_stage, kit):
    idle_s = 1.5
    s = start_stage("--stream-idle", str(idle_s))
    s.handshake()
    # opened, never sends
    silent = s.stream()
    t0 = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        silent.recv()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "idle" in e.value.details()
    assert idle_s * 0.9 <= time.monotonic() - t0 < idle_s + 10
    silent.cancel()
    # sends one frame, then goes quiet: closed too, and its state stays (the request holds its KV)
    quiet = s.stream()
    req = kit.Req("quiet", [1, 2, 3])
    assert reasons(quiet.ask(quiet.frame([req.slot()]))) == ["ok"]
    with pytest.raises(grpc.RpcError) as e:
        quiet.recv()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    quiet.cancel()
    assert s.held("quiet")[0][1:4] == (True, 1, 3)
    # a stream with traffic more often than the idle limit stays open past it
    busy = s.stream()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 2.5 * idle_s:
        assert list(busy.ask(busy.frame([])).results) == []
        time.sleep(idle_s / 4)
    assert busy.end() == grpc.StatusCode.OK
    kit.wait_for(lambda: s.stats().forward_streams == 0, what="the idle streams' relays to be freed")
    assert s.serving()


def test_client_that_never_reads_is_bounded(full, kit):
    """A client that sends without reading: the stage stops reading its frames (bounded reply queue, HTTP/2
    flow control) instead of buffering replies without limit, and keeps serving everyone else."""
    greedy = full.stream()
    slots = [kit.Req(f"nobody-{i:03d}-" + "x" * 60, [1, 2], fed=1).slot() for i in range(64)]   # all unknown
    total = 3000
    for _ in range(total):
        greedy.send(greedy.frame(slots))
    # The bound: the stage queues at most 64 replies per stream, then stops reading that stream's frames.
    kit.wait_for(lambda: full.stats().replies_queued == 64, timeout=60, what="the reply queue to fill up")
    assert full.stats().replies_queued == 64
    assert greedy.q.qsize() > 0, "the stage read every frame of a client that reads no reply"
    other = full.stream()
    req = kit.Req("other", [9, 9, 9])
    assert reasons(other.ask(other.frame([req.slot()]))) == ["ok"]
    other.end()
    greedy.cancel()
    kit.wait_for(lambda: full.stats().forward_streams == 0, what="the greedy stream to close")
    assert full.serving()


def test_a_downstream_idle_close_is_not_a_failure(start_stage, kit):
    """The next stage closes an idle relay stream; the upstream stream stays up and the relay reopens
    downstream (from stream_seq 1) with the next frame. An empty frame keeps a coordinator's stream alive."""
    last = start_stage("--layers", "1/2", "--stream-idle", "1")
    first = start_stage("--layers", "0/2", "--stream-idle", "30")
    first.handshake(route=[first, last])
    stream = first.stream()
    a = kit.Req("down-a", [1, 2, 3])
    assert reasons(stream.ask(stream.frame([a.slot()]))) == ["ok"]
    assert last.stats().forward_streams == 1
    kit.wait_for(lambda: last.stats().forward_streams == 0, what="the next stage to close the idle relay")
    b = kit.Req("down-b", [4, 5])
    assert reasons(stream.ask(stream.frame([b.slot()]))) == ["ok"]       # reopened downstream
    kit.wait_for(lambda: last.stats().forward_streams == 0, what="the relay to idle out again")
    assert list(stream.ask(stream.frame([])).results) == []              # a keep-alive travels the route:
    assert last.stats().forward_streams == 1                             # it reopened the relay downstream
    assert stream.end() == grpc.StatusCode.OK
    assert last.stats().rejections.get("BAD_SEQUENCE", 0) == 0


def test_a_route_that_mixes_numerics_is_refused(start_stage):
    """A coordinator with --dtype auto sends no dtype: the stages themselves refuse a route that mixes them
    (each passes its own dtype downstream)."""
    other = second_dtype()
    first = start_stage("--layers", "0:2", "--dtype", "float32")
    last = start_stage("--layers", "2:4", "--dtype", other)
    req = stage_pb2.HandshakeRequest(
        protocol_version=settings.PROTOCOL_VERSION, model_fingerprint=model_fingerprint(resolve_model("tiny")),
        route=[stage_pb2.RouteEntry(address=s.address) for s in (first, last)], index=0, prev_layer_end=0,
        pipeline_epoch=5, dtype="", stamp_key=bytes(32))
    reply = first.stub.Handshake(req, timeout=15)
    assert not reply.ok
    assert "stage 1" in reply.error and f"runs {other}" in reply.error and "float32" in reply.error
    assert "never mixes numerics" in reply.error
    # a stage whose upstream runs what it runs takes the handshake
    assert last.stub.Handshake(stage_pb2.HandshakeRequest(
        protocol_version=settings.PROTOCOL_VERSION, model_fingerprint=req.model_fingerprint,
        route=[stage_pb2.RouteEntry(address="127.0.0.1:1"), stage_pb2.RouteEntry(address=last.address)], index=1,
        prev_layer_end=2, pipeline_epoch=5, dtype=other, stamp_key=bytes(32)), timeout=15).ok


def handshake_after(stage, kernels: str) -> stage_pb2.HandshakeReply:
    """`stage`'s handshake as the second of a route whose first stage (float32) runs `kernels`."""
    return stage.stub.Handshake(stage_pb2.HandshakeRequest(
        protocol_version=settings.PROTOCOL_VERSION, model_fingerprint=model_fingerprint(resolve_model("tiny")),
        route=[stage_pb2.RouteEntry(address="127.0.0.1:1"), stage_pb2.RouteEntry(address=stage.address)],
        index=1, prev_layer_end=2, pipeline_epoch=5, dtype="float32", stamp_key=bytes(32), kernels=kernels),
        timeout=15)


def test_a_route_whose_stages_chose_other_kernels_is_refused(start_stage):
    """Each stage forwards its kernels and rows (RowRule) with the handshake: a stage after it that runs
    others (another CPU, another torch) refuses the route, as for another dtype; the same ones are taken."""
    stage = start_stage("--layers", "2:4", "--dtype", "float32")
    mine = numerics.row_rule(ModelConfig.from_folder(resolve_model("tiny")), torch.float32).kernels
    other = "padded to 64 rows per thread" if "64 rows" not in mine else "unpadded, at least 1 rows"
    refused = handshake_after(stage, other)
    assert not refused.ok and f"runs float32 {mine}" in refused.error and f"before it run {other}" in refused.error
    assert "never mixes numerics" in refused.error
    assert handshake_after(stage, mine).ok


def test_a_route_that_mixes_linear_inputs_is_refused(start_stage):
    """--linear-inputs q8 is a numerics of its own: the stage names it in its kernels and refuses a stage before it
    that multiplies float32 inputs; a q8 one is taken."""
    rule = numerics.row_rule(ModelConfig.from_folder(resolve_model("tiny")), torch.float32)
    if rule.linear != "rowdot":
        pytest.skip(f"q8 inputs need rowdot; this machine runs {rule}")
    stage = start_stage("--layers", "2:4", "--dtype", "float32", "--linear-inputs", "q8")
    q8 = dataclasses.replace(rule, inputs="q8").kernels
    assert "q8 linear inputs" in q8
    refused = handshake_after(stage, rule.kernels)
    assert not refused.ok and f"runs float32 {q8}" in refused.error and "never mixes numerics" in refused.error
    assert handshake_after(stage, q8).ok


def test_frame_and_stream_limits_are_advertised_and_enforced_by_the_stage(start_stage, kit):
    """The stage enforces its own limits whatever the coordinator sends; the handshake says what they are."""
    s = start_stage("--max-frame-rows", "8", "--max-frame-slots", "2", "--max-streams-per-peer", "1")
    s.handshake()
    assert (s.info.max_frame_rows, s.info.max_frame_slots, s.info.max_streams_per_peer) == (8, 2, 1)
    st = s.stream()
    a, b, c = (kit.Req(f"lim-{i}", [5, 6, 7]) for i in range(3))
    reply = st.ask(st.frame([a.slot(), b.slot(), c.slot()]))            # 3 slots > 2
    assert [r.reason for r in reply.results] == [RejectReason.BAD_FRAME] * 3
    assert all("at most 2 slots" in r.detail and "advertised" in r.detail for r in reply.results)
    long = kit.Req("lim-long", list(range(10, 19)))                       # 9 rows > 8
    (res,) = st.ask(st.frame([long.slot()])).results
    assert res.reason == RejectReason.BAD_FRAME and "8 rows" in res.detail
    assert all(not held for _, held, *_ in s.held("lim-0", "lim-1", "lim-2", "lim-long"))   # nothing ran
    ok = st.ask(st.frame([a.slot(), b.slot()])).results                  # within the limits: served
    assert all(r.ok for r in ok)
    refusals = s.stats().refusals
    assert refusals["FRAME_SLOTS"] == 1 and refusals["FRAME_ROWS"] == 1
    second = s.stream()                                                   # same peer, limit 1
    with pytest.raises(grpc.RpcError) as e:
        second.recv()
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per peer" in e.value.details()
    second.cancel()
    assert st.end() == grpc.StatusCode.OK
    assert s.stats().refusals["STREAMS_PER_PEER"] == 1


def test_q8_inputs_where_float32_does_not_run_on_rowdot_stop_the_stage_with_the_reason(tmp_path):
    """Our kernels turned off (as on a machine that cannot build them): the stage refuses --linear-inputs q8 at
    start-up, in one line that says what to do, and exits non-zero instead of serving other numerics."""
    env = {**os.environ, settings.NATIVE_KERNELS_ENV: "0"}
    done = subprocess.run([sys.executable, "-m", "services.stage_worker", "--host", "127.0.0.1", "--port", "0",
                           "--model", "tiny", "--linear-inputs", "q8"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode != 0
    assert "leave --linear-inputs at float32" in done.stderr and "Traceback" not in done.stderr
