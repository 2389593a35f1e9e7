"""``python -m bps.server``: run the scheduler or server that DMLC_ROLE names."""

import sys

from bps.server.role import end_process, main

end_process(main(sys.argv[1:]))
