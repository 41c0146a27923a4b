"""Per-request KV state: the paged arena (paged.py, torch), each request's block table, and the block pool that
bounds it (blocks.py, pure Python: the coordinator's ledger uses it without torch). Nothing is imported here."""
