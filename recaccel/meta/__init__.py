"""Meta-learning (MAML, Meta-SGD) of DLRM-like models, batched over tasks.

:class:`MetaLearner` runs the meta step; :func:`evaluate_meta` adapts and scores
evaluation tasks; :func:`concat_rows` merges support and query CSRs for one lookup.
"""

from recaccel.meta.evaluation import TaskMetrics, evaluate_meta
from recaccel.meta.heads import ADAPT_MODES, SHIFT, AdaptPlan, adapt_plan
from recaccel.meta.learner import MetaLearner
from recaccel.meta.maml import ENGINES, MetaOutput
from recaccel.meta.ranking import GAINS, auc_per_task, ndcg_per_task
from recaccel.meta.rows import concat_rows, split_task_rows
from recaccel.meta.synthetic import SyntheticTasks

__all__ = [
    "ADAPT_MODES",
    "ENGINES",
    "GAINS",
    "SHIFT",
    "AdaptPlan",
    "MetaLearner",
    "MetaOutput",
    "SyntheticTasks",
    "TaskMetrics",
    "adapt_plan",
    "auc_per_task",
    "concat_rows",
    "evaluate_meta",
    "ndcg_per_task",
    "split_task_rows",
]
