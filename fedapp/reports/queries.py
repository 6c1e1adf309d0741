"""The saved report queries: one SQL text each, run by ``fedsched report`` and by Grafana.

Every query is a template over the audit log and its projections (database ``{{DB}}``) with a
time window [``{{FROM}}``, ``{{TO}}``) and, for time series, a bucket size ``{{BUCKET}}``
(seconds). :func:`render` fills the placeholders for clickhouse-connect (server-side query
parameters) or for the Grafana ClickHouse data source (its ``$__fromTime_ms`` /
``$__toTime_ms`` / ``$__interval_s`` macros and a ``${database}`` variable), so the two run the
same SQL. Time series buckets start at ``{{FROM}}`` and are never narrower than 1/200 of the
window (a dashboard zoomed out over months stays cheap).

Definitions (business time; "job" = job id; "attempt" = job id x attempt x shard):

* **wait** -- first ``job.started`` minus ``job.submitted`` of a job submitted in the window,
  by the region it first started in, its kind (from the submitted spec) or its tenant;
  quantiles are ``quantileExact`` (the element at index ``floor(q * n)`` of the sorted waits).
* **cross-region** -- jobs whose first start is in the window, by that start's region; a job is
  cross-region if any of its attempts started outside its home region; it succeeded if its
  last ended attempt (``job.finished`` / ``job.failed``) finished.
* **transfer** -- placements in the window that moved data (``transfer_bytes > 0``), by the
  job's home region -> placement region; egress cost from the matching ``transfer`` usage lines;
  ``overhead_share = transfer time / (transfer time + run time)`` over attempts that ended.
* **failures** -- attempts that ended in the window, per cluster:
  ``failure_rate = (failed + rejected) / (finished + failed + stopped + rejected)``.
* **failovers** -- attempts declared lost in the window (``job.stopped`` with reason
  ``cluster_lost``, published by the scheduler when their cluster fell silent): where and when,
  and the shard's next placement (attempt + 1): the cluster it moved to, when, after how many
  seconds, from how much checkpointed work it resumed; ``moved_to`` is empty while it waits.
* **reconciliation** -- what agents did to make their cluster agree with the federation's
  book, by reason: ``agent.*`` events, and ``job.stopped`` reported by an
  agent with a reason other than the scheduler's orders (cancelled, preempted, reclaimed,
  cluster_lost) -- e.g. ``orphaned`` (running under fedsched's labels with no live attempt)
  or ``superseded`` (an attempt older than the job's current one).
* **GPU utilisation** -- per cluster and bucket, GPU-seconds of started attempts overlapping
  the bucket (``gpu_milli / 1000`` x overlap; attempts still running count until ``{{TO}}``)
  over ``GPUs x bucket seconds``; GPUs = the cluster's latest inventory before ``{{TO}}``.
* **queue length** -- per job kind and bucket, the most jobs waiting at once. A job waits from
  ``job.submitted`` until a ``job.started``, and again after an attempt is rejected, stopped
  (other than cancelled) or failed when it starts again later; ``job.finished``,
  ``job.cancelled``, a cancelling stop and a failure after the job's last start end it.
* **capacity hints** -- per card model: GPUs (latest inventory), utilisation over the window,
  waits of the jobs that started on it, and ``hint``: ``expand`` when p95 wait >= 600 s and
  utilisation >= 0.8, ``wait-bound`` (waits without high utilisation: quota, fragmentation or
  placement rules), ``busy`` (high utilisation, short waits), else empty.
* **approvals** -- every ``approval.*`` event in the window (who, what, when, which rule).
* **chargeback** -- usage lines ended in the window by month x tenant x project x region x
  card model, compute and transfer cost, with shares of the month and of the tenant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: ``table`` prints rows; ``bar`` and ``timeseries`` are also drawn (HTML, Grafana).
Shape = Literal["table", "bar", "timeseries"]


@dataclass(frozen=True)
class SavedQuery:
    """One report.

    Attributes:
        name: identifier (``snake_case``), also the Grafana panel's refId source.
        title: heading for people.
        description: one or two sentences: what it shows and how it is computed.
        sql: the template (placeholders ``{{DB}}``, ``{{FROM}}``, ``{{TO}}``, ``{{BUCKET}}``).
        shape: how it is drawn.
        x / y / series: for charts: category or time column, value column(s), series column.
        unit: value unit for charts (``s``, ``ratio``, ``jobs``, ``GB``, currency).
    """

    name: str
    title: str
    description: str
    sql: str
    shape: Shape = "table"
    x: str = ""
    y: tuple[str, ...] = ()
    series: str = ""
    unit: str = ""

    @property
    def is_timeseries(self) -> bool:
        """True for time series (one ``time`` column, sorted)."""
        return self.shape == "timeseries"


_BUCKET = ("greatest(toUInt32({{BUCKET}}), toUInt32(intDiv(dateDiff('second', {{FROM}}, {{TO}}), 200)), 1)")

_WAITS = """
WITH submitted AS (
        SELECT job_id, min(occurred_at) AS at, any(tenant) AS tenant,
               any(JSONExtractString(payload, 'spec', 'kind')) AS kind
        FROM {{DB}}.events
        WHERE type = 'job.submitted'
        GROUP BY job_id
        HAVING at >= {{FROM}} AND at < {{TO}}),
    started AS (
        SELECT job_id, min(occurred_at) AS at, argMin(region, occurred_at) AS region
        FROM {{DB}}.events
        WHERE type = 'job.started'
        GROUP BY job_id)
