"""The pure scheduling core: ``decide(view, queue, policy)`` over an immutable snapshot.

No I/O, no clock, no globals. Filters and scorers are small plugins (:mod:`.filters`,
:mod:`.scorers`) combined by a :class:`~.policy.Policy`; queue order in :mod:`.queues`;
preemption and wait estimates in :mod:`.preempt`; counterfactual explanations in :mod:`.explain`.
"""

from fedsched.reasons import Reason, Verdict
from services.scheduler.core.decide import (ClusterEvaluation, Decisions, NodeBinding, Pending, Placement, Reservation,
                                            decide, order_queue)
from services.scheduler.core.policy import POLICY_NAMES, Policy, build_policy
from services.scheduler.core.snapshot import (WHOLE, ClusterIndex, ClusterState, NodeState, QueuedJob, RunningSet,
                                              RunningWork, Usage, View)

__all__ = [
    "ClusterEvaluation", "ClusterIndex", "ClusterState", "Decisions", "NodeBinding", "NodeState", "POLICY_NAMES",
    "Pending", "Placement", "Policy", "QueuedJob", "Reason", "Reservation", "RunningSet", "RunningWork", "Usage", "Verdict", "View",
    "WHOLE", "build_policy", "decide", "order_queue",
]
