"""Meta-learning (MAML, Meta-SGD) of DLRM-like models, batched over tasks.

:class:`MetaLearner` runs the meta step (one embedding lookup for the support and query
rows of all tasks, see :meth:`~recaccel.sparse.TaskBatch.concat_sparse`);
:func:`evaluate_meta` adapts and scores evaluation tasks; :class:`SyntheticTasks` plants
a per-task offset for tests and benchmarks.
"""

from recaccel.meta.evaluation import TaskMetrics, evaluate_meta
from recaccel.meta.functional import LOSSES
from recaccel.meta.heads import ADAPT_MODES, SHIFT, AdaptPlan, adapt_plan
from recaccel.meta.learner import MetaLearner
from recaccel.meta.maml import ENGINES, MetaOutput
from recaccel.meta.ranking import GAINS, auc_per_task, ndcg_per_task
from recaccel.meta.synthetic import SyntheticTasks

__all__ = [
    "ADAPT_MODES",
    "ENGINES",
    "GAINS",
    "LOSSES",
    "SHIFT",
    "AdaptPlan",
    "MetaLearner",
    "MetaOutput",
    "SyntheticTasks",
    "TaskMetrics",
    "adapt_plan",
    "auc_per_task",
    "evaluate_meta",
    "ndcg_per_task",
]
