"""The keyed token hash (issue 14 part 4): a reply whose token hash was computed without the pipeline's stamp
key (the old unkeyed xxh3 form, or another key) is refused like a token that does not extend its chain
(TOKEN_HASH_MISMATCH, rebuilt, never streamed); the same reply under the pipeline's key is accepted."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import xxhash

from services.coordinator.driver import Failure
from services.stage_worker.worker import echo
from tether.generation.sequence import TokenOut
from tether.protocol.hashing import ContextHasher, sampling_digest
from tether.protocol.stamp_key import StampKey
from tether.v1 import stage_pb2

TOKEN = 66
OTHER = StampKey(bytes(range(100, 132)))


def unkeyed(chain_after: int, rid: str, epoch: int, position: int, digest: int, token: int) -> int:
    """The token hash before keyed stamps: anyone who saw the stamp could compute it."""
    return xxhash.xxh3_64_intdigest(rid.encode(), seed=chain_after ^ digest)


def stage_signing_with(token_hash):
    """A one-stage fake that keeps real chains and signs each token with `token_hash(chain, rid, epoch,
    position, digest, token)`; `None` means the pipeline's own key (set once the driver is built)."""
    chains: dict[str, ContextHasher] = {}

    def answer(conn, seq, slots):
        results = []
        for slot in slots:
            st = slot.stamp
            if st.position == 0:
                chains[st.request_id] = ContextHasher(slot.hash_seed)
            chain = chains[st.request_id]
            chain.extend(st.token_ids)
            res = stage_pb2.SlotResult(stamp=echo(st), ok=True)
            if slot.sample:
                res.has_token, res.token_id = True, TOKEN
                res.token_hash = token_hash(chain.peek([TOKEN]), st.request_id, st.epoch,
                                            st.position + len(st.token_ids), sampling_digest(slot.sampling), TOKEN)
            results.append(res)
        return stage_pb2.FrameReply(stream_seq=seq, results=results)
    return answer


async def _run(kit, token_hash):
    pipe = kit.FakePipeline(stage_signing_with(token_hash or kit.FakePipeline.stamp_key.token_mac))
    return await kit.run_one(pipe, kit.request("r1", max_tokens=3), frame_timeout_s=5, max_rebuilds=2)


def test_the_pipeline_keys_token_hash_is_accepted(kit):
    out, c = asyncio.run(_run(kit, None))
    assert [type(e) for e in out] == [TokenOut] * 3 and c.rebuilds == 0


@pytest.mark.parametrize("forge", [unkeyed, OTHER.token_mac], ids=["unkeyed", "other_key"])
def test_a_token_hash_without_the_key_is_refused_and_never_streamed(kit, forge):
    out, c = asyncio.run(_run(kit, forge))
    assert [type(e) for e in out] == [Failure], "no forged token may reach the client"
    assert out[0].code == grpc.StatusCode.ABORTED
    assert c.rejections["TOKEN_HASH_MISMATCH"] == 3 and c.rebuilds == 2 and c.tokens == 0
