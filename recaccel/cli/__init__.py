"""Console entry points: recaccel-train, recaccel-data, recaccel-bench.

Thin: parse arguments, call the API, print a summary. Any RecaccelError (or a missing
file) becomes one line on stderr and exit status 2, never a traceback. One module per
command; :mod:`recaccel.cli.common` holds what they share.
"""

from recaccel.cli.bench import bench_main
from recaccel.cli.data import data_main
from recaccel.cli.eval import eval_main
from recaccel.cli.export import export_main
from recaccel.cli.monitor import monitor_main
from recaccel.cli.plot import plot_main
from recaccel.cli.train import train_main

__all__ = ["bench_main", "data_main", "eval_main", "export_main", "monitor_main", "plot_main", "train_main"]
