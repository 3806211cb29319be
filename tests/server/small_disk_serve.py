"""``kvscope serve`` on a "disk" that fills up: every file the daemon writes may grow to
``KVSCOPE_TEST_FILE_LIMIT`` bytes (RLIMIT_FSIZE; SIGXFSZ ignored, so a write past it fails
with EFBIG, as a full disk fails one with ENOSPC). The kernel refuses the write: nothing
in kvscope is patched. The daemon's recording is the file that reaches the limit.

Run as ``python -m tests.server.small_disk_serve serve ...`` (the arguments of engine.cli).
"""

from __future__ import annotations

import os
import resource
import signal
import sys

if __name__ == "__main__":
    limit = int(os.environ["KVSCOPE_TEST_FILE_LIMIT"])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    from kvscope.engine.cli import main

    sys.exit(main())