SELECT %(dim)s AS %(dim)s, count() AS jobs, quantileExact(0.5)(w) AS p50_s, quantileExact(0.95)(w) AS p95_s,
       avg(w) AS mean_s, max(w) AS max_s
FROM (
    SELECT submitted.tenant AS tenant, submitted.kind AS kind, started.region AS region,
           dateDiff('millisecond', submitted.at, started.at) / 1000.0 AS w
    FROM submitted INNER JOIN started ON submitted.job_id = started.job_id)
GROUP BY %(dim)s
ORDER BY %(dim)s"""


def _waits(dim: str) -> SavedQuery:
    return SavedQuery(
        name=f"wait_by_{dim}", title=f"Submit-to-start time by {dim}",
        description=f"Jobs submitted in the window that started: p50 / p95 / mean / max seconds from submission to "
                    f"first start, by {'the region of the first start' if dim == 'region' else dim}.",
        sql=_WAITS % {"dim": dim}, shape="bar", x=dim, y=("p50_s", "p95_s"), unit="s")


CROSS_REGION = SavedQuery(
    name="cross_region", title="Cross-region jobs and their success",
    description="Jobs whose first start is in the window, by that start's region: how many ran (at least once) "
                "outside their home region, and the share of ended jobs that succeeded, cross-region vs local.",
    shape="bar", x="region", y=("cross_region_ratio", "cross_region_success_rate", "local_success_rate"),
    unit="ratio", sql="""
WITH starts AS (
        SELECT job_id, min(occurred_at) AS first_start, argMin(region, occurred_at) AS region,
               max(JSONExtractBool(payload, 'cross_region')) AS crossed
        FROM {{DB}}.events
        WHERE type = 'job.started'
        GROUP BY job_id
        HAVING first_start >= {{FROM}} AND first_start < {{TO}}),
    outcomes AS (
        SELECT job_id, argMax(type, (occurred_at, attempt)) AS last
        FROM {{DB}}.events
        WHERE type IN ('job.finished', 'job.failed')
        GROUP BY job_id)
SELECT region, count() AS jobs_started, countIf(crossed) AS cross_region_jobs,
       cross_region_jobs / jobs_started AS cross_region_ratio,
       countIf(crossed AND last != '') AS cross_region_ended,
       countIf(crossed AND last = 'job.finished') AS cross_region_succeeded,
       if(cross_region_ended > 0, cross_region_succeeded / cross_region_ended, NULL) AS cross_region_success_rate,
       countIf(NOT crossed AND last != '') AS local_ended,
       countIf(NOT crossed AND last = 'job.finished') AS local_succeeded,
       if(local_ended > 0, local_succeeded / local_ended, NULL) AS local_success_rate
FROM starts LEFT JOIN outcomes ON starts.job_id = outcomes.job_id
GROUP BY region
ORDER BY region""")

TRANSFER = SavedQuery(
    name="transfer_overhead", title="Transfer overhead",
    description="Placements in the window that moved data between regions, by home region -> placement region: "
                "GB moved, estimated transfer time, egress cost (transfer usage lines) and the transfer's share of "
                "transfer + run time of the attempts that ended.",
    shape="bar", x="route", y=("gb",), unit="GB", sql="""
