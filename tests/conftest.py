"""Process-wide test settings.

OpenMP threads that spin while waiting stall badly when another process (the services these tests start)
takes a core of this 2-core machine; passive waiting keeps the in-process reference fast. Must be set
before torch is imported.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
