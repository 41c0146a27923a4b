"""StageWorker.process on real Frames through a 2-stage split of the tiny model (no gRPC)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from services.stage_worker.worker import StageWorker
from tether import reference, settings
from tether.model.loader import load_slice, resolve_model
from tether.protocol import tensors
from tether.protocol.hashing import context_hash, hash_seed, sampling_digest
from tether.protocol.stamp_key import StampKey
from tether.v1 import common_pb2, stage_pb2

KEY = StampKey(bytes(range(32)))   # the pipeline's stamp key, as a handshake would set it

RejectReason = stage_pb2.RejectReason
CAPACITY = 100_000


@pytest.fixture(scope="module")
def lm():
    return reference.load("tiny")


@pytest.fixture(scope="module")
def slices():
    folder = resolve_model("tiny")
    return load_slice(folder, 0, 2, settings.DTYPE), load_slice(folder, 2, 4, settings.DTYPE)   # as the reference


@dataclass
class Pipe:
    w0: StageWorker
    w1: StageWorker

    @property
    def used(self) -> tuple[int, int]:
        return self.w0.kv_used_tokens(), self.w1.kv_used_tokens()

    def held(self, rid: str):
        return tuple((h.held, h.epoch, h.length, h.context_hash) for h in
                     (self.w0.state.held(rid), self.w1.state.held(rid)))

    def run(self, frame: stage_pb2.Frame) -> list[stage_pb2.SlotResult]:
        """Like the relay: stage 0's own results, then stage 1's."""
        out0 = self.w0.process(frame)
        if out0.forward is None:
            return list(out0.results)
        return [*out0.results, *self.w1.process(out0.forward).results]


@pytest.fixture
def pipe(slices) -> Pipe:
    return Pipe(StageWorker(slices[0], 0, CAPACITY, stamp_key=KEY), StageWorker(slices[1], 1, CAPACITY, stamp_key=KEY))


@dataclass
class Req:
    """The coordinator's view of one request: its context and how much of it the stages hold."""

    rid: str
    ids: list[int]
    params: common_pb2.SamplingParams = field(default_factory=lambda: reference.sampling_params(max_tokens=8))
    epoch: int = 1
    fed: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        self.seed = hash_seed(reference.load("tiny").fingerprint, "")

    def slot(self, upto: int | None = None, sample: bool = True) -> stage_pb2.Slot:
        end = len(self.ids) if upto is None else upto
        stamp = stage_pb2.Stamp(request_id=self.rid, epoch=self.epoch, position=self.fed,
                                token_ids=self.ids[self.fed:end],
                                parent_hash=context_hash(self.seed, self.ids[:self.fed]),
                                context_hash=context_hash(self.seed, self.ids[:end]),
                                sampling_digest=sampling_digest(self.params))
        return stage_pb2.Slot(stamp=stamp, sampling=self.params, sample=sample, hash_seed=self.seed)


def frame(*slots: stage_pb2.Slot, activations: stage_pb2.Tensor | None = None) -> stage_pb2.Frame:
    f = stage_pb2.Frame(stream_seq=1, pipeline_epoch=7, slots=list(slots))
    if activations is not None:
        f.activations.CopyFrom(activations)
    KEY.seal(f)
    return f


def by_id(results) -> dict[str, stage_pb2.SlotResult]:
    d = {}
    for r in results:
        assert r.stamp.request_id not in d, "two results for one request"
        d[r.stamp.request_id] = r
    return d


def step(pipe: Pipe, reqs: list[Req]) -> dict[str, int]:
    """One micro-batch of all `reqs` (each feeds what the stages lack); append the sampled tokens."""
    slots = [r.slot() for r in reqs]
    results = by_id(pipe.run(frame(*slots)))
    tokens = {}
    for r, s in zip(reqs, slots):
        res = results[r.rid]
        assert res.ok, (RejectReason.Name(res.reason), res.detail)
        assert res.has_token and res.stage_index == 1
        assert res.stamp == stage_pb2.Stamp(request_id=r.rid, epoch=r.epoch, position=s.stamp.position,
                                            parent_hash=s.stamp.parent_hash, context_hash=s.stamp.context_hash,
                                            sampling_digest=sampling_digest(r.params))
        r.fed = len(r.ids)
        r.ids.append(res.token_id)
        tokens[r.rid] = res.token_id
    return tokens


