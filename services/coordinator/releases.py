"""The request ids whose state every stage must free (finished, failed, cancelled or preempted requests):
queued from any path, sent together from the driver's feed loop, and a failed Release retried a few times
before the stages' leases are left to free it (settings.KV_LEASE_S)."""

from __future__ import annotations

RELEASE_ATTEMPTS = 3    # a Release that fails is retried this often; past that the stages' leases free it


class ReleaseQueue:
    def __init__(self, attempts: int = RELEASE_ATTEMPTS) -> None:
        self.max_attempts = attempts
        self._ids: list[str] = []
        self._failures: dict[str, int] = {}   # request id -> failed Release attempts so far

    def __bool__(self) -> bool:
        return bool(self._ids)

    def add(self, request_id: str) -> None:
        self._ids.append(request_id)

    def take(self) -> list[str]:
        """Everything queued, for one Release call."""
        ids, self._ids = self._ids, []
        return ids

    def answered(self, ids: list[str], failed: set[str] | list[str]) -> tuple[list[str], list[str]]:
        """A Release of `ids` came back with `failed` not freed on some stage: those are queued again unless
        they have failed `max_attempts` times. Returns (freed, given up): the ids to stop waiting for."""
        freed, given_up = [], []
        for rid in ids:
            if rid not in failed:
                self._failures.pop(rid, None)
                freed.append(rid)
                continue
            n = self._failures.get(rid, 0) + 1
            if n < self.max_attempts:
                self._failures[rid] = n
                self._ids.append(rid)
            else:
                self._failures.pop(rid, None)
                given_up.append(rid)
        return freed, given_up
