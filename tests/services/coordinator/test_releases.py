"""The coordinator's queue of Releases (services/coordinator/releases.py): sent together, a failed one
retried, a hopeless one given up to the stages' leases."""

from services.coordinator.releases import ReleaseQueue


def test_ids_go_out_together_and_a_failed_one_is_retried_until_given_up():
    q = ReleaseQueue(attempts=3)
    assert not q
    for rid in ("a", "b", "c"):
        q.add(rid)
    ids = q.take()
    assert ids == ["a", "b", "c"] and not q
    assert q.answered(ids, {"b"}) == (["a", "c"], [])
    assert q.take() == ["b"]                          # queued again after its first failure
    assert q.answered(["b"], {"b"}) == ([], [])       # second failure: once more
    assert q.answered(q.take(), {"b"}) == ([], ["b"])   # third: left to the leases
    assert not q


def test_a_success_forgets_earlier_failures():
    q = ReleaseQueue(attempts=2)
    q.add("a")
    assert q.answered(q.take(), ["a"]) == ([], [])
    assert q.answered(q.take(), []) == (["a"], [])
    q.add("a")                                        # the same id again later starts from zero failures
    assert q.answered(q.take(), ["a"]) == ([], [])
    assert q.take() == ["a"]
