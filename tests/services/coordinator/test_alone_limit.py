"""How many active requests the coordinator keeps one micro-batch in flight for (pipeline.alone_limit): what the
stages' handshakes say about their threads and their kernels, and what the operator asked."""

from __future__ import annotations

from services.coordinator.pipeline import alone_limit
from tether import settings
from tether.model.invariant import RowRule
from tether.v1 import stage_pb2


def stage(threads: int = 1, alone: int = 2, wants: int = 0) -> stage_pb2.StageInfo:
    return stage_pb2.StageInfo(threads=threads, alone_threads=alone, alone_max_requests=wants)


def test_stages_that_say_nothing_keep_one_micro_batch_for_up_to_the_default():
    """An older peer (no alone_max_requests: 0) gets what every stage got before they said."""
    assert alone_limit([stage(), stage()], None) == settings.ALONE_MAX_REQUESTS


def test_the_least_any_stage_wants_is_taken():
    assert alone_limit([stage(wants=1), stage(wants=1)], None) == 1
    assert alone_limit([stage(wants=32), stage(wants=4)], None) == 4
    assert alone_limit([stage(wants=8), stage()], None) == 8


def test_our_kernels_want_one_micro_batch_alone_only_for_a_single_request():
    """Their products keep a thread busy: two micro-batches on a thread each beat one on both cores (fp32 and q8
    alike); torch's kernels (bf16 on oneDNN, MKL padded) keep the default."""
    assert settings.ALONE_MAX_REQUESTS_ROWDOT < settings.ALONE_MAX_REQUESTS
    for inputs in ("float32", "q8"):
        assert RowRule(None, linear="rowdot", inputs=inputs).alone_max_requests() == settings.ALONE_MAX_REQUESTS_ROWDOT
    assert RowRule(4).alone_max_requests() == settings.ALONE_MAX_REQUESTS
    assert RowRule(None, linear="onednn").alone_max_requests() == settings.ALONE_MAX_REQUESTS


def test_what_the_operator_asked_wins_over_the_stages():
    assert alone_limit([stage(wants=1), stage(wants=1)], 16) == 16
    assert alone_limit([stage(), stage()], 0) == 0


def test_never_alone_where_a_stage_does_not_widen():
    """One micro-batch in flight leaves stages idle: only worth it where every stage then takes more threads."""
    assert alone_limit([stage(), stage(threads=2, alone=2)], None) == 0
    assert alone_limit([stage(wants=32), stage(threads=2, alone=2, wants=32)], 8) == 0
    assert alone_limit([], None) == 0
