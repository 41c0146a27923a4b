"""What keyed stamps cost (issue 14 part 4): µs per slot and per frame of the keyed primitives, against the
step time of the same frame on `tiny`.

In one process, side by side in every repeat: a whole-model `tiny` StageWorker is fed decode frames of N
slots (N = 1, 16, 64; one token each, after a prefill of --prompt tokens) the way the coordinator feeds them.
Per frame it times

- coordinator: `StampKey.sign` of every slot + the keyed payload digest (what `Pipeline.send` adds), and the
  keyed token-hash check of every reply (what `Driver._settle` does);
- stage: `verify` of every slot + the keyed payload digest + one `token_mac` per slot (the stage's keyed work
  in a last-stage step, redone outside the step on the same slots so it can be timed alone);
- the step itself: `StageWorker.process` of the frame (checks + layers + sampling, keyed work included);
- the unkeyed work it replaces (xxh3 payload seed and token hash), for the difference;
- signing with a keyed BLAKE2b made anew per slot instead of copied from the keyed base object: why the copy.

The figure is the median over frames of each; ratio = (coordinator + stage keyed work) ÷ step time. Medians,
not means: a 2-core shared machine is noisy. Prefill chunks cost more per slot (the MAC covers the token ids
themselves: BLAKE2b over 4 bytes per token), measured with --chunk.

    .venv/bin/python bench/stamp_mac.py                    # 1, 16, 64 slots, 200 frames each
    .venv/bin/python bench/stamp_mac.py --frames 400 --json bench-out/stamp_mac.json

Figures: docs/PERFORMANCE.md, "Overheads".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from hashlib import blake2b
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import xxhash  # noqa: E402

from services.stage_worker.worker import StageWorker  # noqa: E402
from tether import reference  # noqa: E402
from tether.model.config import ModelConfig  # noqa: E402
from tether.model.loader import load_slice, resolve_model  # noqa: E402
from tether.protocol.hashing import ContextHasher, hash_seed, sampling_digest  # noqa: E402
from tether.protocol.stamp_key import StampKey  # noqa: E402
from tether.v1 import stage_pb2  # noqa: E402

US = 1e6


class Coordinator:
    """The coordinator's side for N requests on one stage: stamps, chains and the token check."""

    def __init__(self, n: int, prompt: int, key: StampKey, seed: int) -> None:
        self.key, self.seed = key, seed
        self.params = reference.sampling_params(max_tokens=1 << 20, ignore_eos=True)
        self.digest = sampling_digest(self.params)
        self.ids = [[(7 * i + j) % 200 + 5 for j in range(prompt)] for i in range(n)]
        self.fed = [0] * n
        self.chains = [ContextHasher(seed) for _ in range(n)]

    def slots(self) -> list[stage_pb2.Slot]:
        out = []
        for i, ids in enumerate(self.ids):
            new = ids[self.fed[i]:]
            st = stage_pb2.Stamp(request_id=f"{i:032x}", epoch=1, position=self.fed[i], token_ids=new,
                                 parent_hash=self.chains[i].value, context_hash=self.chains[i].peek(new),
                                 sampling_digest=self.digest)
            out.append(stage_pb2.Slot(stamp=st, sampling=self.params, sample=True, hash_seed=self.seed))
        return out

    def check_tokens(self, results) -> list[tuple[int, int, int]]:
        """The keyed token check of every result (the Driver's), returning what accept() needs."""
        got = []
        for i, res in enumerate(results):
            after = self.chains[i].peek(self.ids[i][self.fed[i]:] + [res.token_id])
            if res.token_hash != self.key.token_mac(after, res.stamp.request_id, 1, len(self.ids[i]), self.digest,
                                                    res.token_id):
                raise AssertionError("token hash mismatch")
            got.append((i, res.token_id, after))
        return got

    def accept(self, results) -> None:
        for i, res in enumerate(results):
            self.chains[i].extend(self.ids[i][self.fed[i]:])
            self.fed[i] = len(self.ids[i])
            self.ids[i].append(res.token_id)


def stage_keyed_work(key: StampKey, frame: stage_pb2.Frame, results) -> None:
    """The keyed work of a last stage on this frame, alone: verify every slot, the payload digest, token MACs."""
    for s in frame.slots:
        if not key.verify(s):
            raise AssertionError("stamp MAC")
    key.frame_digest(frame.activations.data, frame.slots)
    for s, res in zip(frame.slots, results):   # the chain value is any u64: the cost is what is measured
        key.token_mac(res.token_hash, s.stamp.request_id, s.stamp.epoch, s.stamp.position + 1, s.stamp.sampling_digest,
                      res.token_id)


def unkeyed_work(frame: stage_pb2.Frame, results) -> None:
    """What the same frame cost before keyed stamps (xxh3 payload seed and token hash), both sides."""
    for _ in range(2):   # the coordinator's digest and the stage's check
        bindings = [s.stamp.context_hash for s in frame.slots]   # decode frames: no cached prefix
        seed = xxhash.xxh3_64_intdigest(b"".join(b.to_bytes(8, "little") for b in bindings))
        xxhash.xxh3_64_intdigest(frame.activations.data, seed=seed)
    for _ in range(2):   # the stage's token hash and the coordinator's check
        for s, res in zip(frame.slots, results):
            xxhash.xxh3_64_intdigest(s.stamp.request_id.encode(), seed=res.token_hash ^ s.stamp.sampling_digest)


