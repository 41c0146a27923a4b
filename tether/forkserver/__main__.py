"""`python -m tether.forkserver SOCKET KIND`: serve forks of KIND's modules on the Unix socket SOCKET until stdin
closes."""

import sys

from tether.forkserver.server import main

main(sys.argv[1:])