WITH placed AS (
        SELECT event_id, job_id, attempt, JSONExtractUInt(payload, 'shard') AS shard,
               JSONExtractString(payload, 'spec', 'home_region') AS home_region, region,
               JSONExtractUInt(payload, 'transfer_bytes') AS bytes, JSONExtractFloat(payload, 'transfer_s') AS transfer_s
        FROM {{DB}}.events
        WHERE type = 'job.placed' AND occurred_at >= {{FROM}} AND occurred_at < {{TO}}
          AND JSONExtractUInt(payload, 'transfer_bytes') > 0),
    ran AS (
        SELECT job_id, attempt, shard, sum(dateDiff('millisecond', started_at, ended_at)) / 1000.0 AS run_s
        FROM {{DB}}.usage
        WHERE line = 'compute' AND job_id IN (SELECT job_id FROM placed)
        GROUP BY job_id, attempt, shard),
    egress AS (
        SELECT usage_id, cost FROM {{DB}}.usage
        WHERE line = 'transfer' AND usage_id IN (SELECT event_id FROM placed))
SELECT concat(home_region, ' -> ', region) AS route, home_region, region, count() AS placements,
       sum(bytes) / 1e9 AS gb, sum(transfer_s) / 3600 AS transfer_hours, avg(transfer_s) AS mean_transfer_s,
       sum(egress.cost) AS egress_cost,
       sumIf(transfer_s, ran.run_s > 0) / nullIf(sumIf(transfer_s + ran.run_s, ran.run_s > 0), 0) AS overhead_share
FROM placed
    LEFT JOIN ran ON placed.job_id = ran.job_id AND placed.attempt = ran.attempt AND placed.shard = ran.shard
    LEFT JOIN egress ON placed.event_id = egress.usage_id
GROUP BY home_region, region
ORDER BY gb DESC, route""")

FAILURES = SavedQuery(
    name="failure_by_cluster", title="Failure rate by cluster",
    description="Attempts that ended in the window, per cluster; failure rate = (failed + rejected) / all ended "
                "(finished, failed, stopped, rejected).",
    shape="bar", x="cluster", y=("failure_rate",), unit="ratio", sql="""
SELECT cluster, any(region) AS region, count() AS attempts_ended,
       countIf(type = 'job.finished') AS finished, countIf(type = 'job.failed') AS failed,
       countIf(type = 'job.stopped') AS stopped, countIf(type = 'job.rejected') AS rejected,
       (failed + rejected) / attempts_ended AS failure_rate
FROM {{DB}}.events
WHERE type IN ('job.finished', 'job.failed', 'job.stopped', 'job.rejected')
  AND occurred_at >= {{FROM}} AND occurred_at < {{TO}}
GROUP BY cluster
ORDER BY cluster""")

FAILOVERS = SavedQuery(
    name="failovers", title="Failovers",
    description="Attempts declared lost with their cluster in the window (job.stopped cluster_lost): attempt N "
                "lost on cluster X at T, moved to Y (its next placement), how long the move took and the work "
                "it resumed from.",
    sql="""
SELECT l.at AS lost_at, l.job_id AS job_id, l.shard AS shard, l.tenant AS tenant, l.attempt AS attempt,
       l.cluster AS lost_on, l.progress_s AS progress_s, n.cluster AS moved_to, n.attempt AS next_attempt,
       if(n.cluster = '', NULL, n.at) AS placed_at,
       if(n.cluster = '', NULL, dateDiff('millisecond', l.at, n.at) / 1000.0) AS move_s,
       n.resume_from_s AS resume_from_s
FROM (
    SELECT job_id, attempt, JSONExtractUInt(payload, 'shard') AS shard, any(tenant) AS tenant,
           any(cluster) AS cluster, min(occurred_at) AS at, max(JSONExtractFloat(payload, 'progress_s')) AS progress_s
    FROM {{DB}}.events
    WHERE type = 'job.stopped' AND JSONExtractString(payload, 'reason') = 'cluster_lost'
      AND occurred_at >= {{FROM}} AND occurred_at < {{TO}}
    GROUP BY job_id, attempt, shard) AS l
