"""The one priority type (tether/priority.py): its order, its wire spelling, and how text becomes one."""

import pytest

from tether.priority import DEFAULT, PRIORITIES, Priority, from_peer, parse


def test_most_urgent_first_and_spelled_as_on_the_wire():
    assert PRIORITIES == (Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE)
    assert [p.rank for p in PRIORITIES] == [0, 1, 2]
    assert PRIORITIES == ("critical", "standard", "sheddable")   # equal to the strings protos and TOML carry
    assert f"{Priority.SHEDDABLE} requests" == "sheddable requests" and DEFAULT is Priority.STANDARD


@pytest.mark.parametrize("text,expected", [("", Priority.STANDARD), (" Critical ", Priority.CRITICAL),
                                           ("sheddable", Priority.SHEDDABLE)])
def test_parse_reads_what_a_caller_sends(text, expected):
    assert parse(text) is expected


def test_parse_names_the_allowed_values():
    with pytest.raises(ValueError, match="priority must be one of critical, standard, sheddable; got 'urgent'"):
        parse("urgent")


def test_a_peer_sending_no_priority_or_another_word_gets_the_default():
    assert from_peer("critical") is Priority.CRITICAL
    assert from_peer("") is from_peer("unknown-priority") is Priority.STANDARD
