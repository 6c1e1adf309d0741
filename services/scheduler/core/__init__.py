"""The pure scheduling core: ``decide(view, queue, policy)`` over an immutable snapshot.

No I/O, no clock, no globals. Filters and scorers are small plugins (:mod:`.filters`,
:mod:`.scorers`) combined by a :class:`~.policy.Policy`.
"""

from services.scheduler.core.decide import (ClusterEvaluation, Decisions, NodeBinding, Pending, Placement, decide,
                                            order_queue)
from services.scheduler.core.policy import POLICY_NAMES, Policy, build_policy
from services.scheduler.core.reasons import Reason, Verdict
from services.scheduler.core.snapshot import WHOLE, ClusterIndex, ClusterState, NodeState, QueuedJob, View

__all__ = [
    "ClusterEvaluation", "ClusterIndex", "ClusterState", "Decisions", "NodeBinding", "NodeState", "POLICY_NAMES", "Pending",
    "Placement", "Policy", "QueuedJob", "Reason", "Verdict", "View", "WHOLE", "build_policy", "decide", "order_queue",
]