LEFT JOIN (
    SELECT job_id, attempt, JSONExtractUInt(payload, 'shard') AS shard, any(cluster) AS cluster,
           min(occurred_at) AS at, max(JSONExtractFloat(payload, 'resume_from_s')) AS resume_from_s
    FROM {{DB}}.events
    WHERE type = 'job.placed' AND occurred_at >= {{FROM}}
    GROUP BY job_id, attempt, shard) AS n
    ON n.job_id = l.job_id AND n.shard = l.shard AND n.attempt = l.attempt + 1
ORDER BY lost_at, job_id, shard""")

#: stop reasons that carry out the scheduler's own orders (anything else an agent reports is its own action)
_ORDERED = "('cancelled', 'preempted', 'reclaimed', 'cluster_lost')"

RECONCILIATION = SavedQuery(
    name="reconciliation", title="Reconciliation actions",
    description="What agents did on their own to make their cluster match the federation's book, by cluster and "
                "reason: agent.* events, and attempts an agent stopped for a reason the scheduler did "
                "not order (e.g. orphaned, superseded).",
    sql="""
SELECT cluster, type, if(reason = '', '(none)', reason) AS reason, count() AS actions,
       uniqExact(job_id) AS jobs, min(occurred_at) AS first_at, max(occurred_at) AS last_at
FROM (
    SELECT cluster, type, job_id, occurred_at, JSONExtractString(payload, 'reason') AS reason
    FROM {{DB}}.events
    WHERE occurred_at >= {{FROM}} AND occurred_at < {{TO}}
      AND (startsWith(type, 'agent.')
           OR (type = 'job.stopped' AND startsWith(producer, 'agent/')
               AND JSONExtractString(payload, 'reason') NOT IN """ + _ORDERED + """))) AS a
GROUP BY cluster, type, reason
ORDER BY cluster, type, reason""")

_ATTEMPTS = """
    attempts AS (
        SELECT job_id, attempt, JSONExtractUInt(payload, 'shard') AS shard, any(cluster) AS cluster,
               anyIf(JSONExtractString(payload, 'card_model'), type = 'job.started') AS card_model,
               maxIf(JSONExtractUInt(payload, 'gpu_milli'), type = 'job.started') AS gpu_milli,
               minIf(occurred_at, type = 'job.started') AS started,
               if(countIf(type != 'job.started') > 0, minIf(occurred_at, type != 'job.started'), {{TO}}) AS ended
        FROM {{DB}}.events
        WHERE type IN ('job.started', 'job.finished', 'job.failed', 'job.stopped') AND occurred_at < {{TO}}
        GROUP BY job_id, attempt, shard
        HAVING countIf(type = 'job.started') > 0 AND ended > {{FROM}})"""

_CAPACITY = """
    capacity AS (
        SELECT cluster, card_model, argMax(gpus, at) AS gpus
        FROM {{DB}}.inventory
        WHERE at < {{TO}}
        GROUP BY cluster, card_model)"""

GPU_UTILISATION = SavedQuery(
    name="gpu_utilisation", title="GPU utilisation per cluster over time",
    description="Per cluster and time bucket: GPU-seconds of running attempts / (GPUs x bucket seconds).",
    shape="timeseries", x="time", y=("utilisation",), series="cluster", unit="ratio", sql="""
WITH %(bucket)s AS bucket_s,
    %(attempts)s,
    %(capacity)s,
    gpus AS (SELECT cluster, sum(gpus) AS gpus FROM capacity GROUP BY cluster HAVING gpus > 0),
    grid AS (
        SELECT cluster, k, {{FROM}} + toIntervalSecond(k * bucket_s) AS time
        FROM gpus ARRAY JOIN range(toUInt32(intDiv(dateDiff('millisecond', {{FROM}}, {{TO}}) + bucket_s * 1000 - 1,
                                                     bucket_s * 1000))) AS k),
    used AS (
        SELECT cluster, k, sum(gpu_milli / 1000 * greatest(0, dateDiff('millisecond',
                   greatest(started, {{FROM}} + toIntervalSecond(k * bucket_s)),
                   least(ended, {{FROM}} + toIntervalSecond((k + 1) * bucket_s), {{TO}})))) / 1000.0 AS gpu_seconds
        FROM attempts
        ARRAY JOIN range(toUInt32(intDiv(greatest(0, dateDiff('millisecond', {{FROM}}, started)), bucket_s * 1000)),
                         toUInt32(intDiv(greatest(0, dateDiff('millisecond', {{FROM}}, ended) - 1), bucket_s * 1000) + 1))
                   AS k
        GROUP BY cluster, k)
