"""Who may call what: the pure decision of tether/security/authz.py, method by method."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tether.security.authz import decide
from tether.security.identity import Identity

COORD, ADMISSION, OPERATOR = Identity("coordinator"), Identity("admission"), Identity("operator")
STAGE0, STAGE1, CLIENT = Identity("stage", "0"), Identity("stage", "1"), Identity("client", "default")
EVERYONE = [COORD, ADMISSION, OPERATOR, STAGE0, STAGE1, CLIENT]


def allowed(method, who, request=None, state=None) -> bool:
    return decide(method, who, request, state).allowed


def handshakers(position, claimed_index) -> list:
    """Who may handshake a stage whose certificate names `position`, whatever index the request claims."""
    stage = SimpleNamespace(position=position, handshake_peer=None)
    return [w for w in EVERYONE if allowed("/tether.v1.Stage/Handshake", w, SimpleNamespace(index=claimed_index), stage)]


@pytest.mark.parametrize("claimed", [0, 1, 2])
def test_stage_0_is_handshaken_by_the_coordinator_alone_whatever_index_is_claimed(claimed):
    # the takeover: a stage-1 certificate sending index=1 to stage 0 used to pass (the claim decided)
    assert handshakers(0, claimed) == [COORD]


@pytest.mark.parametrize("claimed", [0, 1, 2])
def test_stage_i_is_handshaken_by_stage_i_minus_1_alone(claimed):
    assert handshakers(1, claimed) == [STAGE0]
    assert handshakers(2, claimed) == [STAGE1]


def test_a_stage_that_does_not_know_its_position_takes_no_handshake():
    assert handshakers(None, 0) == []
    d = decide("/tether.v1.Stage/Handshake", COORD, SimpleNamespace(index=0), None)
    assert not d.allowed and "does not know its position" in d.reason


@pytest.mark.parametrize("method", ["SyncState", "Release"])
def test_stage_state_calls_only_from_the_coordinator(method):
    assert [w for w in EVERYONE if allowed(f"/tether.v1.Stage/{method}", w)] == [COORD]


def test_stage_stats_from_coordinator_or_operator_not_a_client():
    assert [w for w in EVERYONE if allowed("/tether.v1.Stage/Stats", w)] == [COORD, OPERATOR]


def test_forward_only_from_the_peer_of_the_accepted_handshake():
    upstream = SimpleNamespace(handshake_peer=STAGE0)
    assert [w for w in EVERYONE if allowed("/tether.v1.Stage/Forward", w, None, upstream)] == [STAGE0]
    first = SimpleNamespace(handshake_peer=COORD)
    assert [w for w in EVERYONE if allowed("/tether.v1.Stage/Forward", w, None, first)] == [COORD]
    # before any handshake only pipeline roles reach the servicer (which refuses with FAILED_PRECONDITION)
    none = SimpleNamespace(handshake_peer=None)
    assert [w for w in EVERYONE if allowed("/tether.v1.Stage/Forward", w, None, none)] == [COORD, STAGE0, STAGE1]


@pytest.mark.parametrize("method", ["Submit", "Session", "Cancel", "Watch"])
def test_coordinator_requests_only_from_admission(method):
    assert [w for w in EVERYONE if allowed(f"/tether.v1.Coordinator/{method}", w)] == [ADMISSION]


def test_coordinator_stats_from_operator_or_admission():
    assert [w for w in EVERYONE if allowed("/tether.v1.Coordinator/Stats", w)] == [ADMISSION, OPERATOR]


def test_coordinator_drain_from_operator_or_admission_never_a_client_a_stage_or_a_coordinator():
    assert [w for w in EVERYONE if allowed("/tether.v1.Coordinator/Drain", w)] == [ADMISSION, OPERATOR]
    d = decide("/tether.v1.Coordinator/Drain", CLIENT)
    assert not d.allowed and "may not call Drain" in d.reason and "operator or admission" in d.reason


def test_health_and_reflection_open_to_every_authenticated_peer_only():
    for m in ("/grpc.health.v1.Health/Check", "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"):
        assert all(allowed(m, w) for w in EVERYONE)
        assert not allowed(m, None)


def test_unknown_methods_and_anonymous_callers_are_refused_with_a_reason():
    d = decide("/tether.v1.Stage/Teleport", COORD)
    assert not d.allowed and "not in the authorization policy" in d.reason
    d = decide("/tether.v1.Stage/Release", None)
    assert not d.allowed and "no tether client certificate" in d.reason
    d = decide("/tether.v1.Stage/Release", CLIENT)
    assert "spiffe://tether.local/client/default may not call Release" in d.reason and "coordinator" in d.reason