def ref_tokens(lm, prompt: list[int], params: common_pb2.SamplingParams) -> list[int]:
    return list(reference.generate_ids(lm, prompt, params).output_ids)


PROMPTS = {
    "en": list(b"The quick brown fox jumps over"),
    "zh": list("今天天气很好，我们去公园散步吧。".encode()),
    "one": [65],
}


# --- the good path ----------------------------------------------------------------------------------------------


def test_first_token_equals_reference(lm, pipe):
    prompt = PROMPTS["en"]
    params = reference.sampling_params(max_tokens=1, ignore_eos=True)
    want = ref_tokens(lm, prompt, params)
    r = Req("r1", list(prompt), params)
    assert step(pipe, [r]) == {"r1": want[0]}
    n = len(prompt)
    assert pipe.held("r1") == ((True, 1, n, context_hash(r.seed, prompt)),) * 2
    assert pipe.used[0] > 0 and pipe.used[1] > 0


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 1234)])
def test_decode_steps_equal_reference(lm, pipe, temperature, seed):
    params = reference.sampling_params(max_tokens=6, temperature=temperature, seed=seed, ignore_eos=True)
    prompt = PROMPTS["zh"]
    want = ref_tokens(lm, prompt, params)
    r = Req("r1", list(prompt), params)
    got = [step(pipe, [r])["r1"] for _ in range(6)]
    assert got == want


@pytest.mark.parametrize("in_flight", [0, 1, 2])
def test_a_frame_alone_in_the_pipeline_runs_on_its_alone_threads_with_the_same_tokens(lm, pipe, in_flight):
    """`frames_in_flight` 1 (the coordinator's hint that no other micro-batch is out) runs each stage's step on its
    `alone_threads` (2 here, the process on 1); 0 (not said) or more keeps the process's rule (1 thread). The
    hint travels to the next stage with the frame and changes no token."""
    seen: list[int] = []

    def watched(run):   # the layers' entry, whichever way they run (torch's modules or one C call)
        def run_layers(*args, **kwargs):
            seen.append(torch.get_num_threads())
            return run(*args, **kwargs)
        return run_layers
    for w in (pipe.w0, pipe.w1):
        w.model.run_layers = watched(w.model.run_layers)
    pipe.w0.alone_threads = pipe.w1.alone_threads = 2
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        r = Req("alone", list(PROMPTS["en"]))
        for _ in range(3):
            f = frame(r.slot())
            f.frames_in_flight = in_flight
            out0 = pipe.w0.process(f)
            assert out0.forward is not None and out0.forward.frames_in_flight == in_flight
            (res,) = pipe.w1.process(out0.forward).results
            assert res.ok, res.detail
            r.fed = len(r.ids)
            r.ids.append(res.token_id)
    finally:
        torch.set_num_threads(before)
        for w in (pipe.w0, pipe.w1):
            del w.model.run_layers   # the class's again
    prompt = list(PROMPTS["en"])
    assert r.ids[len(prompt):] == ref_tokens(lm, prompt, r.params)[:3]
    assert seen == [2 if in_flight == 1 else 1] * 6   # 3 steps on each of 2 stages
    assert torch.get_num_threads() == before


def test_batch_of_three_each_equal_reference(lm, pipe):
    params = reference.sampling_params(max_tokens=5, ignore_eos=True)
    reqs = [Req(name, list(p), params) for name, p in PROMPTS.items()]
    want = {r.rid: ref_tokens(lm, r.ids, params) for r in reqs}
    got = {r.rid: [] for r in reqs}
    for _ in range(5):
        for rid, t in step(pipe, reqs).items():
            got[rid].append(t)
    assert got == want


def test_chunked_prefill_without_sampling(lm, pipe):
    prompt = PROMPTS["zh"]
    params = reference.sampling_params(max_tokens=2, ignore_eos=True)
    want = ref_tokens(lm, prompt, params)
    r = Req("r1", list(prompt), params)
    res = pipe.run(frame(r.slot(upto=10, sample=False)))
    assert len(res) == 1 and res[0].ok and not res[0].has_token and res[0].stage_index == 1
    assert pipe.w1.steps == 1 and pipe.w1.busy_seconds > 0 and pipe.w1.sampling_seconds == 0   # nothing drawn
    r.fed = 10
    assert [step(pipe, [r])["r1"], step(pipe, [r])["r1"]] == want
    # Stats' split of a step: the draws are part of the last stage's busy time; the first stage draws nothing
    assert 0 < pipe.w1.sampling_seconds < pipe.w1.busy_seconds and pipe.w1.steps == 3
    assert pipe.w0.sampling_seconds == 0 and pipe.w0.steps == 3


