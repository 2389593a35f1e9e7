"""``python -m bps.server``: run the scheduler or server that DMLC_ROLE names."""

import sys

from bps.server.role import main

sys.exit(main(sys.argv[1:]))
