"""`python -m services.coordinator`: start the coordinator (flags: --help)."""

from services.coordinator.main import main

main()
