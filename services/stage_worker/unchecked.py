"""The stage without its stamp checks: EXPERIMENT ONLY, never in serving (--unsafe-disable-stamp-checks).

It exists to reproduce what a pipeline without stamps does under faults (tests/services/e2e/test_chaos.py and
`tether bench --chaos` show the wrong answers the checks prevent). It skips every row of the stage's checks
(services/stage_worker/state.py `CHECKS`) marked `unsafe_skips`: no stream sequence, no payload digest, no MAC,
no sampling digest, and no check of a slot against the state held. Instead position 0 starts over, anything
else runs on whatever state the stage holds for that id (fresh, zero state when it holds none). The other rows
stay (the well-formedness BAD_FRAME checks among them), so that nothing raises. No prefix cache: a cache is only
as good as the checks that fill it. The worker picks this class once, when it is built
(services/stage_worker/worker.py).
"""

from __future__ import annotations

from services.stage_worker.state import Admitted, RequestState, SlotView, StageState
from tether.kv.blocks import BlockPool
from tether.protocol.hashing import ContextHasher, sampling_digest
from tether.v1 import stage_pb2


class UncheckedStageState(StageState):
    stamp_checks = False

    def __init__(self, new_kv, max_context: int, pool: BlockPool | None = None, block: int = 0) -> None:
        super().__init__(new_kv, max_context, None, block)   # no prefix cache

    def token_digest(self, slot: stage_pb2.Slot) -> int:
        return sampling_digest(slot.sampling)   # the parameters actually used: the stamp's was never checked

    def _admit(self, v: SlotView) -> Admitted:
        st = v.slot.stamp
        held, fresh = v.held, False
        if held is None or st.position == 0:
            hasher = ContextHasher(v.slot.hash_seed)
            held, fresh = RequestState(st.request_id, st.epoch, hasher, self._new_kv(st.request_id), hasher.value), True
        return Admitted(held, st.position, list(st.token_ids), st.context_hash, fresh)

    def reserve(self, a: Admitted) -> None:
        super().reserve(a)
        if a.position > a.state.kv.length:
            # A slot may start past what the stage holds: the rows in between must read as zeros (wrong state,
            # as in a pipeline without stamps), never as whatever an earlier failed step left there.
            a.state.kv.zero(a.state.kv.length, a.position)
