"""One tenant must not starve the others (issue 23 §4), with real processes on loopback.

- A tenant flooding Tag with ~60 KiB prompts leaves another tenant's 2 KiB requests served: the flood waits in
  its own queue for admission's single tokenizer worker (taken round robin by tenant) and is refused with
  RESOURCE_EXHAUSTED + RetryInfo when that queue is full; waiting is never INVALID_ARGUMENT. A tenant over its
  request rate is refused before any work. (A standalone admission process: Tag needs no pipeline.)
- A tenant holding the whole concurrency cap with long generations cannot keep a newcomer out: once the newcomer
  is refused, the slots the first tenant frees go to the newcomer, not back to it (a 2-stage tiny cluster).
- Without API keys, tenant names the tenants file does not know share one anonymous account: a new name per
  request gets no fresh bucket.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import grpc
import pytest

from tether import settings
from tether.cli.cluster import free_port
from tether.client import Client, TetherError
from tether.v1 import admission_pb2, admission_pb2_grpc, common_pb2
from tests.helpers import started, tenants_file

FLOOD_PROMPT = ("flood " * 10240)[:60 * 1024].encode()          # 60 KiB: a worker job, refused as too many tokens
VICTIM_PROMPT = "Summarize in under 30 words: " + "the archive holds maps and letters. " * 55   # ~2 KiB


def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


@pytest.fixture(scope="module")
def lone_admission(tmp_path_factory):
    """Admission alone (its coordinator's port is closed): Tag works without a pipeline."""
    folder = tmp_path_factory.mktemp("fair-tag")
    tenants = folder / "tenants.toml"
    # Slow refills (one request per 10 s) so the bucket tests count exactly whatever the machine's load.
    tenants.write_text("[defaults]\nrequests_per_s = 0.1\nburst_s = 30\n"            # 3 at once
                       "[tenants.flood]\nrequests_per_s = 1000\n"      # so its flood reaches the worker queue
                       "[tenants.victim]\nrequests_per_s = 100\n"
                       "[tenants.slow]\nrequests_per_s = 0.1\nburst_s = 20\n")         # 2 at once
    port = free_port()
    log = open(folder / "admission.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.admission", "--port", str(port), "--model", "tiny",
                             "--coordinator", f"127.0.0.1:{free_port()}", "--tenants", str(tenants),
                             "--tag-workers", "1", "--http-port", "0"], stdout=log, stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"

    def answers() -> bool:
        try:
            with Client(target, timeout=10, retry=None) as c:
                return c.tag("hello", tenant="victim")["input_tokens"] == 5
        except TetherError:
            return False

    try:
        _until(answers, 120, "admission to answer Tag")
        yield target
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()


def _flood(target: str, stop: threading.Event, codes: Counter, lock: threading.Lock) -> None:
    """A hostile client: Tag after Tag of 60 KiB as tenant flood, ignoring every RetryInfo."""
    request = admission_pb2.TagRequest(prompt=FLOOD_PROMPT, tenant="flood",
                                       sampling=common_pb2.SamplingParams(max_tokens=16))
    with grpc.insecure_channel(target, options=[("grpc.max_send_message_length", 1 << 20)]) as ch:
        stub = admission_pb2_grpc.AdmissionStub(ch)
        while not stop.is_set():
            try:
                stub.Tag(request, timeout=30)
                got = "OK", ""
            except grpc.RpcError as e:
                got = e.code().name, e.details() or ""
            with lock:
                codes[got] += 1


def test_a_tag_flood_leaves_another_tenants_requests_served(lone_admission):
    stop, lock, codes = threading.Event(), threading.Lock(), Counter()
    flooders = [threading.Thread(target=_flood, args=(lone_admission, stop, codes, lock), daemon=True)
                for _ in range(24)]   # 24 jobs queued FIFO would be ~3 s: past the 2 s budget
    for t in flooders:
        t.start()
    try:
        _until(lambda: sum(codes.values()) >= 12, 60, "the flood to be answered")   # it is under way
        served = []
        with Client(lone_admission, timeout=20, retry=None) as victim:
            for _ in range(8):
                served.append(victim.tag(VICTIM_PROMPT, tenant="victim", max_tokens=64))   # raises if refused
        assert all(t["tenant"] == "victim" and t["length_limit"] == 30 for t in served)
    finally:
        stop.set()
        for t in flooders:
            t.join(timeout=60)
    flood = {code for code, _ in codes}
    assert flood <= {"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}, codes
    # The flood's own fault is its size; waiting for a worker is overload, never "send a shorter prompt".
    assert all("tokens are allowed" in why for (code, why) in codes if code == "INVALID_ARGUMENT"), codes
    assert not any("took longer than" in why for (_, why) in codes), codes
    assert any("requests waiting for admission's tokenizer workers" in why for (_, why) in codes), codes


def test_a_tenant_over_its_rate_is_refused_with_retry_info_before_any_work(lone_admission):
    with Client(lone_admission, timeout=20, retry=None) as c:
        results = []
        for _ in range(4):
            with pytest.raises(TetherError) as e:
                c.tag(FLOOD_PROMPT, tenant="slow")
            results.append(e.value)
    # A burst of 2: the first two reach the worker (and are too long), the rest are refused before any work.
    codes = [r.code for r in results]
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 2 + [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    assert all("tenant slow is over its rate limit" in r.message and r.retry_after > 0 for r in results[2:])


def test_unnamed_tenants_share_one_anonymous_account(lone_admission):
    """[defaults] allows a burst of 3; a fresh tenant name per request does not buy a fresh bucket."""
    outcomes = []
    with Client(lone_admission, timeout=20, retry=None) as c:
        for i in range(8):
            try:
                c.tag("hello", tenant=f"minted-{i}")
                outcomes.append("OK")
            except TetherError as e:
                assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.retry_after > 0
                assert "shared by every tenant the tenants file does not name" in e.message
                outcomes.append("refused")
    assert outcomes == ["OK"] * 3 + ["refused"] * 5


# ---- the fair share of the concurrency cap ------------------------------------------------------------------

CAP = 4


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    tenants = tenants_file(tmp_path_factory, "[tenants.hog]\n[tenants.newcomer]\n")
    with started(tmp_path_factory, extra={"admission": ["--tenants", str(tenants), "--max-concurrent", str(CAP)]}) as c:
        yield c


def _long(stub: admission_pb2_grpc.AdmissionStub, tenant: str):
    """A long generation, its first chunk read: it holds a slot until cancelled."""
    call = stub.GenerateStream(admission_pb2.GenerateRequest(
        prompt=b"Tell me everything.", tenant=tenant,
        sampling=common_pb2.SamplingParams(max_tokens=settings.MAX_OUTPUT_TOKENS, ignore_eos=True)), timeout=300)
    next(call)
    return call


def _try(stub: admission_pb2_grpc.AdmissionStub, tenant: str):
    """A short generation: "OK", or the refusal's (code, details)."""
    try:
        stub.Generate(admission_pb2.GenerateRequest(prompt=b"hi", tenant=tenant,
                                                    sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=60)
        return "OK"
    except grpc.RpcError as e:
        return e.code(), e.details()


def test_a_tenant_holding_the_cap_cannot_keep_a_newcomer_out(capped):
    with grpc.insecure_channel(capped.target) as ch:
        stub = admission_pb2_grpc.AdmissionStub(ch)
        held = [_long(stub, "hog") for _ in range(CAP)]          # alone, the hog may fill the cap
        try:
            code, why = _try(stub, "newcomer")
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"limit of {CAP} concurrent" in why
            held.pop().cancel()                                  # one of the hog's requests ends
            # Until the newcomer has it, the freed slot is never the hog's again: it is over its equal part.
            hog_refusals = []
            deadline = time.monotonic() + 60
            while (got := _try(stub, "newcomer")) != "OK":
                assert time.monotonic() < deadline, "the newcomer never got the freed slot"
                assert got[0] == grpc.StatusCode.RESOURCE_EXHAUSTED, got   # not yet released: the cap is full
                hog = _try(stub, "hog")
                assert hog != "OK", "the hog took back a slot the newcomer was waiting for"
                hog_refusals.append(hog)
            hog = _try(stub, "hog")
            assert hog[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "contended by 2 tenants" in hog[1], hog
            assert all(r[0] == grpc.StatusCode.RESOURCE_EXHAUSTED for r in hog_refusals)
        finally:
            for call in held:
                call.cancel()