# --- frame-level rejections -------------------------------------------------------------------------------------


def _assert_all_rejected(results, reqs, reason, stage):
    assert len(results) == len(reqs)
    res = by_id(results)
    for r in reqs:
        assert not res[r.rid].ok and res[r.rid].reason == reason, (RejectReason.Name(res[r.rid].reason), res[r.rid].detail)
        assert res[r.rid].stage_index == stage and not res[r.rid].has_token
        assert list(res[r.rid].stamp.token_ids) == []       # the echo omits the token ids


def _two_requests() -> list[Req]:
    return [Req("a", list(PROMPTS["en"])), Req("b", list(PROMPTS["zh"]))]


def test_bad_digest_at_stage_0(pipe):
    reqs = _two_requests()
    f = frame(*(r.slot() for r in reqs))
    f.payload_digest ^= 1
    _assert_all_rejected(pipe.run(f), reqs, RejectReason.DIGEST_MISMATCH, 0)
    assert pipe.used == (0, 0) and pipe.w0.state.requests == {}


def test_digest_binds_slot_hashes(pipe):
    """Swapping two slots after the digest was computed is caught even though the bytes are the same."""
    reqs = _two_requests()
    f = frame(*(r.slot() for r in reqs))
    out0 = pipe.w0.process(f)
    fwd = out0.forward
    s0, s1 = stage_pb2.Slot(), stage_pb2.Slot()
    s0.CopyFrom(fwd.slots[0])
    s1.CopyFrom(fwd.slots[1])
    del fwd.slots[:]
    fwd.slots.extend([s1, s0])
    used = pipe.w1.kv_used_tokens()
    _assert_all_rejected(pipe.w1.process(fwd).results, reqs, RejectReason.DIGEST_MISMATCH, 1)
    assert pipe.w1.kv_used_tokens() == used == 0 and pipe.w1.state.requests == {}


def _forward_of(pipe, reqs) -> stage_pb2.Frame:
    out0 = pipe.w0.process(frame(*(r.slot() for r in reqs)))
    assert out0.results == [] and out0.forward is not None
    return out0.forward


def test_tampered_activation_bytes_at_stage_1(pipe):
    reqs = _two_requests()
    fwd = _forward_of(pipe, reqs)
    data = bytearray(fwd.activations.data)
    data[100] ^= 0x40
    fwd.activations.data = bytes(data)
    _assert_all_rejected(pipe.w1.process(fwd).results, reqs, RejectReason.DIGEST_MISMATCH, 1)
    assert pipe.w1.kv_used_tokens() == 0 and pipe.w1.state.requests == {}


