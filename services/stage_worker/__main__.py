"""`python -m services.stage_worker`: start the stage worker (flags: --help)."""

from services.stage_worker.main import main

main()
