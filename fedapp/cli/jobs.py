"""CLI commands over the gRPC job API: submit, jobs, job, cancel, watch, logs.

Every command talks to admission at ``--server`` (``FEDSCHED_GRPC_ADDRESS``, the variable the
server listens on too; the old ``FEDSCHED_GRPC`` still works with a warning; default
``127.0.0.1:50051``) as the principal whose token it sends: ``--token``, else
``FEDSCHED_TOKEN``, else the embedded system's bootstrap admin token in
``<FEDSCHED_DATA_DIR or .fedsched>/admin.token``. TLS: ``FEDSCHED_TLS_CA`` (the CA that signed
the server), and for mTLS ``FEDSCHED_TLS_CLIENT_CERT`` / ``FEDSCHED_TLS_CLIENT_KEY``. Output is
a table, or JSON with ``--output json``.

``submit -f FILE`` reads job files (:mod:`fedapp.cli.jobfile`); a list goes through
``SubmitJobs``. ``jobs`` pages newest first through ``ListJobs`` with repeatable filters
(``--watch [SECONDS]`` takes an optional value: :func:`with_optional_values`, applied by
:func:`fedapp.cli.root.main`).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterator, Optional

import grpc
import typer
from rich import box
from rich.table import Table

from fedsched import telemetry
from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedsched.tenancy import LimitsDoc
from fedapp.client import TlsClient, call_metadata, resolve_token, sync_channel
from fedapp.cli.jobfile import MAX_FILE_CHARS, JobFileError, parse_job_file
from fedsched.yamltext import read_bounded
from fedapp.cli.text import Output, clip as _clip, console, err, error_line, printable, safe, styled
from fedapp.cli.wire import enum_number, enum_word, enum_words, message_dict


#: The one environment variable naming admission's gRPC address, on both sides: ``fedsched up`` /
#: ``service admission`` listen on it (``--grpc-address``), every API command connects to it.
GRPC_ENV = "FEDSCHED_GRPC_ADDRESS"
#: The client's old name for it: still read, with a deprecation warning (:func:`server_address`).
GRPC_ENV_DEPRECATED = "FEDSCHED_GRPC"
DEFAULT_SERVER = "127.0.0.1:50051"


def server_address(value: str | None) -> str:
    """``--server`` resolved: the flag, else ``FEDSCHED_GRPC_ADDRESS``, else the deprecated
    ``FEDSCHED_GRPC`` (with a warning on stderr), else ``127.0.0.1:50051``. A listen address
    on all interfaces (``0.0.0.0:P``, what a server's FEDSCHED_GRPC_ADDRESS often says) is
    reached on loopback."""
    if not value:
        value = os.environ.get(GRPC_ENV, "")
    if not value and os.environ.get(GRPC_ENV_DEPRECATED):
        value = os.environ[GRPC_ENV_DEPRECATED]
        err.print(styled(("warning:", "yellow"), f" {GRPC_ENV_DEPRECATED} is deprecated; set {GRPC_ENV} "
                                                 f"(the name the server uses too)"))
    value = value or DEFAULT_SERVER
    host, sep, port = value.rpartition(":")
    return f"127.0.0.1:{port}" if sep and host in ("0.0.0.0", "[::]", "::") else value


SERVER = typer.Option("", "--server", show_default=False, callback=lambda v: server_address(v),
                      help=f"Admission gRPC address, host:port (default: {GRPC_ENV}, else {DEFAULT_SERVER}).")
OUTPUT = typer.Option(Output.table, "--output", "-o", help="table (for people) or json (for scripts)")
TOKEN = typer.Option("", "--token", envvar="FEDSCHED_TOKEN", show_default=False,
                     help="Bearer token (default: FEDSCHED_TOKEN, else <FEDSCHED_DATA_DIR or .fedsched>/admin.token).")

KINDS = {"training": pb.JOB_KIND_TRAINING, "fine_tune": pb.JOB_KIND_FINE_TUNE, "inference": pb.JOB_KIND_INFERENCE,
         "batch": pb.JOB_KIND_BATCH, "evaluation": pb.JOB_KIND_EVALUATION, "experiment": pb.JOB_KIND_EXPERIMENT}
PRIORITIES = {"critical": pb.PRIORITY_CLASS_CRITICAL, "high": pb.PRIORITY_CLASS_HIGH,
              "normal": pb.PRIORITY_CLASS_NORMAL, "low": pb.PRIORITY_CLASS_LOW,
              "best_effort": pb.PRIORITY_CLASS_BEST_EFFORT}
LOCALITIES = {"must_local": pb.LOCALITY_MUST_LOCAL, "prefer_local": pb.LOCALITY_PREFER_LOCAL,
              "global": pb.LOCALITY_GLOBAL}


U32, U64 = 2**32 - 1, 2**64 - 1  #: the wire's unsigned field ranges (admission enforces the real limits)
_LIMITS = LimitsDoc()  #: admission's default limits (a policy may change them): what --help states


def _wire(lo, hi):
    """A typer callback refusing values outside ``lo..hi`` (the wire's range, exit 2 naming the
    flag) without printing that range in --help: the help states the server's real limits,
    which the policy sets and admission enforces."""
    def check(value):
        if value is not None and not lo <= value <= hi:
            raise typer.BadParameter(f"{value} is out of range (admission's limits are in --help)")
        return value
    return check


def tls_from_env() -> TlsClient | None:
    """Client TLS from ``FEDSCHED_TLS_CA`` / ``FEDSCHED_TLS_CLIENT_CERT`` / ``FEDSCHED_TLS_CLIENT_KEY``."""
    ca, cert, key = (os.environ.get(f"FEDSCHED_TLS_{n}") or None for n in ("CA", "CLIENT_CERT", "CLIENT_KEY"))
    if not (ca or cert or key):
        return None
    return TlsClient(Path(ca) if ca else None, Path(cert) if cert else None, Path(key) if key else None)


class Api:
    """One connection to admission with the caller's token (use as a context manager).

    Every call of one command carries the same new root trace (``traceparent`` metadata), so
    what the command caused -- a ``job.submitted``, a ``policy.applied`` -- is in its trace in
    the audit log.
    """

    def __init__(self, server: str, token: str = "") -> None:
        self.server = server
        self.channel = sync_channel(server, tls=tls_from_env())
        with telemetry.root_span("cli"):
            self.trace = telemetry.inject_headers()
        self.metadata = call_metadata(resolve_token(token)) + tuple(self.trace.items())

    def __enter__(self) -> "Api":
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()

    def call(self, fn, request, timeout: float = 30):
        """Call ``fn(request)`` with the token; print the status and exit 1 on an RPC error."""
        try:
            return fn(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            fail_rpc(e)

    def call_with_metadata(self, fn, request, timeout: float = 30):
        """Like :meth:`call`, also returning the response's metadata: the trailing metadata,
        where admission sends ``x-trace-id`` (issue 15), then the initial metadata, where
        older servers sent it (``dict()`` of the result: the trailing one wins)."""
        try:
            resp, call = fn.with_call(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            fail_rpc(e)
        return resp, tuple(call.initial_metadata() or ()) + tuple(call.trailing_metadata() or ())

    def stream(self, fn, request):
        """Iterate a server stream with the token."""
        return fn(request, metadata=self.metadata)


def fail_rpc(e: grpc.RpcError) -> None:
    """Print an RPC error for people and exit 1."""
    code = e.code()
    hint = ""
    if code == grpc.StatusCode.UNAVAILABLE:
        hint = f" (is `fedsched up` running? pass --server or {GRPC_ENV})"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        hint = " (pass --token or FEDSCHED_TOKEN, or set FEDSCHED_DATA_DIR to the data dir holding admin.token)"
    err.print(error_line(f"{code.name}:", f"{e.details()}{hint}"))
    raise typer.Exit(1) from None


def _state(s: int) -> str:
    """A job state as tables, filters and JSON output spell it (``queued``): :mod:`fedapp.cli.wire`."""
    return enum_word(pb.JobState.DESCRIPTOR, s)


def _ts(ts) -> str:
    return ts.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if ts.seconds else ""


#: attempt outcomes that end an attempt on the scheduler's order or the job's own course;
#: any other ended outcome's reason (e.g. ``orphaned``, ``superseded``) is an agent's own
#: reconciliation action
_ORDERED_STOPS = ("cancelled", "preempted", "reclaimed", "cluster_lost")
_OPEN = ("placed", "running", "stopping")


def attempt_history(job: pb.Job) -> list[str]:
    """The story of a job's attempts that did not simply run to their end, one line each, for
    people (``fedsched explain``): lost attempts and where the shard moved (a failover), and
    other interrupted attempts with their reason and next attempt; stops that no scheduler order
    explains are shown as the agent's reconciliation. Empty for a job with one attempt that is
    open or succeeded. Times are UTC as in ``fedsched job``.
    """
    lines = []
    by_key = {(a.shard, a.attempt): a for a in job.attempts}
    shards = len({a.shard for a in job.attempts}) > 1
    for a in sorted(job.attempts, key=lambda a: (a.shard, a.attempt)):
        if a.outcome in _OPEN or a.outcome == "succeeded":
            continue
        where = f"shard {a.shard} " if shards else ""
        nxt = by_key.get((a.shard, a.attempt + 1))
        moved = (f"; moved to {nxt.cluster} as attempt {nxt.attempt} ({nxt.outcome})" if nxt is not None
                 else "; no later attempt")
        at = _ts(a.ended_at) or "?"
        if a.outcome == "lost":
            lines.append(f"failover: {where}attempt {a.attempt} lost on {a.cluster} at {at} "
                         f"({safe(a.reason) or 'cluster_lost'}){moved}")
        elif a.outcome == "stopped" and a.reason.split(" ", 1)[0] not in _ORDERED_STOPS:
            lines.append(f"reconciled: {where}attempt {a.attempt} on {a.cluster} stopped by its agent at {at} "
                         f"({safe(a.reason) or 'no reason given'}){moved}")
        else:
            lines.append(f"{a.outcome}: {where}attempt {a.attempt} on {a.cluster or '-'} at {at}"
                         f"{' (' + safe(a.reason) + ')' if a.reason else ''}{moved}")
    return lines


def _attempts_cell(job: pb.Job) -> str:
    """Attempt outcomes of a job in the jobs table, e.g. ``lost, running`` (the last 4)."""
    shown = [a.outcome for a in job.attempts[-4:]]
    return ("..., " if len(job.attempts) > 4 else "") + ", ".join(shown) if shown else "-"


def _jobs_table(jobs, width: int | None = None) -> Table:
    """The jobs table, fitted to the terminal (``width``, default the console's: the terminal's,
    ``COLUMNS``, or :data:`~fedapp.cli.text.PIPE_WIDTH` in a pipe). Job ids and states are never
    cut; names and reasons end in an ellipsis when cut; the reason takes what the other columns
    leave (at least 12 characters). Below 150 columns names show at most 20 characters and times
    drop the year and seconds (times are UTC, as the headers say); when the columns still do not fit, ``attempts``, ``ended``,
    ``submitted``, ``where`` and ``tenant/project`` are left out, in that order. Text from the
    server is shown with control characters escaped (:func:`~fedapp.cli.text.printable`)."""
    width = width or console.width
    short = width < 150
    when = (lambda ts: _ts(ts)[5:16]) if short else _ts
    any_ended = any(j.ended_at.seconds for j in jobs)

    def gpus(s) -> str:
        return f"{s.workers}x{s.gpus_per_worker}" if s.gpu_milli in (0, 1000) else f"{s.workers}x{s.gpu_milli}m"

    # (header, cell of a job, rich column options, drop rank: 0 = always shown)
    columns = [
        ("job", lambda j: j.job_id, dict(no_wrap=True), 0),  # ids are copied from here: never cut them
        ("tenant/project", lambda j: f"{j.spec.tenant}/{j.spec.project}", dict(overflow="fold"), 5),
        ("name", lambda j: j.spec.name or "-", dict(overflow="ellipsis", no_wrap=True), 0),
        ("state", lambda j: _state(j.state), dict(no_wrap=True), 0),  # one word: never split
        ("where", lambda j: j.cluster or "-", dict(overflow="fold"), 4),
        ("GPUs", lambda j: gpus(j.spec), dict(no_wrap=True), 0),
        ("attempts", _attempts_cell, dict(overflow="fold"), 1),
        ("submitted UTC", lambda j: when(j.submitted_at), dict(no_wrap=True), 3),
    ] + ([("ended UTC", lambda j: when(j.ended_at), dict(no_wrap=True), 2)] if any_ended else [])
    cells = [[printable(cell(j)) for _, cell, _, _ in columns] for j in jobs]
    need = [max([len(h)] + [len(row[i].plain) for row in cells]) for i, (h, _, _, _) in enumerate(columns)]
    name_at = [h for h, *_ in columns].index("name")
    if short:
        need[name_at] = min(need[name_at], 20)
    boxed = width >= 100
    # below 100 columns a borderless table (its borders alone would take a tenth of the width)
    per_column = 3 if boxed else 2
    keep = list(range(len(columns)))
    reason_min = 12

    def others() -> int:
        return sum(need[i] + per_column for i in keep) + per_column + 1

    for rank in (1, 2, 3, 4, 5):
        if others() + reason_min <= width:
            break
        keep = [i for i in keep if columns[i][3] != rank]
    table = Table() if boxed else Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for i in keep:
        header, _, options, _ = columns[i]
        table.add_column(header, min_width=min(need[i], 20) if i == name_at else need[i],
                         max_width=20 if (i == name_at and short) else None, **options)
    table.add_column("reason", overflow="ellipsis", no_wrap=True, max_width=max(reason_min, width - others()),
                     min_width=6)
    for j, row in zip(jobs, cells):
        reason = ("can never run as asked: " if j.unplaceable else "") + j.reason
        table.add_row(*(row[i] for i in keep), printable(reason or "-"))
    return table


def _write_json(value) -> None:
    """Indented JSON straight to stdout (rich's print_json takes seconds per MiB: a listing of
    every page may be many MiB)."""
    sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _print_jobs(jobs, output: str) -> None:
    if output == "json":
        _write_json([message_dict(j) for j in jobs])
        return
    console.print(_jobs_table(jobs))


def submit(
    file: Optional[str] = typer.Option(None, "--file", "-f", show_default=False,
                                       help="Job file, YAML or JSON: one job mapping or a list of them, keys = the "
                                            "proto's JobSpec field names (every field, e.g. datasets, "
                                            "allowed_regions, start_deadline, workload) plus request_id; - = stdin. "
                                            "Flags given too override the file's values in every job."),
    tenant: Optional[str] = typer.Option(None, "--tenant", help="Tenant (see `fedsched tenants`); required without -f."),
    project: Optional[str] = typer.Option(None, "--project", help="Project of the tenant; required without -f."),
    kind: Optional[str] = typer.Option(None, "--kind", help=", ".join(KINDS) + " (default batch)"),
    workers: Optional[int] = typer.Option(None, "--workers", callback=_wire(1, U32), help="Gang size (all workers "
                                          "start together in one cluster; default 1): 1 to the policy's max_workers "
                                          f"(default {_LIMITS.max_workers})."),
    gpus: Optional[int] = typer.Option(None, "--gpus", callback=_wire(0, U32), help="Whole GPUs per worker, 0 "
                                       "(CPU-only) to the policy's max_gpus_per_worker (default "
                                       f"{_LIMITS.max_gpus_per_worker}); default 1."),
    gpu_milli: Optional[int] = typer.Option(None, "--gpu-milli", min=1, max=1000,
                                            help="Share of one GPU in milli-GPU (with --gpus 1; 1000 = a whole card)."),
    cpu_milli: Optional[int] = typer.Option(None, "--cpu-milli", callback=_wire(0, U64), help="CPU per worker, "
                                            "milli-cores: 0 to the policy's max_cpu_milli (default "
                                            f"{_LIMITS.max_cpu_milli})."),
    memory_mib: Optional[int] = typer.Option(None, "--memory-mib", callback=_wire(0, U64), help="Memory per worker, "
                                             "MiB: 0 to the policy's max_memory_mib (default "
                                             f"{_LIMITS.max_memory_mib})."),
    card_model: list[str] = typer.Option([], "--card-model", help="Allowed card model (repeatable; aliases ok)."),
    home_region: Optional[str] = typer.Option(None, "--home-region", help="Default: the tenant's home region."),
    locality: Optional[str] = typer.Option(None, "--locality", help=", ".join(LOCALITIES) + " (default global)"),
    priority: Optional[str] = typer.Option(None, "--priority", help=", ".join(PRIORITIES) + " (default normal)"),
    duration: Optional[float] = typer.Option(None, "--duration", callback=_wire(0.0, float("inf")),
                                             help="Your runtime estimate, seconds, 0 to the policy's max_duration_s "
                                                  f"(default {_LIMITS.max_duration_s:.0f}) (trace agents run the job "
                                                  "this long; 0 = unknown: it runs until cancelled)."),
    name: Optional[str] = typer.Option(None, "--name", help="A label for the job."),
    request_id: str = typer.Option("", "--request-id", help="Idempotency key (yours, per tenant and project): the "
                                                        "same spec again returns the same job; another spec is "
                                                        "ALREADY_EXISTS. With a file of several jobs: used as a "
                                                        "prefix, KEY-0, KEY-1, ... for jobs without their own."),
    image: str = typer.Option("", "--image", help="OCI image each worker runs (gives the job a workload; "
                                                   "trace agents ignore it)."),
    command: list[str] = typer.Option([], "--command", help="One argv item, no shell (repeatable: --command python "
                                                            "--command train.py); or put the argv after `--`."),
    env: list[str] = typer.Option([], "--env", help="K=V plain environment variable (repeatable)."),
    secret_env: list[str] = typer.Option([], "--secret-env", help="K=secret-name/key: the variable K gets the "
                                                                  "secret's value on the cluster (repeatable; "
                                                                  "the reference, never the value, is sent)."),
    workdir: str = typer.Option("", "--workdir", help="Absolute working directory of the workload."),
    checkpoint: str = typer.Option("", "--checkpoint", help="Checkpoint URI the job resumes from (s3://..., "
                                                            "file:///...); workers see FEDSCHED_CHECKPOINT_URI."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and govern on the server without queuing: "
                                                          "print the verdict and the scheduler's what-if."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Also print the submit's trace id and how to find "
                                                                "its events."),
    argv: Optional[list[str]] = typer.Argument(None, metavar="[-- ARGV...]", show_default=False,
                                               help="The workload's argv after `--` (its args if --command is "
                                                    "given, else its command)."),
    server: str = SERVER,
    output: Output = OUTPUT,
    token: str = TOKEN,
):
    """Submit a job from flags, or jobs from a file (-f); with --image, a workload that real
    backends run. Exit 0 when every job was accepted, 1 when any was refused."""
    for value, table, flag in ((kind, KINDS, "--kind"), (priority, PRIORITIES, "--priority"),
                               (locality, LOCALITIES, "--locality")):
        if value is not None and value not in table:
            err.print(error_line(flag, f"must be one of {', '.join(table)}"))
            raise typer.Exit(2)
    flags = pb.JobSpec()
    given: list[str] = []  # JobSpec fields the flags set (they override the file's)

    def put(field: str, value) -> None:
        if value is None:
            return
        if isinstance(value, list):
            getattr(flags, field).extend(value)
        else:
            setattr(flags, field, value)
        given.append(field)

    put("tenant", tenant)
    put("project", project)
    put("name", name)
    put("kind", KINDS[kind] if kind is not None else None)
    put("priority", PRIORITIES[priority] if priority is not None else None)
    put("locality", LOCALITIES[locality] if locality is not None else None)
    put("workers", workers)
    put("gpus_per_worker", gpus)
    put("gpu_milli", gpu_milli)
    put("cpu_milli", cpu_milli)
    put("memory_mib", memory_mib)
    put("card_models", card_model or None)
    put("home_region", home_region)
    put("estimated_duration_seconds", duration)
    if duration:
        flags.annotations["trace.runtime_s"] = str(duration)
    workload = _workload_flags(image, command, argv or [], env, secret_env, workdir, checkpoint, need_image=file is None)
    if file is None:
        if tenant is None or project is None:
            err.print(error_line("--tenant/--project", "required (or give a job file with -f)"))
            raise typer.Exit(2)
        defaults = pb.JobSpec(kind=KINDS["batch"], priority=PRIORITIES["normal"], locality=LOCALITIES["global"],
                              workers=1, gpus_per_worker=1)
        defaults.MergeFrom(flags)
        if workload is not None:
            defaults.workload.CopyFrom(workload)
        many, requests = False, [pb.SubmitJobRequest(spec=defaults, request_id=request_id)]
    else:
        many, requests = _read_job_file(file)
        for i, r in enumerate(requests):
            _override(r.spec, flags, given, workload)
            if request_id and not r.request_id:
                r.request_id = f"{request_id}-{i}" if many else request_id
    for r in requests:
        r.dry_run = dry_run
    with Api(server, token) as api:
        stub = pb_grpc.JobServiceStub(api.channel)
        if not many:
            resp, metadata = api.call_with_metadata(stub.SubmitJob, requests[0])
            _print_submitted([(requests[0], pb.SubmitJobsResult(response=resp))], output, dry_run, verbose,
                             resp.trace_id or dict(metadata).get("x-trace-id", ""))
            if dry_run and not resp.verdict.startswith(ACCEPTED_VERDICTS):
                raise typer.Exit(1)
            return
        results: list[pb.SubmitJobsResult] = []
        trace_id = ""
        for chunk in _chunks(requests):
            resp, metadata = api.call_with_metadata(stub.SubmitJobs, pb.SubmitJobsRequest(items=chunk), timeout=120)
            results.extend(resp.results)
            trace_id = trace_id or dict(metadata).get("x-trace-id", "")
    _print_submitted(list(zip(requests, results)), output, dry_run, verbose, trace_id)
    if any(r.code or (dry_run and not r.response.verdict.startswith(ACCEPTED_VERDICTS)) for r in results):
        raise typer.Exit(1)


#: Dry-run verdicts of a submit that would be taken (anything else is the error it would get).
ACCEPTED_VERDICTS = ("accepted", "awaiting_approval", "duplicate")

#: Items per SubmitJobs call (the server's limit).
SUBMIT_BATCH = 1000
#: Encoded bytes per SubmitJobs call (admission takes requests up to 4 MiB by default).
SUBMIT_BATCH_BYTES = 3 * 1024 * 1024


def _chunks(requests: list[pb.SubmitJobRequest]) -> Iterator[list[pb.SubmitJobRequest]]:
    """``requests`` in file order, as SubmitJobs calls of at most :data:`SUBMIT_BATCH` items and
    :data:`SUBMIT_BATCH_BYTES` encoded bytes (a single larger item goes alone: admission then
    answers for it)."""
    chunk: list[pb.SubmitJobRequest] = []
    size = 0
    for r in requests:
        n = r.ByteSize() + 8
        if chunk and (len(chunk) == SUBMIT_BATCH or size + n > SUBMIT_BATCH_BYTES):
            yield chunk
            chunk, size = [], 0
        chunk.append(r)
        size += n
    if chunk:
        yield chunk


def _read_job_file(file: str) -> tuple[bool, list[pb.SubmitJobRequest]]:
    """The requests of job file ``file`` (``-`` = stdin); exit 2 naming the problem."""
    try:
        if file == "-":
            text = read_bounded(sys.stdin, MAX_FILE_CHARS)
        else:
            with open(file, encoding="utf-8") as f:
                text = read_bounded(f, MAX_FILE_CHARS)
    except (OSError, UnicodeDecodeError) as e:
        err.print(error_line("--file", f"cannot read {file}: {e}"))
        raise typer.Exit(2) from None
    if text is None:  # (read only that far: /dev/zero or `yes |` cannot fill the memory)
        err.print(error_line("--file", f"{file} is larger than {MAX_FILE_CHARS} characters"))
        raise typer.Exit(2)
    try:
        return parse_job_file(text, "stdin" if file == "-" else file)
    except JobFileError as e:
        err.print(error_line("error:", str(e)))
        raise typer.Exit(2) from None


def _override(spec: pb.JobSpec, flags: pb.JobSpec, given: list[str], workload: pb.Workload | None) -> None:
    """Flags given on the command line replace the file's values (whole lists and maps)."""
    for field in given:
        value = getattr(flags, field)
        if isinstance(value, (list, tuple)) or hasattr(value, "extend"):
            spec.ClearField(field)
            getattr(spec, field).extend(value)
        else:
            setattr(spec, field, value)
    if "trace.runtime_s" in flags.annotations:
        spec.annotations["trace.runtime_s"] = flags.annotations["trace.runtime_s"]
    if workload is not None:
        for f, value in workload.ListFields():
            spec.workload.ClearField(f.name)
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                getattr(spec.workload, f.name).update(value)
            elif f.is_repeated:
                getattr(spec.workload, f.name).extend(value)
            else:
                setattr(spec.workload, f.name, value)


def _print_submitted(items: list[tuple[pb.SubmitJobRequest, pb.SubmitJobsResult]], output: Output, dry_run: bool,
                     verbose: bool, trace_id: str) -> None:
    """One line per job: its id and state, or its error (code and message); a dry run's verdict
    and what-if; with ``verbose`` the trace id and the SQL that finds its events."""
    if output == "json":
        console.print_json(json.dumps([message_dict(r) for _, r in items]
                                      if len(items) > 1 else message_dict(items[0][1].response)
                                      if not items[0][1].code else message_dict(items[0][1])))
        return
    for i, (request, r) in enumerate(items):
        label = (request.spec.name or f"job {i}") + ": " if len(items) > 1 else ""
        if r.code:
            err.print(error_line(f"{label}{_code_name(r.code)}:", r.message))
            continue
        resp = r.response
        if dry_run:
            console.print(styled(label, ("verdict:", "bold"), f" {resp.verdict}"))
            if resp.HasField("what_if"):
                _print_explain(resp.what_if, title=False, spec=request.spec)
            elif resp.verdict.startswith(("accepted", "awaiting_approval")):
                console.print("  what-if: no scheduler answered (the verdict stands; nothing was queued)")
            continue
        console.print(f"{label}{resp.job_id} {_state(resp.state)}{' (duplicate request)' if resp.duplicate else ''}")
    if verbose and trace_id:
        console.print(f"trace id: {trace_id}")
        console.print(f"  its events: fedsched sql \"SELECT occurred_at, type, job_id FROM fedsched.events WHERE trace_id = "
                      f"'{trace_id}' ORDER BY occurred_at\"")


def _code_name(value: int) -> str:
    """The name of a numeric gRPC status code (e.g. 3 -> INVALID_ARGUMENT)."""
    return next((c.name for c in grpc.StatusCode if c.value[0] == value), f"code {value}")


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    """``K=V`` items as a dict (exit 2 naming ``flag`` on an item without ``=`` or a repeated K)."""
    out: dict[str, str] = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or key in out:
            err.print(error_line(flag, f"{item.split('=')[0]!r}: want K=V, each K once"))
            raise typer.Exit(2)
        out[key] = value
    return out


def _workload_flags(image: str, command: list[str], argv: list[str], env: list[str], secret_env: list[str],
                    workdir: str, checkpoint: str, *, need_image: bool = True) -> pb.Workload | None:
    """The workload the submit flags describe (None when none is given; exit 2 when flags need
    --image and ``need_image``: with a job file, the flags override the file's workload fields
    one by one and the image may come from the file).

    Admission validates it (field-named INVALID_ARGUMENT); only the flag syntax is checked here.
    """
    if not image and not need_image:
        if not (command or argv or env or secret_env or workdir or checkpoint):
            return None
        cmd, args = (command, argv) if command else (argv, [])
        return pb.Workload(command=cmd, args=args, env=_pairs(env, "--env"), secret_env=_pairs(secret_env, "--secret-env"),
                           workdir=workdir, checkpoint_uri=checkpoint)
    if not image:
        if command or argv or env or secret_env or workdir or checkpoint:
            err.print(error_line("--image", "required with --command, --env, --secret-env, --workdir, "
                                            "--checkpoint or an argv after --"))
            raise typer.Exit(2)
        return None
    cmd, args = (command, argv) if command else (argv, [])
    return pb.Workload(image=image, command=cmd, args=args, env=_pairs(env, "--env"),
                       secret_env=_pairs(secret_env, "--secret-env"), workdir=workdir, checkpoint_uri=checkpoint)


def _enum_flag(values: list[str], enum, flag: str) -> list[int]:
    """Repeatable enum flags (``--state queued --state held``; also comma separated) as wire values."""
    out = []
    for item in values:
        for v in filter(None, (x.strip() for x in item.split(","))):
            number = enum_number(enum.DESCRIPTOR, v)
            if number is None:
                err.print(error_line(flag, f"{v!r} is not one of {', '.join(enum_words(enum.DESCRIPTOR))}"))
                raise typer.Exit(2)
            out.append(number)
    return out


def _names(values: list[str]) -> list[str]:
    """Repeatable name flags, also comma separated (``--tenant a,b --tenant c``)."""
    return [v.strip() for item in values for v in item.split(",") if v.strip()]


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
#: An age: a positive decimal number and one unit letter, nothing else (no sign, no blanks).
_AGE = re.compile(r"(?P<n>[0-9]+(?:\.[0-9]+)?)(?P<unit>[smhdw])")
#: An ISO-8601 time starts with its calendar date (``fromisoformat`` alone also takes ``20261130``).
_ISO_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
#: The earliest time a filter may name (protobuf Timestamps count from the Unix epoch).
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
#: What ``--since`` / ``--until`` accept, as every refusal says it.
WHEN_FORMS = ("an age before now, a positive number and a unit s, m, h, d or w (30m, 2h, 1.5d), or an "
              "ISO-8601 time (2026-11-30T08:00:00Z; no zone = UTC), not in the future unless it ends a window")


class WhenError(ValueError):
    """A ``--since`` / ``--until`` value that is not one of :data:`WHEN_FORMS`.

    Attributes:
        flag: the option (``--since``).
        text: the value as given.
        reason: what is wrong with it (the message adds the accepted forms).
        forms: the accepted forms the message names (a subclass for other options names theirs).
    """

    forms = WHEN_FORMS

    def __init__(self, flag: str, text: str, reason: str) -> None:
        super().__init__(f"{text!r} {reason}; accepted: {self.forms}")
        self.flag, self.text, self.reason = flag, text, reason


def parse_when(text: str, flag: str, now: dt.datetime | None = None, *, future: bool = False) -> dt.datetime:
    """``--since`` / ``--until``: a relative age before ``now`` (``<number><s|m|h|d|w>``:
    ``90m``, ``2h``, ``1.5d``; the number > 0, no sign) or an ISO-8601 time (no zone = UTC) that
    is not after ``now`` (unless ``future``: the end of a window, ``--until`` / ``--to``, may be
    later than now) and not before 1970. Ages and times both give a timezone-aware UTC datetime.

    Raises:
        WhenError: anything else, saying why and listing the accepted forms: a bare number
            (``5``, ``0``: no unit), a sign (``-5m``, ``+5m``), a zero age, a word
            (``yesterday``), a time in the future (without ``future``) or before 1970.
    """
    now = (now or dt.datetime.now(dt.UTC)).astimezone(dt.UTC)
    t = text.strip()
    if not t:
        raise WhenError(flag, text, "is empty")
    age = _AGE.fullmatch(t)
    if age:
        seconds = float(age["n"]) * _UNITS[age["unit"]]
        if seconds <= 0:
            raise WhenError(flag, text, "is a zero age (it would name the present moment)")
        if seconds > (now - _EPOCH).total_seconds():
            raise WhenError(flag, text, "reaches back before 1970")
        return now - dt.timedelta(seconds=seconds)
    if t[0] in "+-" and _AGE.fullmatch(t[1:]):
        raise WhenError(flag, text, "has a sign: an age counts back from now and takes none (write "
                                    f"{t[1:]!r} for {t[1:]} ago)")
    if re.fullmatch(r"[+-]?[0-9]+(?:\.[0-9]+)?", t):
        raise WhenError(flag, text, "is a number without a unit")
    if _AGE.fullmatch(t.lower()):
        raise WhenError(flag, text, "has an upper-case unit (units are s, m, h, d, w; M is not months)")
    if not _ISO_DATE.match(t):
        raise WhenError(flag, text, "is neither an age nor an ISO-8601 time")
    try:
        when = dt.datetime.fromisoformat(t[:-1] + "+00:00" if t.endswith(("Z", "z")) else t)
    except ValueError:
        raise WhenError(flag, text, "is not a valid ISO-8601 time") from None
    when = when.replace(tzinfo=dt.UTC) if when.tzinfo is None else when.astimezone(dt.UTC)
    if when > now and not future:
        raise WhenError(flag, text, f"is in the future (now is {now:%Y-%m-%dT%H:%M:%SZ})")
    if when < _EPOCH:
        raise WhenError(flag, text, "is before 1970")
    return when


def _time_range(since: str, until: str, now: dt.datetime | None = None
                ) -> tuple[dt.datetime | None, dt.datetime | None]:
    """``--since`` and ``--until`` parsed against one ``now`` (``--until`` may be in the future:
    it ends the window; ``--since`` may not); exit 2 with the reason and the accepted forms when
    either is not accepted, or when ``--until`` is not after ``--since``."""
    now = now or dt.datetime.now(dt.UTC)
    try:
        lo = parse_when(since, "--since", now) if since else None
        hi = parse_when(until, "--until", now, future=True) if until else None
    except WhenError as e:
        err.print(error_line(e.flag, str(e)))
        raise typer.Exit(2) from None
    if lo is not None and hi is not None and hi <= lo:
        err.print(error_line("--until", f"{until!r} ({hi:%Y-%m-%dT%H:%M:%SZ}) is not after --since {since!r} "
                                        f"({lo:%Y-%m-%dT%H:%M:%SZ}): no job could match"))
        raise typer.Exit(2)
    return lo, hi


def jobs(
    tenant: list[str] = typer.Option([], "--tenant", help="Tenant (repeatable, or comma separated: any of them)."),
    project: list[str] = typer.Option([], "--project", help="Project (repeatable: any of them)."),
    state: list[str] = typer.Option([], "--state", help="State as the STATE column prints it (repeatable: any of "
                                                        "them): queued, awaiting_approval, held, placed, running, "
                                                        "succeeded, failed, cancelled."),
    region: list[str] = typer.Option([], "--region", help="Region of the current/last attempt (repeatable)."),
    cluster: list[str] = typer.Option([], "--cluster", help="Cluster of the current/last attempt (repeatable)."),
    kind: list[str] = typer.Option([], "--kind", help="Job kind (repeatable): " + ", ".join(KINDS) + "."),
    name: str = typer.Option("", "--name", help="Job name pattern, shell-style glob (e.g. 'train-*')."),
    since: str = typer.Option("", "--since", help="Submitted at or after: an age before now like 30m, 2h, 1.5d "
                                                  "(units s, m, h, d, w) or a past ISO-8601 time (no timezone = "
                                                  "UTC)."),
    until: str = typer.Option("", "--until", help="Submitted before: an age like 30m, 2h, 1d or an ISO-8601 "
                                                  "time (may be in the future); after --since."),
    oldest_first: bool = typer.Option(False, "--oldest-first", help="Oldest first (default: newest first)."),
    limit: int = typer.Option(100, "--limit", min=1, max=1000, help="Page size (jobs per page)."),
    page_token: str = typer.Option("", "--page-token", help="Continue from this token (printed below a page; "
                                                            "only with the same filters)."),
    all_pages: bool = typer.Option(False, "--all", help="Follow every page (--output json always does)."),
    watch_s: Optional[float] = typer.Option(None, "--watch", min=0.1, metavar="[SECONDS]",
                                            help="Redraw the listing every SECONDS (default 2; the value may be "
                                                 "left out) until Ctrl-C."),
    watch_count: Optional[int] = typer.Option(None, "--watch-count", min=1, hidden=True,
                                              help="Stop --watch after this many refreshes (tests)."),
    server: str = SERVER,
    output: Output = OUTPUT,
    token: str = TOKEN,
):
    """List jobs, newest first: filters combine (any of a repeated flag, all of different flags)."""
    request = pb.ListJobsRequest(tenants=_names(tenant), projects=_names(project), regions=_names(region),
                                 clusters=_names(cluster), states=_enum_flag(state, pb.JobState, "--state"),
                                 kinds=_enum_flag(kind, pb.JobKind, "--kind"), name_pattern=name,
                                 page_size=limit, page_token=page_token,
                                 order=pb.JOB_ORDER_OLDEST_FIRST if oldest_first else pb.JOB_ORDER_NEWEST_FIRST)
    lo, hi = _time_range(since, until)
    if lo is not None:
        request.submitted_after.FromDatetime(lo)
    if hi is not None:
        request.submitted_before.FromDatetime(hi)
    follow = all_pages or output == "json"
    with Api(server, token) as api:
        stub = pb_grpc.JobServiceStub(api.channel)

        def fetch() -> tuple[list, pb.ListJobsResponse]:
            pages, resp = [], api.call(stub.ListJobs, request)
            pages.extend(resp.jobs)
            while follow and resp.next_page_token:
                resp = api.call(stub.ListJobs, pb.ListJobsRequest(**{**_fields(request), "page_token": resp.next_page_token}))
                pages.extend(resp.jobs)
            return pages, resp

        if watch_s is not None:
            _watch_jobs(fetch, watch_s, watch_count)
            return
        listed, last = fetch()
        applied = _applied_filters(tenant=tenant, project=project, state=state, region=region, cluster=cluster,
                                   kind=kind, name=name, since=since, until=until)
        unfiltered = (api.call(stub.ListJobs, pb.ListJobsRequest(page_size=1)).total
                      if not listed and not page_token and applied else None)
    if output == "json":
        _print_jobs(listed, "json")
    elif listed or not applied:
        console.print(_jobs_table(listed))
        console.print(_footer(len(listed), last))
    if unfiltered is not None:  # nothing matched: say why on stderr, stdout stays empty for scripts
        err.print(f"no jobs match {' '.join(applied)}; `fedsched jobs` without filters lists {unfiltered}")


def _applied_filters(**flags: list[str] | str) -> list[str]:
    """The filter flags given, as typed again (``--state held``, ``--name 'train-*'``), in
    ``flags``' order; repeated flags once per value."""
    import shlex

    out = []
    for key, value in flags.items():
        for v in ([value] if isinstance(value, str) else value):
            if v:
                out.append(f"--{key} {shlex.quote(v)}")
    return out


#: Options whose value may be left out, with the value they then take (``jobs --watch``).
OPTIONAL_VALUES = {("jobs", "--watch"): "2"}


def with_optional_values(argv: list[str]) -> list[str]:
    """``argv`` with the default value inserted after an option of :data:`OPTIONAL_VALUES` given
    without one (click has no optional option values through typer): ``jobs --watch`` ->
    ``jobs --watch 2``; ``jobs --watch 5`` is left alone."""
    if not argv or "--" in argv[:1]:
        return argv
    command = next((a for a in argv if not a.startswith("-")), "")
    out = list(argv)
    i = 0
    while i < len(out):
        if out[i] == "--":
            break
        default = OPTIONAL_VALUES.get((command, out[i]))
        if default is not None:
            nxt = out[i + 1] if i + 1 < len(out) else None
            try:
                float(nxt)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                out.insert(i + 1, default)
        i += 1
    return out


def _fields(request: pb.ListJobsRequest) -> dict:
    """The request's set fields (to repeat it with another page token)."""
    return {f.name: v for f, v in request.ListFields()}


def _footer(shown: int, last: pb.ListJobsResponse) -> str:
    more = f"; next page: --page-token {last.next_page_token}" if last.next_page_token else ""
    return f"{shown} of {last.total} matching jobs shown{more}"


def _watch_jobs(fetch, every_s: float, count: int | None) -> None:
    """Redraw the listing every ``every_s`` seconds (rich Live) until Ctrl-C, or ``count`` refreshes."""
    import time

    from rich.console import Group
    from rich.live import Live

    def frame():
        listed, last = fetch()
        stamp = dt.datetime.now(dt.UTC).strftime("%H:%M:%S UTC")
        return Group(_jobs_table(listed), f"{_footer(len(listed), last)}; refreshed {stamp} every {every_s:g} s "
                                          f"(Ctrl-C to stop)")

    drawn = 0
    if not console.is_terminal:  # a pipe or a file: one listing per refresh, each printed whole
        try:
            while count is None or drawn < count:
                if drawn:
                    time.sleep(every_s)
                console.print(frame())
                console.file.flush()
                drawn += 1
        except KeyboardInterrupt:
            pass
        return
    try:
        with Live(frame(), console=console, auto_refresh=False) as live:
            drawn = 1
            while count is None or drawn < count:
                time.sleep(every_s)
                live.update(frame(), refresh=True)
                drawn += 1
    except KeyboardInterrupt:
        pass


def job(job_id: str = typer.Argument(...), server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Show one job with its attempts."""
    with Api(server, token) as api:
        j = api.call(pb_grpc.JobServiceStub(api.channel).GetJob, pb.GetJobRequest(job_id=job_id))
    if output == "json":
        console.print_json(json.dumps(message_dict(j)))
        return
    _print_jobs([j], output)
    _print_spec(j.spec)
    if j.spec.HasField("workload"):
        _print_workload(j.spec.workload)
    if j.attempts:
        t = Table("attempt", "cluster", "region", "card model", "placed", "started", "ended", "outcome", "reason")
        for a in j.attempts:
            t.add_row(str(a.attempt), a.cluster, a.region, a.card_model, _ts(a.placed_at), _ts(a.started_at),
                      _ts(a.ended_at), a.outcome, safe(_clip(a.reason, 200)))
        console.print(t)


#: Annotations and datasets ``job`` lists before saying how many more there are (admission
#: allows 64 of each; the JSON output has all).
SPEC_ROWS_MAX = 64


def _print_spec(s: pb.JobSpec) -> None:
    """What the jobs table leaves out of a spec, as key/value lines: start deadline (UTC),
    estimated duration (s), retry limit, preemptible / checkpointable, maximum price per GPU-hour
    (0 = none), regions, card models, residency tags, datasets (size in bytes, GB shown) and
    annotations. Text from the server goes through :func:`~fedapp.cli.text.safe` (control
    characters escaped, never read as markup); long values end in an ellipsis."""
    t = Table("spec", "value", show_header=False)

    def row(key: str, value: str) -> None:
        t.add_row(safe(key), safe(_clip(value, 200)))

    row("kind / priority", f"{enum_word(pb.JobKind.DESCRIPTOR, s.kind)} / "
                           f"{enum_word(pb.PriorityClass.DESCRIPTOR, s.priority)}")
    row("start deadline", f"{_ts(s.start_deadline)} UTC" if s.start_deadline.seconds else "none")
    if s.estimated_duration_seconds:
        row("estimated duration", f"{s.estimated_duration_seconds:g} s")
    row("retry limit", str(s.retry_limit))
    row("preemptible", "yes" if s.preemptible else "no")
    row("checkpointable", "yes" if s.checkpointable else "no")
    row("max price / GPU-hour", f"{s.max_price_per_gpu_hour:g}" if s.max_price_per_gpu_hour else "no limit")
    row("home region", s.home_region or "-")
    if s.allowed_regions:
        row("allowed regions", ", ".join(s.allowed_regions))
    if s.forbidden_regions:
        row("forbidden regions", ", ".join(s.forbidden_regions))
    if s.card_models:
        row("card models", ", ".join(s.card_models))
    if s.residency_tags:
        row("residency tags", ", ".join(s.residency_tags))
    for d in s.datasets[:SPEC_ROWS_MAX]:
        row(f"dataset {d.name}", f"{d.size_bytes / 1e9:g} GB in {d.home_region or '-'}")
    for k, v in sorted(s.annotations.items())[:SPEC_ROWS_MAX]:
        row(f"annotation {k}", v)
    for what, n in (("datasets", len(s.datasets)), ("annotations", len(s.annotations))):
        if n > SPEC_ROWS_MAX:
            row(f"... {n - SPEC_ROWS_MAX} more {what}", "see -o json")
    console.print(t)


def _print_workload(w: pb.Workload) -> None:
    """The workload as key/value lines; secret variables show their reference (``secret-name/key``).
    Values are shown escaped (:func:`~fedapp.cli.text.safe`)."""
    t = Table("workload", "value", show_header=False)
    t.add_row("image", safe(w.image))
    if w.command or w.args:
        t.add_row("argv", safe(json.dumps(list(w.command) + list(w.args))))
    for k, v in sorted(w.env.items()):
        t.add_row(safe(f"env {k}"), safe(_clip(v, 200)))
    for k, ref in sorted(w.secret_env.items()):
        t.add_row(safe(f"env {k}"), safe(f"secret {ref}"))
    if w.workdir:
        t.add_row("workdir", safe(w.workdir))
    if w.checkpoint_uri:
        t.add_row("checkpoint", safe(w.checkpoint_uri))
    console.print(t)


def explain(job_id: str = typer.Argument(...), server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Why a job went where it went, or why it waits: every cluster's verdict and scores."""
    with Api(server, token) as api:
        resp = api.call(pb_grpc.JobServiceStub(api.channel).ExplainJob, pb.ExplainJobRequest(job_id=job_id))
        got = None if output == "json" else api.call(pb_grpc.JobServiceStub(api.channel).GetJob,
                                                     pb.GetJobRequest(job_id=job_id))
    if output == "json":  # every field, false ones too (fits_empty: false = can never run as asked)
        console.print_json(json.dumps(message_dict(resp, always_print_fields_with_no_presence=True)))
        return
    history = attempt_history(got)
    _print_explain(resp, spec=got.spec)
    if history:  # lost attempts and failovers, other interruptions, agents' reconciliation
        console.print(styled(("attempts:", "bold")))
        for line in history:
            console.print(f"  {line}", highlight=False)


def _print_explain(resp: pb.ExplainJobResponse, *, title: bool = True, spec: pb.JobSpec | None = None) -> None:
    """Decisions for people (``fedsched explain``, and a dry run's what-if without ``title``):
    per shard the outcome, summary, counterfactual and every cluster's verdict and scores; a
    proposal awaiting approval says who may approve it and what happens without an approval
    (:func:`fedapp.explain.approval_wait`, with the job's tenant and home region from ``spec``)."""
    from fedapp.explain import approval_wait

    if title:
        console.print(styled((resp.job_id, "bold"), f" {_state(resp.state)}"))
    for d in resp.decisions:
        head = f"shard {d.shard}: " if len(resp.decisions) > 1 else ("what-if: " if not title else "")
        console.print(styled(head, (d.outcome, "bold"), f" {d.cluster or ''} {('(' + d.region + ')') if d.region else ''}"
                             f" queue {d.queue or '-'} policy {d.policy_version or '-'}"))
        console.print(f"  {d.summary}", highlight=False)
        if d.outcome == "awaiting_approval":  # the request is still open (an answered one keeps its id)
            console.print(styled("  ", ("awaiting approval:", "yellow"), " ", printable(approval_wait(
                d, tenant=spec.tenant if spec else "", home_region=spec.home_region if spec else "",
                deadline=f"{_ts(d.approval_expires_at)} UTC" if d.approval_expires_at.seconds else ""))),
                          highlight=False)
        elif d.approval_id and d.outcome.startswith("approval_"):  # approval_approved / _rejected / _expired
            console.print(styled("  ", (f"proposal {d.outcome.removeprefix('approval_')}:", "yellow"),
                                 f" request {safe(d.approval_id)} was answered"), highlight=False)
        if d.outcome == "pending" and not d.fits_empty:
            console.print(styled("  ", ("can never run as asked:", "red"),
                                 " no cluster could hold it even if it were empty; waiting will not help "
                                 "(ask for fewer GPUs per worker, other card models or regions, or cancel it)"))
        if d.counterfactual:
            console.print(styled("  ", ("what if:", "italic"), f" {d.counterfactual}"), highlight=False)
        t = Table("cluster", "region", "verdict", "detail / scores", "total")
        for c in sorted(d.clusters, key=lambda c: (not c.passed, -(c.total if c.HasField("total") else 0))):
            detail = ", ".join(f"{k} {v:.2f}" for k, v in sorted(c.scores.items())) if c.passed else c.detail
            t.add_row(c.cluster, c.region, "fits" if c.passed else c.reason, safe(_clip(detail, 200)),
                      f"{c.total:.3f}" if c.HasField("total") else "")
        console.print(t)


# --------------------------------------------------------------------------- acting on many jobs

REASON_MAX = 500  #: admission's limit on an audited reason (characters)
SELECT_TENANT = typer.Option([], "--tenant", help="Jobs of this tenant (repeatable: any of them).")
SELECT_PROJECT = typer.Option([], "--project", help="Jobs of this project (repeatable: any of them).")
SELECT_STATE = typer.Option([], "--state", help="Jobs in this state (repeatable): queued, held, awaiting_approval, "
                                                "placed, running.")
SELECT_NAME = typer.Option("", "--name", help="Jobs whose name matches this shell-style pattern, e.g. 'train-*'.")
REASON = typer.Option("", "--reason", help=f"Why (audited; at most {REASON_MAX} characters).")
YES = typer.Option(False, "--yes", "-y", help="Do not ask before acting on the jobs a selector matches "
                                              "(needed when stdin is not a terminal).")
DRY_RUN = typer.Option(False, "--dry-run", help="Show what would be done; change nothing.")


def _states(values: list[str], flag: str = "--state") -> list[int]:
    """``--state`` names as wire states (exit 2 naming the flag on an unknown one)."""
    out = []
    for s in values:
        number = enum_number(pb.JobState.DESCRIPTOR, s)
        if number is None:
            err.print(error_line(flag, f"{s!r} is not a state"))
            raise typer.Exit(2)
        out.append(number)
    return out


def _bulk(verb: str, rpc: str, ids: list[str], tenant: list[str], project: list[str], state: list[str], name: str,
          reason: str, yes: bool, dry_run: bool, server: str, output: Output, token: str) -> None:
    """One bulk action: by ids at once; by selector after a dry run, a count and a question
    (``--yes`` skips it; no terminal and no ``--yes`` refuses). One line per job; exit 1 if any
    job's action failed, 2 on a usage error."""
    selector = pb.JobSelector(job_ids=ids, tenants=tenant, projects=project, states=_states(state), name_pattern=name)
    by_filters = bool(tenant or project or state or name)
    if ids and by_filters:
        err.print(error_line("usage:", "give job ids or selector flags (--tenant/--project/--state/--name), not both"))
        raise typer.Exit(2)
    if not ids and not by_filters:
        err.print(error_line("usage:", "give job ids, or select jobs with --tenant/--project/--state/--name"))
        raise typer.Exit(2)
    if len(reason) > REASON_MAX:
        err.print(error_line("--reason", f"at most {REASON_MAX} characters"))
        raise typer.Exit(2)
    with Api(server, token) as api:
        call = getattr(pb_grpc.JobServiceStub(api.channel), rpc)
        if by_filters and not dry_run and not yes:
            preview = api.call(call, pb.BulkJobsRequest(selector=selector, reason=reason, dry_run=True))
            if preview.succeeded == 0:
                _print_bulk(preview, output)
                console.print(f"no job to {verb}")
                raise typer.Exit(1 if any(r.code for r in preview.results) else 0)
            if not sys.stdin.isatty():
                err.print(error_line("refused:", f"{verb} {preview.succeeded} job(s) without asking needs --yes "
                                                 f"(stdin is not a terminal); add --yes"))
                raise typer.Exit(2)
            noun = "job" if preview.succeeded == 1 else "jobs"
            if not typer.confirm(f"{verb.capitalize()} {preview.succeeded} {noun}?", default=False):
                console.print("nothing done")
                raise typer.Exit(1)
        resp = api.call(call, pb.BulkJobsRequest(selector=selector, reason=reason, dry_run=dry_run))
    _print_bulk(resp, output)
    if not resp.results and by_filters:  # (exit 0: nothing to do is not a failure, but say so)
        err.print("no job matches the selector; `fedsched jobs` with the same filters lists what it would act on")
    if any(r.code for r in resp.results):
        raise typer.Exit(1)


_CODE_NAMES = {c.value[0]: c.name for c in grpc.StatusCode}


def _print_bulk(resp: pb.BulkJobsResponse, output: Output) -> None:
    if output == "json":
        console.print_json(json.dumps(message_dict(resp, always_print_fields_with_no_presence=True)))
        return
    for r in resp.results:
        if r.code:
            err.print(styled(f"{r.job_id} ", (_CODE_NAMES.get(r.code, str(r.code)), "red"), f": {printable(r.message).plain}"))
        else:
            console.print(f"{r.job_id} {safe(r.message)}" + (f" ({_state(r.state)})" if r.state else ""))
    failed = sum(1 for r in resp.results if r.code)
    console.print(f"{resp.succeeded} of {len(resp.results)} done" + (f", {failed} failed" if failed else ""))


def cancel(ids: Optional[list[str]] = typer.Argument(None, metavar="[JOB_ID]...", show_default=False,
                                                     help="Jobs to cancel (or select them with the flags)."),
           tenant: list[str] = SELECT_TENANT, project: list[str] = SELECT_PROJECT, state: list[str] = SELECT_STATE,
           name: str = SELECT_NAME, reason: str = REASON, yes: bool = YES, dry_run: bool = DRY_RUN,
           server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Cancel jobs by id, or every job a selector matches (queued and held jobs end at once;
    running ones are stopped by their agent).

    Selector flags repeat (any of the values) and combine (all of the flags). A selector asks
    "Cancel N jobs? [y/N]" first. One line per job; exit 1 if any could not be cancelled.
    """
    _bulk("cancel", "CancelJobs", ids or [], tenant, project, state, name, reason, yes, dry_run, server, output, token)


def hold(ids: Optional[list[str]] = typer.Argument(None, metavar="[JOB_ID]...", show_default=False,
                                                   help="Jobs to hold (or select them with the flags)."),
         tenant: list[str] = SELECT_TENANT, project: list[str] = SELECT_PROJECT, state: list[str] = SELECT_STATE,
         name: str = SELECT_NAME, reason: str = REASON, yes: bool = YES, dry_run: bool = DRY_RUN,
         server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Hold queued jobs: the scheduler leaves them alone until `fedsched release`.

    Only queued jobs can be held (placed, running and awaiting-approval ones are refused per
    job). Same selectors and question as `fedsched cancel`.
    """
    _bulk("hold", "HoldJobs", ids or [], tenant, project, state, name, reason, yes, dry_run, server, output, token)


def release(ids: Optional[list[str]] = typer.Argument(None, metavar="[JOB_ID]...", show_default=False,
                                                      help="Held jobs to release (or select them with the flags)."),
            tenant: list[str] = SELECT_TENANT, project: list[str] = SELECT_PROJECT, state: list[str] = SELECT_STATE,
            name: str = SELECT_NAME, reason: str = REASON, yes: bool = YES, dry_run: bool = DRY_RUN,
            server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Release held jobs: they wait again with their original submit time.

    Same selectors and question as `fedsched cancel`.
    """
    _bulk("release", "ReleaseJobs", ids or [], tenant, project, state, name, reason, yes, dry_run, server, output,
          token)


def priority(job_id: str = typer.Argument(..., help="A queued or held job."),
             priority_class: str = typer.Argument(..., metavar="CLASS", help=", ".join(PRIORITIES)),
             reason: str = REASON, server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Change the priority class of a queued or held job (audited with who and why)."""
    if priority_class not in PRIORITIES:
        err.print(error_line("CLASS", f"must be one of {', '.join(PRIORITIES)}"))
        raise typer.Exit(2)
    if len(reason) > REASON_MAX:
        err.print(error_line("--reason", f"at most {REASON_MAX} characters"))
        raise typer.Exit(2)
    with Api(server, token) as api:
        j = api.call(pb_grpc.JobServiceStub(api.channel).SetJobPriority,
                     pb.SetJobPriorityRequest(job_id=job_id, priority=PRIORITIES[priority_class], reason=reason))
    if output != "json":
        console.print(f"{j.job_id}: priority class now {priority_class} (audited as job.priority_changed)",
                      highlight=False)
    _print_jobs([j], output)


# --------------------------------------------------------------------------- watch

class WatchExit:
    """``fedsched watch`` exit codes (also in its --help and the README)."""

    SUCCEEDED = 0
    ERROR = 1          # any other error (authentication, permission, a bad argument)
    USAGE = 2          # bad flags
    FAILED = 3         # the job ended FAILED
    CANCELLED = 4      # the job ended CANCELLED
    TIMEOUT = 5        # --timeout passed before the job ended
    NOT_FOUND = 6      # no such job, or one you may not read (the same answer: no existence leak)
    UNAVAILABLE = 7    # admission unreachable, or the stream broke


WATCH_HELP = f"""Follow a job's state until it ends; the exit code says how it ended.

Exit codes: {WatchExit.SUCCEEDED} succeeded, {WatchExit.FAILED} failed, {WatchExit.CANCELLED} cancelled, \
{WatchExit.TIMEOUT} timeout (--timeout passed first), {WatchExit.NOT_FOUND} not found, \
{WatchExit.UNAVAILABLE} unavailable (admission unreachable), {WatchExit.ERROR} any other error, \
{WatchExit.USAGE} usage error.
"""

_ENDS = {pb.JOB_STATE_SUCCEEDED: WatchExit.SUCCEEDED, pb.JOB_STATE_FAILED: WatchExit.FAILED,
         pb.JOB_STATE_CANCELLED: WatchExit.CANCELLED}
_RPC_EXITS = {grpc.StatusCode.DEADLINE_EXCEEDED: WatchExit.TIMEOUT, grpc.StatusCode.NOT_FOUND: WatchExit.NOT_FOUND,
              grpc.StatusCode.UNAVAILABLE: WatchExit.UNAVAILABLE}


def watch(job_id: str = typer.Argument(...),
          timeout: Optional[float] = typer.Option(None, "--timeout", min=0.001, show_default=False,
                                                  help="Give up after this many seconds (exit 5)."),
          server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    last = None
    with Api(server, token) as api:
        try:
            stream = pb_grpc.JobServiceStub(api.channel).WatchJob(pb.WatchJobRequest(job_id=job_id),
                                                                  metadata=api.metadata, timeout=timeout)
            for j in stream:
                last = j
                if output == "json":
                    console.print_json(json.dumps(message_dict(j)))
                else:
                    console.print(f"{j.job_id} {_state(j.state)} {j.cluster or ''} {safe(j.reason)}")
        except grpc.RpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                err.print(error_line("timeout:", f"{job_id} still {_state(last.state) if last else 'unknown'} "
                                                 f"after {timeout:g} s"))
            else:
                err.print(error_line(f"{code.name}:", e.details()))
            raise typer.Exit(_RPC_EXITS.get(code, WatchExit.ERROR)) from None
    if last is None or last.state not in _ENDS:
        err.print(error_line("unavailable:", "the watch ended before the job did"))
        raise typer.Exit(WatchExit.UNAVAILABLE)
    raise typer.Exit(_ENDS[last.state])


def logs(job_id: str = typer.Argument(...),
         attempt: Optional[int] = typer.Option(None, "--attempt", min=1, help="attempt number (default: the latest)"),
         worker: Optional[int] = typer.Option(None, "--worker", min=0, help="gang member, 0-based (default: all)"),
         shard: int = typer.Option(0, "--shard", min=0, help="shard of a split batch job"),
         follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the attempt ends"),
         server: str = SERVER, token: str = TOKEN):
    """Print a job attempt's output (its workers' logs), fetched from its cluster's agent."""
    request = pb.GetJobLogsRequest(job_id=job_id, shard=shard, follow=follow)
    if attempt is not None:
        request.attempt = attempt
    if worker is not None:
        request.worker = worker
    with Api(server, token) as api:
        try:
            for chunk in api.stream(pb_grpc.JobServiceStub(api.channel).GetJobLogs, request):
                sys.stdout.write(chunk.data)
                sys.stdout.flush()
        except grpc.RpcError as e:
            fail_rpc(e)


def register(app: typer.Typer) -> None:
    """Add the job commands to ``app`` (in this order in ``fedsched --help``)."""
    app.command("submit")(submit)
    app.command("jobs")(jobs)
    app.command("job")(job)
    app.command("explain")(explain)
    app.command("cancel")(cancel)
    app.command("hold")(hold)
    app.command("release")(release)
    app.command("priority")(priority)
    app.command("watch", help=WATCH_HELP)(watch)
    app.command("logs")(logs)
