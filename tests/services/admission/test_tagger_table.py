"""Per-dimension accuracy of the tagger on a hand-labelled table of prompts of our own.

The table (data/tagger_labels.jsonl, described in data/README.md) was labelled before the tagger was tuned
on it; a quarter of it (split "holdout") was kept out of tuning. The test prints accuracy per dimension on
the tuning part, the held-out part and the whole, and asserts at least MIN_ACCURACY on the whole table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from services.admission.tagger import Tags, tag

TABLE = Path(__file__).parent / "data" / "tagger_labels.jsonl"
MIN_ACCURACY = 0.95
MIN_ROWS = 200
MAX_TOKENS = 4096

DIMENSIONS: dict[str, Callable[[Tags], str]] = {
    "language": lambda t: t.language,
    "length": lambda t: f"{t.length_limit} {t.length_unit}" if t.length_limit else "none",
    "task": lambda t: t.task,
    "domain": lambda t: t.domain,
    "audience": lambda t: t.audience,
}


def load_table() -> list[dict]:
    with TABLE.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def score(rows: list[dict]) -> dict[str, tuple[int, int, list[tuple[int, str, str]]]]:
    """dimension -> (right, labelled, [(row id, expected, got)]); unlabelled (null) cells are skipped."""
    result: dict[str, tuple[int, int, list[tuple[int, str, str]]]] = {}
    tagged = [(row, tag(row["prompt"], input_tokens=len(row["prompt"]), max_tokens=MAX_TOKENS)) for row in rows]
    for dim, read in DIMENSIONS.items():
        right = labelled = 0
        wrong: list[tuple[int, str, str]] = []
        for row, tags in tagged:
            if row[dim] is None:
                continue
            labelled += 1
            got = read(tags)
            if got == row[dim]:
                right += 1
            else:
                wrong.append((row["id"], row[dim], got))
        result[dim] = (right, labelled, wrong)
    return result


def _report(name: str, scores: dict[str, tuple[int, int, list]]) -> str:
    cells = "  ".join(f"{dim} {r}/{n} {r / max(n, 1):.1%}" for dim, (r, n, _) in scores.items())
    return f"{name:8s} {cells}"


def test_table_is_well_formed() -> None:
    rows = load_table()
    assert len(rows) >= MIN_ROWS
    assert len({row["id"] for row in rows}) == len(rows)
    assert len({row["prompt"] for row in rows}) == len(rows)
    assert {row["split"] for row in rows} == {"tune", "holdout"}
    held = sum(row["split"] == "holdout" for row in rows)
    assert 0.2 <= held / len(rows) <= 0.3
    values = {
        "language": {"zh", "en", "mixed", "other"},
        "task": {"qa", "summarize", "translate", "code", "creative", "chat"},
        "domain": {"general", "medical", "legal", "finance"},
        "audience": {"general", "elderly", "child", "expert"},
    }
    for row in rows:
        for dim, allowed in values.items():
            assert row[dim] is None or row[dim] in allowed, (row["id"], dim, row[dim])
        length = row["length"]
        if length not in (None, "none"):
            limit, unit = length.split(" ")
            assert int(limit) > 0 and unit in {"chars", "words", "sentences", "tokens"}, (row["id"], length)


def test_per_dimension_accuracy() -> None:
    rows = load_table()
    parts = {"tune": [r for r in rows if r["split"] == "tune"],
             "holdout": [r for r in rows if r["split"] == "holdout"], "all": rows}
    scores = {name: score(part) for name, part in parts.items()}
    for name in parts:
        print(_report(name, scores[name]))
    for dim, (_, _, wrong) in scores["all"].items():
        for row_id, expected, got in wrong:
            print(f"  wrong {dim}: row {row_id} expected {expected!r} got {got!r}")
    low = {dim: f"{r / n:.1%}" for dim, (r, n, _) in scores["all"].items() if r < MIN_ACCURACY * n}
    assert not low, f"dimensions under {MIN_ACCURACY:.0%} on the whole table: {low}"