SELECT grid.time AS time, grid.cluster AS cluster,
       used.gpu_seconds / (gpus.gpus * dateDiff('millisecond', grid.time,
                                                least(grid.time + toIntervalSecond(bucket_s), {{TO}})) / 1000.0)
           AS utilisation
FROM grid
    INNER JOIN gpus ON grid.cluster = gpus.cluster
    LEFT JOIN used ON grid.cluster = used.cluster AND grid.k = used.k
ORDER BY time, cluster""" % {"bucket": _BUCKET, "attempts": _ATTEMPTS.strip(), "capacity": _CAPACITY.strip()})

QUEUE_LENGTH = SavedQuery(
    name="queue_length", title="Queue length over time",
    description="Per job kind and time bucket: the most jobs waiting at once (submitted or requeued, not yet "
                "started).",
    shape="timeseries", x="time", y=("waiting",), series="kind", unit="jobs", sql="""
WITH %(bucket)s AS bucket_s,
    kinds AS (
        SELECT job_id, any(JSONExtractString(payload, 'spec', 'kind')) AS kind
        FROM {{DB}}.events WHERE type = 'job.submitted' GROUP BY job_id),
    job_events AS (
        SELECT job_id, occurred_at AS t, type, JSONExtractString(payload, 'reason') AS reason,
               maxIf(occurred_at, type = 'job.started') OVER (PARTITION BY job_id) AS last_start,
               row_number() OVER (PARTITION BY job_id ORDER BY occurred_at, event_id) AS seq
        FROM {{DB}}.events
        WHERE type IN ('job.submitted', 'job.started', 'job.finished', 'job.failed', 'job.stopped', 'job.rejected',
                       'job.cancelled')
          AND occurred_at < {{TO}}),
    states AS (
        SELECT job_id, t, seq,
               multiIf(type = 'job.started', 0,
                       type IN ('job.finished', 'job.cancelled'), 0,
                       type = 'job.stopped' AND reason = 'cancelled', 0,
                       type = 'job.failed' AND t >= last_start, 0,
                       1) AS waiting
        FROM job_events),
    changes AS (
        SELECT job_id, t, waiting - lagInFrame(waiting, 1, 0) OVER (PARTITION BY job_id ORDER BY seq
                                                                     ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) AS d
        FROM states),
    deltas AS (
        SELECT kinds.kind AS kind, t, d FROM changes INNER JOIN kinds ON changes.job_id = kinds.job_id WHERE d != 0
        UNION ALL
        SELECT kind, {{FROM}} + toIntervalSecond(k * bucket_s) AS t, 0 AS d
        FROM (SELECT DISTINCT kind FROM kinds)
        ARRAY JOIN range(toUInt32(intDiv(dateDiff('millisecond', {{FROM}}, {{TO}}) + bucket_s * 1000 - 1,
                                         bucket_s * 1000))) AS k),
    running AS (
        SELECT kind, t, sum(d) OVER (PARTITION BY kind ORDER BY t, d ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW)
                   AS waiting
        FROM deltas)
SELECT {{FROM}} + toIntervalSecond(intDiv(dateDiff('millisecond', {{FROM}}, t), bucket_s * 1000) * bucket_s) AS time,
       kind,
       max(waiting) AS waiting
FROM running
WHERE t >= {{FROM}} AND t < {{TO}}
GROUP BY time, kind
ORDER BY time, kind""" % {"bucket": _BUCKET})

CAPACITY_HINTS = SavedQuery(
    name="capacity_hints", title="Capacity and expansion hints by card model",
    description="Per card model: GPUs, utilisation over the window, waits of jobs that started on it; 'expand' "
                "where p95 wait >= 600 s and utilisation >= 0.8.",
    shape="bar", x="card_model", y=("utilisation",), unit="ratio", sql="""
