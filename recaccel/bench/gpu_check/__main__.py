"""``python -m recaccel.bench.gpu_check``: the runner's command line."""

import sys

from recaccel.bench.gpu_check.runner import main

sys.exit(main())