@pytest.mark.parametrize("corrupt", ["shape", "rows", "dtype", "short"])
def test_bad_tensor_at_stage_1(pipe, corrupt):
    reqs = _two_requests()
    fwd = _forward_of(pipe, reqs)
    rows, width = fwd.activations.shape
    itemsize = len(fwd.activations.data) // (rows * width)   # the pipeline's dtype: float32 or bfloat16 (auto)
    if corrupt == "shape":          # same bytes, claimed as another shape
        fwd.activations.shape[:] = [rows * 2, width // 2]
    elif corrupt == "rows":         # one row dropped (bytes and shape agree, but not with the stamps)
        fwd.activations.shape[:] = [rows - 1, width]
        fwd.activations.data = fwd.activations.data[: (rows - 1) * width * itemsize]
    elif corrupt == "dtype":        # the other dtype of the same bytes
        fwd.activations.dtype = "float16" if fwd.activations.dtype == "bfloat16" else "bfloat16"
    else:
        fwd.activations.data = fwd.activations.data[:-itemsize]
    KEY.seal(fwd)      # the digest is right: only the tensor check can catch it
    _assert_all_rejected(pipe.w1.process(fwd).results, reqs, RejectReason.BAD_TENSOR, 1)
    assert pipe.w1.kv_used_tokens() == 0 and pipe.w1.state.requests == {}


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_activations_at_stage_1(pipe, bad):
    reqs = _two_requests()
    # stage 1 already holds both requests: a bad step must leave their state exactly as it was
    fwd = _forward_of(pipe, reqs)
    assert all(r.ok for r in pipe.w1.process(fwd).results)
    for r in reqs:
        r.fed = len(r.ids)
        r.ids.append(70)
    before_used, before_held = pipe.w1.kv_used_tokens(), [pipe.w1.state.held(r.rid) for r in reqs]
    fwd = _forward_of(pipe, reqs)
    h = tensors.decode(fwd.activations, rows=2, width=fwd.activations.shape[1], dtype=fwd.activations.dtype).clone()
    h[1, 3] = bad
    fwd.activations.CopyFrom(tensors.encode(h))
    KEY.seal(fwd)
    _assert_all_rejected(pipe.w1.process(fwd).results, reqs, RejectReason.BAD_TENSOR, 1)
    assert pipe.w1.kv_used_tokens() == before_used
    assert [pipe.w1.state.held(r.rid) for r in reqs] == before_held


def test_first_stage_refuses_activations(pipe):
    reqs = _two_requests()
    f = frame(*(r.slot() for r in reqs), activations=tensors.encode(torch.zeros(len(reqs[0].ids) + len(reqs[1].ids),
                                                                                 256)))
    _assert_all_rejected(pipe.run(f), reqs, RejectReason.BAD_FRAME, 0)
    assert pipe.used == (0, 0)


# --- slot-level rejections --------------------------------------------------------------------------------------


def test_duplicated_request_id_is_rejected(lm, slices):
    """The second slot of a request in one frame is refused (BAD_FRAME) and reserves nothing; the first runs
    exactly as it would alone."""
    dup = Pipe(StageWorker(slices[0], 0, CAPACITY, stamp_key=KEY), StageWorker(slices[1], 1, CAPACITY, stamp_key=KEY))
    solo = Pipe(StageWorker(slices[0], 0, CAPACITY, stamp_key=KEY), StageWorker(slices[1], 1, CAPACITY, stamp_key=KEY))
    r = Req("a", list(PROMPTS["en"]))
    other = Req("a", list(PROMPTS["zh"]))                  # same id, different context
    results = dup.run(frame(r.slot(), other.slot()))
    solo_results = solo.run(frame(r.slot()))
    rejected = [x for x in results if not x.ok]
    assert len(rejected) == 1 and rejected[0].reason == RejectReason.BAD_FRAME and rejected[0].stage_index == 0
    assert "twice" in rejected[0].detail
    assert rejected[0].stamp.context_hash == other.slot().stamp.context_hash
    assert dup.used == solo.used                           # the duplicate reserved no KV
    assert dup.held("a") == solo.held("a")
    ok = [x for x in results if x.ok]
    assert [x.token_id for x in ok] == [x.token_id for x in solo_results]


def test_duplicated_bad_slot_changes_nothing(pipe):
    """A held request sent twice in one frame with a bad stamp: both copies are refused, state untouched."""
    r = Req("a", list(PROMPTS["en"]))
    step(pipe, [r])
    stale = pipe.held("a")
    used = pipe.used
    bad = r.slot()
    bad.stamp.context_hash ^= 1
    results = pipe.run(frame(bad, bad))
    assert [x.reason for x in results] == [RejectReason.STATE_MISMATCH, RejectReason.BAD_FRAME]
    assert pipe.used == used and pipe.held("a") == stale


@pytest.mark.parametrize("where", ["stage 0", "stage 1"])
def test_one_bad_slot_does_not_stop_the_others(lm, slices, where):
    params = reference.sampling_params(max_tokens=3, ignore_eos=True)
    names = ["en", "zh", "one"]
    want = {n: ref_tokens(lm, PROMPTS[n], params) for n in names}

    pipe = Pipe(StageWorker(slices[0], 0, CAPACITY, stamp_key=KEY), StageWorker(slices[1], 1, CAPACITY, stamp_key=KEY))
    reqs = [Req(n, list(PROMPTS[n]), params) for n in names]
    good = [reqs[0], reqs[2]]
    # the bad slot sits in the middle, so the rows of the slot after it must be found past the rejected rows
    if where == "stage 0":
        bad = reqs[1].slot()
        bad.stamp.parent_hash ^= 1
        results = pipe.run(frame(reqs[0].slot(), bad, reqs[2].slot()))
        rejected_at, reason = 0, RejectReason.STATE_MISMATCH
    else:
        out0 = pipe.w0.process(frame(*(r.slot() for r in reqs)))
        fwd = out0.forward
        fwd.slots[1].stamp.context_hash ^= 1
        KEY.seal(fwd)
        results = [*out0.results, *pipe.w1.process(fwd).results]
        rejected_at, reason = 1, RejectReason.STATE_MISMATCH
    res = by_id(results)
    assert not res["zh"].ok and res["zh"].reason == reason and res["zh"].stage_index == rejected_at
    assert not pipe.w1.state.held("zh").held               # stage 1 never admitted it
    for r in good:
        assert res[r.rid].ok and res[r.rid].token_id == want[r.rid][0]
        r.fed = len(r.ids)
        r.ids.append(res[r.rid].token_id)
    # the good requests' state is intact: they keep decoding exactly like the reference
    for i in range(1, 3):
        toks = step(pipe, good)
        assert [toks[r.rid] for r in good] == [want[r.rid][i] for r in good]

    # and stage 1 holds for them exactly what a pipeline that never saw the bad slot holds
    clean = Pipe(StageWorker(slices[0], 0, CAPACITY, stamp_key=KEY), StageWorker(slices[1], 1, CAPACITY, stamp_key=KEY))
    clean_reqs = [Req(r.rid, list(PROMPTS[r.rid]), params) for r in good]
    for _ in range(3):
        step(clean, clean_reqs)
    for r in good:
        a, b = pipe.w1.state.requests[r.rid].kv, clean.w1.state.requests[r.rid].kv
        assert a.length == b.length
        for layer in range(slices[1].num_layers):
            assert all(torch.equal(x, y) for x, y in zip(a.gather(layer), b.gather(layer)))


def test_unknown_request_and_position_gap(pipe):
    r = Req("a", list(PROMPTS["en"]))
    step(pipe, [r])
    used, held = pipe.used, pipe.held("a")
    late = Req("ghost", list(PROMPTS["zh"]))
    late.fed = 5
    gap = r.slot()
    gap.stamp.position += 1
    res = by_id(pipe.run(frame(late.slot(), gap)))
    assert res["ghost"].reason == RejectReason.UNKNOWN_REQUEST and res["a"].reason == RejectReason.POSITION_GAP
    assert pipe.used == used and pipe.held("a") == held and not pipe.w0.state.held("ghost").held


def test_stale_epoch_after_rebuild(lm, pipe):
    params = reference.sampling_params(max_tokens=3, ignore_eos=True)
    want = ref_tokens(lm, PROMPTS["en"], params)
    r = Req("a", list(PROMPTS["en"]), params)
    first = step(pipe, [r])["a"]
    old = r.slot()
    # rebuild: new epoch, whole context replayed from position 0
    r.epoch, r.fed = 2, 0
    assert step(pipe, [r])["a"] == want[1]
    assert pipe.held("a")[0][1] == 2 and first == want[0]
    res = pipe.run(frame(old))
    assert len(res) == 1 and res[0].reason == RejectReason.STALE_EPOCH and res[0].stage_index == 0
    assert step(pipe, [r])["a"] == want[2]


def test_no_capacity_rejects_only_the_slot_that_does_not_fit(lm, slices):
    block = settings.ATTENTION_BLOCK
    pipe = Pipe(StageWorker(slices[0], 0, block + 8, stamp_key=KEY), StageWorker(slices[1], 1, block + 8, stamp_key=KEY))
    small = Req("small", list(PROMPTS["one"]))
    big = Req("big", list(range(60)))                       # one block for "small" leaves 8 slots: 60 do not fit
    res = by_id(pipe.run(frame(small.slot(), big.slot())))
    assert res["small"].ok and res["big"].reason == RejectReason.NO_CAPACITY and res["big"].stage_index == 0
    assert pipe.used == (block, block) and not pipe.w0.state.held("big").held
    params = reference.sampling_params(max_tokens=1, ignore_eos=True)
    assert res["small"].token_id == ref_tokens(lm, PROMPTS["one"], params)[0]
