"""Fault injection on the stage protocol: built into the product, off unless a spec turns it on.

A spec names a probability per fault kind (per frame, or per reply for the reply-side kinds) plus a few
parameters, e.g. ``drop=0.02,corrupt=0.05,delay=0.1,delay_ms=50,seed=7``. It comes from a service's
``--faults`` flag or the ``TETHER_FAULTS`` environment variable.

One module per job: `spec` parses a spec into a FaultConfig; `injector` draws and applies the faults to copies
of frames and replies, and `ledger` follows what each one hit (both pure logic: no gRPC, no clock);
`effects` is where faults take effect in a running service (it sleeps for a delay, schedules the late flush of
a reorder-held frame on the event loop, and exits the process for a crash); `flags` holds the services' shared
experiment flags. The callers decide where the injector sits: the coordinator on its Forward stream
(services/coordinator/pipeline.py), a stage on frames it receives, forwards and answers
(services/stage_worker/server.py).

What each kind does, and where it applies:

| kind        | hook              | effect                                                                        |
|-------------|-------------------|-------------------------------------------------------------------------------|
| drop        | outbound          | the frame is not sent                                                         |
| duplicate   | outbound          | the frame is sent twice (same ``stream_seq``)                                 |
| reorder     | outbound          | the frame is held back and sent right after the next frame on that stream;   |
|             |                   | if no next frame comes within ``hold_ms`` the caller flushes it (sent late)   |
| delay       | delay_s           | the caller sleeps ``delay_ms`` before sending                                 |
| corrupt     | outbound, reply   | frame: one byte of ``activations.data`` XORed, or (no activations) one token  |
|             |                   | id of one stamp changed, hashes left as they were; reply: one token id changed|
| swap_slots  | outbound          | two slots exchange their stamps; their rows stay where they were              |
| cross_ids   | outbound, reply   | two slots (or two results) exchange request ids only                          |
| forget_kv   | forget            | names a request of the frame whose state the stage drops before processing   |
| crash       | crash             | the caller exits the process at once (``effects.crash``: exit status 137)    |

Every decision comes from a ``random.Random`` per kind, seeded from ``seed`` and the kind's name, so a
kind's decisions are reproducible and independent of the other kinds' rates. Every fault applied is counted
exactly once in ``counts``; a drawn fault that cannot apply (``swap_slots`` on a one-slot frame) is not.
The caller's messages are never mutated: a faulted frame or reply is a copy.

Each injected fault is also written to the ``tether.faults`` log with the slots it hit, as
``request_id@epoch:position`` (``fault 7 corrupt at outbound: r1@1:12 r2@3:0``), and for the kinds in
``FOLLOWED`` the injector then watches what the coordinator did about it: the next frame (or reply) of that
request through the same hook says whether the faulted slot was **caught** (a newer epoch: rebuilt; or the same
epoch and position again: resent after a sync) or **SLIPPED** through (the same epoch at a later position: the
coordinator confirmed the faulted frame and appended its token). See `FaultLedger`. A reorder whose held frame
went out in order after all (its successor was dropped, or it was flushed late), and a swap_slots or cross_ids
between twin slots (equal stamps but for the ids: two identical requests in step) did no harm and are logged so.
`duplicate` is logged but not followed: its copy is refused by the next hop's sequence check while the
original goes through, so the request rightly carries on.
"""

from tether.faults.effects import CRASH_STATUS, OutboundFaults, crash
from tether.faults.flags import add_experiment_flags, experiment_config
from tether.faults.injector import FaultInjector, HeldFrames
from tether.faults.ledger import Fault, FaultLedger, Slot
from tether.faults.spec import DEFAULT_DELAY_MS, ENV, FOLLOWED, KINDS, PARAMS, FaultConfig

__all__ = ["CRASH_STATUS", "DEFAULT_DELAY_MS", "ENV", "FOLLOWED", "KINDS", "PARAMS", "Fault", "FaultConfig",
           "FaultInjector", "FaultLedger", "HeldFrames", "OutboundFaults", "Slot", "add_experiment_flags", "crash",
           "experiment_config"]
