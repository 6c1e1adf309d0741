"""Operators' commands: ``fedsched clusters`` (capacity at a glance, like ``sinfo`` / ``sky
show-gpus``) and ``fedsched status`` (each service's health, version and lag). Both read
admission's ``ClusterService`` / ``SystemService``; any authenticated principal may call them."""

from __future__ import annotations

import json

import typer
from rich import box
from rich.table import Table

from fedsched.api.v1 import jobs_pb2 as pb
from fedsched.api.v1 import jobs_pb2_grpc as pb_grpc
from fedapp.cli.jobs import OUTPUT, SERVER, TOKEN, Api
from fedapp.cli.text import Output, console, styled
from fedapp.cli.wire import message_dict


def _age(seconds: float) -> str:
    """A heartbeat age for people: ``0.4s``, ``3m12s``, ``never``."""
    if seconds < 0:
        return "never"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def _dump(msg) -> None:
    console.print_json(json.dumps(message_dict(msg, always_print_fields_with_no_presence=True)))


def clusters(region: list[str] = typer.Option([], "--region", help="Only this region (repeatable)."),
             server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Capacity at a glance: per region and cluster, card models with GPUs total / allocated /
    free, health and heartbeat age, nodes, running jobs; then the queues per home region and
    job kind.

    Whole cards: a card partly taken by a shared job counts as allocated. Allocations come from
    the agents' latest inventory (published every few heartbeats). A --region that names no
    region of the federation is an error listing the known ones (exit 1).
    """
    with Api(server, token) as api:
        resp = api.call(pb_grpc.ClusterServiceStub(api.channel).ListClusters, pb.ListClustersRequest(regions=region))
    if output == "json":
        _dump(resp)
        return
    # one section per region (a title row), so the table fits 80 columns; zone and more are in --output json
    t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    t.add_column("cluster", overflow="fold", min_width=8)     # names fold, never cut (they are copied)
    t.add_column("health", no_wrap=True)
    t.add_column("seen", no_wrap=True)  # heartbeat age
    t.add_column("nodes", no_wrap=True)  # schedulable/all
    t.add_column("card model", overflow="fold", min_width=8)
    for name in ("GPUs", "alloc", "free", "jobs"):
        t.add_column(name, justify="right", no_wrap=True)
    previous = None
    for c in resp.clusters:
        if c.region != previous:
            if previous is not None:
                t.add_section()
            t.add_row(styled((c.region, "bold")))
            previous = c.region
        health = "ok" if c.healthy else "down"
        cards = list(c.cards) or [pb.CardCapacity(card_model="-")]
        for i, card in enumerate(cards):
            first = i == 0
            t.add_row(c.cluster if first else "", health if first else "",
                      _age(c.heartbeat_age_seconds) if first else "", f"{c.nodes_schedulable}/{c.nodes}" if first else "",
                      card.card_model, str(card.gpus_total), str(card.gpus_allocated), str(card.gpus_free),
                      str(c.running_jobs) if first else "")
    if resp.clusters:
        console.print(t)
    else:  # a known region (the server refuses unknown ones) whose agents have not reported
        console.print(f"no cluster {'of ' + ', '.join(region) + ' ' if region else ''}has reported yet")
    if resp.queues:
        q = Table("home region", "kind", "waiting", "oldest wait", box=box.SIMPLE_HEAD, pad_edge=False)
        for row in resp.queues:
            q.add_row(row.region, row.kind, str(row.queued), _age(row.oldest_wait_seconds))
        console.print(q)
    else:
        console.print("no job waiting")


def status(server: str = SERVER, output: Output = OUTPUT, token: str = TOKEN):
    """Each service's state (ok, degraded, down), version, lag, when it was last seen and detail:
    admission, the scheduler (its status on the bus), audit and billing (their durable
    consumers: a writer pulling with nothing to do is seen now, "idle, caught up"; one nobody
    pulls from shows its last message's age and is down), and every agent (its heartbeats).
    Exit 1 when any service is down."""
    with Api(server, token) as api:
        resp = api.call(pb_grpc.SystemServiceStub(api.channel).GetStatus, pb.GetStatusRequest())
    if output == "json":
        _dump(resp)
    else:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
        t.add_column("service", no_wrap=True)
        for name in ("state", "version", "lag", "seen"):
            t.add_column(name, no_wrap=True, justify="right" if name == "lag" else "left")
        t.add_column("detail", overflow="fold", ratio=1)  # the rest of the width; wraps
        for s in resp.services:
            state = styled((s.state, {"ok": "green", "degraded": "yellow"}.get(s.state, "red")))
            t.add_row(s.name, state, s.version or "-", str(s.consumer_lag), _age(s.last_seen_age_seconds), s.detail)
        console.print(t)
    if any(s.state == "down" for s in resp.services):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    """Add ``clusters`` and ``status`` to ``app``."""
    app.command("clusters")(clusters)
    app.command("status")(status)
