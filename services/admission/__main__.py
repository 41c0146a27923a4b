"""`python -m services.admission`: start the admission (flags: --help)."""

from services.admission.main import main

if __name__ == "__main__":   # a spawned worker process imports this module too: no second service
    main()