class _Rekeyed:
    """Stands in for StampKey's keyed base object: every `copy()` keys a new BLAKE2b instead."""

    def __init__(self, key: bytes) -> None:
        self.key = key

    def copy(self):
        return blake2b(key=self.key, digest_size=8, person=b"tether/v1/stamp")


def rekeyed(key: StampKey) -> StampKey:
    """The same key, signing with a BLAKE2b keyed anew per slot (the alternative to copying)."""
    k = StampKey(key.key)
    k._stamp = _Rekeyed(key.key)
    return k


def run(model, n: int, frames: int, prompt: int, chunk: int) -> dict:
    key = StampKey.generate()
    seed = hash_seed("bench", "")
    worker = StageWorker(model, 0, n * 64 * ((prompt + frames) // 64 + 2), stamp_key=key)   # 64-position blocks
    coord = Coordinator(n, prompt, key, seed)
    seq = 0

    def step(slots):
        nonlocal seq
        seq += 1
        t0 = time.perf_counter()
        key.sign(slots)
        f = stage_pb2.Frame(stream_seq=seq, pipeline_epoch=1, slots=slots)
        f.payload_digest = key.frame_digest(b"", slots)
        t_sign = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = worker.process(f)
        t_step = time.perf_counter() - t0
        assert all(r.ok for r in out.results), [stage_pb2.RejectReason.Name(r.reason) for r in out.results]
        return f, out.results, t_sign, t_step

    f, results, _, _ = step(coord.slots())        # the prefill
    coord.check_tokens(results)
    coord.accept(results)
    rekey = rekeyed(key)
    rows = {k: [] for k in ("coord_sign", "coord_check", "stage", "step", "unkeyed", "copy_sign", "rekey_sign")}
    for _ in range(frames):
        f, results, t_sign, t_step = step(coord.slots())
        t0 = time.perf_counter()
        coord.check_tokens(results)
        t_check = time.perf_counter() - t0
        t0 = time.perf_counter()
        stage_keyed_work(key, f, results)
        t_stage = time.perf_counter() - t0
        t0 = time.perf_counter()
        unkeyed_work(f, results)
        t_unkeyed = time.perf_counter() - t0
        t0 = time.perf_counter()
        key.sign(f.slots)
        t_copy = time.perf_counter() - t0
        t0 = time.perf_counter()
        rekey.sign(f.slots)
        t_rekey = time.perf_counter() - t0
        coord.accept(results)
        for k, v in zip(rows, (t_sign, t_check, t_stage, t_step, t_unkeyed, t_copy, t_rekey)):
            rows[k].append(v * US)
    med = {k: statistics.median(v) for k, v in rows.items()}
    keyed = med["coord_sign"] + med["coord_check"] + med["stage"]
    # a prefill chunk: the MAC covers its token ids (BLAKE2b over 4 bytes per token)
    chunk_slots = [stage_pb2.Slot(stamp=stage_pb2.Stamp(request_id=f"{i:032x}", epoch=1, position=0,
                                                        token_ids=list(range(chunk))), hash_seed=seed)
                   for i in range(n)]
    t = []
    for _ in range(max(5, frames // 10)):
        t0 = time.perf_counter()
        key.sign(chunk_slots)
        t.append((time.perf_counter() - t0) * US)
    return {
        "slots": n, "frames": frames,
        "step_us": round(med["step"], 1),
        "coordinator_sign_us": round(med["coord_sign"], 1), "coordinator_token_check_us": round(med["coord_check"], 1),
        "stage_keyed_us": round(med["stage"], 1),
        "keyed_per_frame_us": round(keyed, 1), "keyed_per_slot_us": round(keyed / n, 2),
        "unkeyed_before_us": round(med["unkeyed"], 1), "added_us": round(keyed - med["unkeyed"], 1),
        "ratio_keyed_to_step": round(keyed / med["step"], 4),
        "ratio_added_to_step": round((keyed - med["unkeyed"]) / med["step"], 4),
        "sign_us_per_slot": round(med["copy_sign"] / n, 2),
        "rekey_sign_us_per_slot": round(med["rekey_sign"] / n, 2),
        f"sign_chunk{chunk}_us_per_slot": round(statistics.median(t) / n, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--slots", default="1,16,64")
    ap.add_argument("--frames", type=int, default=200, help="decode frames per slot count (after one prefill)")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256, help="tokens per slot of the prefill-chunk signing figure")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_model(args.model)
    model = load_slice(folder, 0, ModelConfig.from_folder(folder).num_hidden_layers)
    out = [run(model, int(n), args.frames, args.prompt, args.chunk) for n in args.slots.split(",")]
    cols = ["slots", "step_us", "coordinator_sign_us", "coordinator_token_check_us", "stage_keyed_us",
            "keyed_per_slot_us", "added_us", "ratio_keyed_to_step", "sign_us_per_slot", "rekey_sign_us_per_slot",
            f"sign_chunk{args.chunk}_us_per_slot"]
    print(" | ".join(cols))
    for r in out:
        print(" | ".join(str(r[c]) for c in cols))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": args.model, "runs": out}, indent=2))


if __name__ == "__main__":
    main()
