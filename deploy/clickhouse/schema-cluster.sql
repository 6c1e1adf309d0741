CREATE DATABASE IF NOT EXISTS fedsched ON CLUSTER fedsched;

-- migration 0001_init

CREATE TABLE IF NOT EXISTS fedsched.events_local ON CLUSTER fedsched
(
    event_id        String,
    type            LowCardinality(String),
    schema_version  UInt16,
    occurred_at     DateTime64(3, 'UTC'),
    ingested_at     DateTime64(3, 'UTC') DEFAULT now64(3),
    producer        LowCardinality(String),
    actor           LowCardinality(String),
    region          LowCardinality(String),
    zone            LowCardinality(String),
    cluster         LowCardinality(String),
    tenant          LowCardinality(String),
    project         LowCardinality(String),
    job_id          String,
    attempt         UInt32,
    policy_version  LowCardinality(String),
    trace_id        String,
    subject         String,
    payload         String CODEC(ZSTD(3)),
    INDEX idx_event_id event_id TYPE bloom_filter GRANULARITY 4,
    INDEX idx_job_id job_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/fedsched/{uuid}', '{replica}', ingested_at)
PARTITION BY toYYYYMM(occurred_at)
ORDER BY (type, occurred_at, event_id);

CREATE TABLE IF NOT EXISTS fedsched.events ON CLUSTER fedsched AS fedsched.events_local
ENGINE = Distributed(fedsched, fedsched, events_local, cityHash64(event_id));

CREATE TABLE IF NOT EXISTS fedsched.usage_local ON CLUSTER fedsched
(
    usage_id        String,
    job_id          String,
    attempt         UInt32,
    shard           UInt32,
    tenant          LowCardinality(String),
    project         LowCardinality(String),
    region          LowCardinality(String),
    zone            LowCardinality(String),
    cluster         LowCardinality(String),
    card_model      LowCardinality(String),
    kind            LowCardinality(String),
    outcome         LowCardinality(String),
    cross_region    UInt8,
    started_at      DateTime64(3, 'UTC'),
    ended_at        DateTime64(3, 'UTC'),
    gpu_milli       UInt32,
    gpu_seconds     Float64,
    unit_price      Decimal(18, 6),
    price_version   LowCardinality(String),
    cost            Decimal(18, 6),
    currency        LowCardinality(String),
    ingested_at     DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_usage_id usage_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/fedsched/{uuid}', '{replica}', ingested_at)
PARTITION BY toYYYYMM(ended_at)
ORDER BY (tenant, project, region, card_model, ended_at, usage_id);

CREATE TABLE IF NOT EXISTS fedsched.usage ON CLUSTER fedsched AS fedsched.usage_local
ENGINE = Distributed(fedsched, fedsched, usage_local, cityHash64(usage_id));

CREATE TABLE IF NOT EXISTS fedsched.decisions_local ON CLUSTER fedsched
(
    event_id        String,
    decided_at      DateTime64(3, 'UTC'),
    job_id          String,
    attempt         UInt32,
    tenant          LowCardinality(String),
    project         LowCardinality(String),
    outcome         LowCardinality(String),
    region          LowCardinality(String),
    cluster         LowCardinality(String),
    reason          String,
    fits_empty      UInt8,
    cross_region    UInt8,
    score           Float64,
    policy_version  LowCardinality(String),
    detail          String CODEC(ZSTD(3)),
    ingested_at     DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_event_id event_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/fedsched/{uuid}', '{replica}', ingested_at)
PARTITION BY toYYYYMM(decided_at)
ORDER BY (tenant, job_id, decided_at, event_id);

CREATE TABLE IF NOT EXISTS fedsched.decisions ON CLUSTER fedsched AS fedsched.decisions_local
ENGINE = Distributed(fedsched, fedsched, decisions_local, cityHash64(event_id));

CREATE TABLE IF NOT EXISTS fedsched.inventory_local ON CLUSTER fedsched
(
    event_id        String,
    at              DateTime64(3, 'UTC'),
    region          LowCardinality(String),
    zone            LowCardinality(String),
    cluster         LowCardinality(String),
    card_model      LowCardinality(String),
    nodes           UInt32,
    healthy_nodes   UInt32,
    gpus            UInt32,
    gpu_milli_free  UInt64,
    whole_gpus_free UInt32,
    cpu_milli_free  UInt64,
    memory_mib_free UInt64,
    ingested_at     DateTime64(3, 'UTC') DEFAULT now64(3),
    INDEX idx_event_id event_id TYPE bloom_filter GRANULARITY 4
)
ENGINE = ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/fedsched/{uuid}', '{replica}', ingested_at)
PARTITION BY toYYYYMM(at)
ORDER BY (region, cluster, card_model, at, event_id);

CREATE TABLE IF NOT EXISTS fedsched.inventory ON CLUSTER fedsched AS fedsched.inventory_local
ENGINE = Distributed(fedsched, fedsched, inventory_local, cityHash64(event_id));

-- migration 0002_billing_lines_dedup

ALTER TABLE fedsched.usage_local ON CLUSTER fedsched
    ADD COLUMN IF NOT EXISTS line LowCardinality(String) DEFAULT 'compute' AFTER usage_id,
    ADD COLUMN IF NOT EXISTS transfer_bytes UInt64 DEFAULT 0 AFTER gpu_seconds,
    ADD COLUMN IF NOT EXISTS flag LowCardinality(String) DEFAULT '' AFTER outcome;

ALTER TABLE fedsched.usage ON CLUSTER fedsched
    ADD COLUMN IF NOT EXISTS line LowCardinality(String) DEFAULT 'compute' AFTER usage_id,
    ADD COLUMN IF NOT EXISTS transfer_bytes UInt64 DEFAULT 0 AFTER gpu_seconds,
    ADD COLUMN IF NOT EXISTS flag LowCardinality(String) DEFAULT '' AFTER outcome;
