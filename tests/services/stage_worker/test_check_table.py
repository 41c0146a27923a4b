"""The stage's checks are one ordered table (services/stage_worker/state.py `CHECKS`), and docs/PROTOCOL.md's
table under "What a stage checks before it touches any KV" lists exactly its rows, in its order: level, reason,
check, and whether the unsafe experiment skips it. Every RejectReason a stage can answer with has a row."""

from __future__ import annotations

from pathlib import Path

from services.stage_worker.state import CHECKS, LEVELS, StageState
from services.stage_worker.unchecked import UncheckedStageState
from tether.v1 import stage_pb2

DOC = Path(__file__).resolve().parents[3] / "docs" / "PROTOCOL.md"
SECTION = "### What a stage checks before it touches any KV"
# Answered by a stage outside the table: NO_CAPACITY is the reservation after the checks, not a predicate.
OUTSIDE = {"REJECT_REASON_NONE", "NO_CAPACITY"}


def doc_rows() -> list[tuple[str, str, str, bool]]:
    text = DOC.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n### ", 1)]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0] in LEVELS:
            level, reason, check, _, unsafe = cells
            assert unsafe in ("skips", "checks"), line
            rows.append((level, reason.strip("`"), check.strip("`"), unsafe == "skips"))
    return rows


def code_rows() -> list[tuple[str, str, str, bool]]:
    return [(c.level, stage_pb2.RejectReason.Name(c.reason), c.name, c.unsafe_skips) for c in CHECKS]


def test_protocol_md_lists_the_code_checks_in_order():
    doc, code = doc_rows(), code_rows()
    assert doc, f"no check table found under {SECTION!r}"
    assert doc == code, "docs/PROTOCOL.md's check table and state.CHECKS differ:\n" + "\n".join(
        f"  doc {d}  code {c}" for d, c in zip(doc + [None] * len(code), code + [None] * len(doc)) if d != c)


def test_the_levels_come_in_order_and_every_reason_has_a_row():
    levels = [c.level for c in CHECKS]
    assert levels == sorted(levels, key=LEVELS.index)
    named = {stage_pb2.RejectReason.Name(c.reason) for c in CHECKS}
    assert set(stage_pb2.RejectReason.keys()) - OUTSIDE == named
    assert len({c.name for c in CHECKS}) == len(CHECKS)   # a check is named once


def test_the_unsafe_experiment_walks_the_table_without_its_skipped_rows():
    checked, unchecked = StageState(lambda o: None, 16), UncheckedStageState(lambda o: None, 16)
    for level in LEVELS:
        assert checked.checks[level] == tuple(c for c in CHECKS if c.level == level)
        assert unchecked.checks[level] == tuple(c for c in CHECKS if c.level == level and not c.unsafe_skips)

