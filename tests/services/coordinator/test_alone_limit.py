"""How many active requests the coordinator keeps one micro-batch in flight for (pipeline.alone_limit): what the
stages' handshakes say about their threads and their linears' inputs, and what the operator asked."""

from __future__ import annotations

from services.coordinator.pipeline import alone_limit
from tether import settings
from tether.v1 import stage_pb2


def stage(threads: int = 1, alone: int = 2, inputs: str = "float32") -> stage_pb2.StageInfo:
    return stage_pb2.StageInfo(threads=threads, alone_threads=alone, linear_inputs=inputs)


def test_float32_stages_keep_one_micro_batch_for_up_to_the_default():
    assert alone_limit([stage(), stage()], None) == settings.ALONE_MAX_REQUESTS


def test_q8_stages_keep_one_for_fewer_requests():
    """Their integer products: one micro-batch alone wins at 8 streams, two at 32 (measured one cluster at a time)."""
    assert settings.ALONE_MAX_REQUESTS_Q8 < settings.ALONE_MAX_REQUESTS
    assert alone_limit([stage(inputs="q8"), stage(inputs="q8")], None) == settings.ALONE_MAX_REQUESTS_Q8


def test_a_route_not_all_q8_takes_the_float32_default():
    """A stage that says nothing of its inputs (an older peer: "") or float32 beside q8 (a route the
    handshake refuses anyway, by kernels) never gets the q8 default."""
    assert alone_limit([stage(inputs="q8"), stage(inputs="")], None) == settings.ALONE_MAX_REQUESTS
    assert alone_limit([stage(inputs="q8"), stage()], None) == settings.ALONE_MAX_REQUESTS


def test_what_the_operator_asked_wins_over_either_default():
    assert alone_limit([stage(inputs="q8"), stage(inputs="q8")], 16) == 16
    assert alone_limit([stage(), stage()], 0) == 0


def test_never_alone_where_a_stage_does_not_widen():
    """One micro-batch in flight leaves stages idle: only worth it where every stage then takes more threads."""
    assert alone_limit([stage(), stage(threads=2, alone=2)], None) == 0
    assert alone_limit([stage(inputs="q8"), stage(threads=2, alone=2, inputs="q8")], 8) == 0
    assert alone_limit([], None) == 0
