"""``python -m recaccel.cli``: recaccel-train (torchrun runs each rank this way)."""

import sys

from recaccel.cli.train import train_main
from recaccel.train.distributed.launch import exit_rank, under_torchrun

status = train_main()
if under_torchrun():
    exit_rank(status)
sys.exit(status)