WITH 600 AS wait_threshold_s, 0.8 AS utilisation_threshold,
    %(attempts)s,
    %(capacity)s,
    models AS (SELECT card_model, sum(gpus) AS gpus FROM capacity GROUP BY card_model HAVING gpus > 0),
    used AS (
        SELECT card_model, sum(gpu_milli / 1000 * greatest(0, dateDiff('millisecond', greatest(started, {{FROM}}),
                                                                        least(ended, {{TO}})))) / 1000.0 AS gpu_seconds
        FROM attempts GROUP BY card_model),
    submitted AS (
        SELECT job_id, min(occurred_at) AS at FROM {{DB}}.events WHERE type = 'job.submitted'
        GROUP BY job_id HAVING at >= {{FROM}} AND at < {{TO}}),
    first_start AS (
        SELECT job_id, min(occurred_at) AS at, argMin(JSONExtractString(payload, 'card_model'), occurred_at) AS card_model
        FROM {{DB}}.events WHERE type = 'job.started' GROUP BY job_id),
    waits AS (
        SELECT first_start.card_model AS card_model, count() AS jobs,
               quantileExact(0.95)(dateDiff('millisecond', submitted.at, first_start.at) / 1000.0) AS p95_wait_s,
               countIf(dateDiff('millisecond', submitted.at, first_start.at) >= wait_threshold_s * 1000) AS long_waits
        FROM submitted INNER JOIN first_start ON submitted.job_id = first_start.job_id
        GROUP BY card_model)
SELECT models.card_model AS card_model, models.gpus AS gpus,
       used.gpu_seconds / (models.gpus * dateDiff('millisecond', {{FROM}}, {{TO}}) / 1000.0) AS utilisation,
       waits.jobs AS jobs_started, waits.p95_wait_s AS p95_wait_s, waits.long_waits AS long_waits,
       multiIf(p95_wait_s >= wait_threshold_s AND utilisation >= utilisation_threshold, 'expand',
               p95_wait_s >= wait_threshold_s, 'wait-bound',
               utilisation >= utilisation_threshold, 'busy', '') AS hint
FROM models
    LEFT JOIN used ON models.card_model = used.card_model
    LEFT JOIN waits ON models.card_model = waits.card_model
ORDER BY utilisation DESC, card_model""" % {"attempts": _ATTEMPTS.strip(), "capacity": _CAPACITY.strip()})

APPROVALS = SavedQuery(
    name="approvals", title="Who approved what",
    description="Every approval event (type approval.*) in the window: the actor, the decision, the job, the "
                "proposed placement and the policy version in force.",
    sql="""
SELECT occurred_at AS at, type, replaceOne(type, 'approval.', '') AS decision, actor, tenant, project, job_id,
       attempt, region, cluster, policy_version, JSONExtractString(payload, 'reason') AS reason
FROM {{DB}}.events
WHERE startsWith(type, 'approval.') AND occurred_at >= {{FROM}} AND occurred_at < {{TO}}
ORDER BY at, event_id""")

CHARGEBACK = SavedQuery(
    name="chargeback", title="Monthly chargeback",
    description="Usage lines ended in the window by month x tenant x project x region x card model: GPU-hours, "
                "compute and transfer cost, cost of interrupted attempts, share of the month and of the tenant.",
    shape="bar", x="tenant", y=("cost",), unit="currency", sql="""
SELECT month, tenant, project, region, card_model, gpu_hours, compute_cost, transfer_cost, interrupted_cost, cost,
       toFloat64(cost) / sum(toFloat64(cost)) OVER (PARTITION BY month) AS share_of_month,
       toFloat64(cost) / sum(toFloat64(cost)) OVER (PARTITION BY month, tenant) AS share_of_tenant, currency
FROM (
    SELECT formatDateTime(u.ended_at, '%Y-%m') AS month, u.tenant AS tenant, u.project AS project,
           u.region AS region, u.card_model AS card_model, sum(u.gpu_seconds) / 3600 AS gpu_hours,
           sumIf(u.cost, u.line = 'compute') AS compute_cost, sumIf(u.cost, u.line = 'transfer') AS transfer_cost,
           sumIf(u.cost, u.flag != '') AS interrupted_cost, sum(u.cost) AS cost, any(u.currency) AS currency
    FROM {{DB}}.usage AS u
    WHERE u.ended_at >= {{FROM}} AND u.ended_at < {{TO}}
    GROUP BY month, tenant, project, region, card_model)
