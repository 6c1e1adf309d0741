-- fedsched schema v2: billing lines (compute and transfer), interruption flags, engine-side dedup.
--
-- usage.line: 'compute' (one row per ended attempt interval, as in v1) or 'transfer' (the egress
--   of one placement that moved data between regions; usage_id = the job.placed event id).
-- usage.transfer_bytes: bytes moved (transfer lines; 0 otherwise).
-- usage.flag: '' for a finished attempt, else why it did not finish: 'failed', 'preempted',
--   'reclaimed', 'cancelled' (the attempt is billed all the same, and flagged).
-- Rows written before v2 read as line = 'compute', transfer_bytes = 0, flag = ''.
ALTER TABLE {db}.usage
    ADD COLUMN IF NOT EXISTS line LowCardinality(String) DEFAULT 'compute' AFTER usage_id,
    ADD COLUMN IF NOT EXISTS transfer_bytes UInt64 DEFAULT 0 AFTER gpu_seconds,
    ADD COLUMN IF NOT EXISTS flag LowCardinality(String) DEFAULT '' AFTER outcome;

-- Engine-side deduplication of retried inserts. Writers look up existing keys first (exact with
-- one writer per table) and send each insert with insert_deduplication_token = hash of the keys
-- it writes: a retry of an insert that did commit (a timeout after the commit, a crash between
-- commit and acknowledgement followed by a concurrent redelivery) is then dropped by the engine.
-- Replicated tables deduplicate inserts by default; non-replicated MergeTree needs this window.
ALTER TABLE {db}.events MODIFY SETTING non_replicated_deduplication_window = 10000;
ALTER TABLE {db}.usage MODIFY SETTING non_replicated_deduplication_window = 10000;
ALTER TABLE {db}.decisions MODIFY SETTING non_replicated_deduplication_window = 10000;
ALTER TABLE {db}.inventory MODIFY SETTING non_replicated_deduplication_window = 10000;
