"""`python -m tether.model`: fetch and convert the default model now (what `make setup` runs)."""

from tether.model.smollm2 import main

main()
