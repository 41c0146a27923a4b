"""`python -m tether.forkserver SOCKET`: serve forks on the Unix socket SOCKET until stdin closes."""

import sys

from tether.forkserver.server import main

main(sys.argv[1:])