ORDER BY month, cost DESC, tenant, project, region, card_model""")

SUMMARY = SavedQuery(
    name="summary", title="Summary",
    description="Headline figures for the window: jobs, submit-to-start p50 / p95 (s), audit events, GPU-hours, "
                "cost and its transfer part.",
    sql="""
WITH (
        SELECT tuple(quantileExact(0.5)(w), quantileExact(0.95)(w)) FROM (
            SELECT dateDiff('millisecond', s.at, r.at) / 1000.0 AS w
            FROM (SELECT job_id, min(occurred_at) AS at FROM {{DB}}.events WHERE type = 'job.submitted'
                  GROUP BY job_id HAVING at >= {{FROM}} AND at < {{TO}}) AS s
            INNER JOIN (SELECT job_id, min(occurred_at) AS at FROM {{DB}}.events WHERE type = 'job.started'
                        GROUP BY job_id) AS r ON s.job_id = r.job_id)) AS waits
SELECT
    (SELECT uniqExact(job_id) FROM {{DB}}.events
     WHERE type = 'job.submitted' AND occurred_at >= {{FROM}} AND occurred_at < {{TO}}) AS jobs_submitted,
    (SELECT count() FROM {{DB}}.events
     WHERE type = 'submission.rejected' AND occurred_at >= {{FROM}} AND occurred_at < {{TO}}) AS submissions_refused,
    (SELECT uniqExact(job_id) FROM {{DB}}.events
     WHERE type = 'job.started' AND occurred_at >= {{FROM}} AND occurred_at < {{TO}}) AS jobs_started,
    waits.1 AS wait_p50_s, waits.2 AS wait_p95_s,
    (SELECT count() FROM {{DB}}.events WHERE occurred_at >= {{FROM}} AND occurred_at < {{TO}}) AS audit_events,
    (SELECT sum(gpu_seconds) / 3600 FROM {{DB}}.usage WHERE ended_at >= {{FROM}} AND ended_at < {{TO}}) AS gpu_hours,
    (SELECT sum(cost) FROM {{DB}}.usage WHERE ended_at >= {{FROM}} AND ended_at < {{TO}}) AS total_cost,
    (SELECT sumIf(cost, line = 'transfer') FROM {{DB}}.usage
     WHERE ended_at >= {{FROM}} AND ended_at < {{TO}}) AS transfer_cost,
    (SELECT any(currency) FROM {{DB}}.usage) AS currency""")

#: Every report, in the order ``fedsched report`` prints them.
REPORTS: tuple[SavedQuery, ...] = (
    SUMMARY, _waits("region"), _waits("kind"), _waits("tenant"), CROSS_REGION, TRANSFER, FAILURES,
    GPU_UTILISATION, QUEUE_LENGTH, CAPACITY_HINTS, CHARGEBACK, APPROVALS, FAILOVERS, RECONCILIATION,
)

BY_NAME = {q.name: q for q in REPORTS}


Target = Literal["clickhouse", "grafana"]


def render(query: SavedQuery, *, database: str, target: Target = "clickhouse") -> str:
    """The query's SQL for ``target``.

    ``clickhouse``: the window and bucket are query parameters ``{from:DateTime64(3, 'UTC')}``,
    ``{to:...}``, ``{bucket:UInt32}`` (pass them with :func:`fedapp.reports.run`).
    ``grafana``: the ClickHouse data source's macros and the dashboard's ``${database}``.
    """
    if target == "grafana":
        subs = {"{{DB}}": "${database}", "{{FROM}}": "$__fromTime_ms", "{{TO}}": "$__toTime_ms",
                "{{BUCKET}}": "$__interval_s"}
    else:
        subs = {"{{DB}}": database, "{{FROM}}": "{from:DateTime64(3, 'UTC')}", "{{TO}}": "{to:DateTime64(3, 'UTC')}",
                "{{BUCKET}}": "{bucket:UInt32}"}
    sql = query.sql.strip()
    for k, v in subs.items():
        sql = sql.replace(k, v)
    return sql
