"""The web console: a read-mostly browser view of the federation (jobs, a job's attempts,
explanation, events and cost, queues, clusters and capacity, approvals with Approve/Reject,
policy versions with diffs, live usage charts).

It is a client, not a second front door: every page calls admission's gRPC API with the signed-in
user's bearer token (:mod:`fedapp.web.api`), so it shows and does exactly what the API allows
that user; events, cost and charts come from ClickHouse the way ``fedsched report`` reads it
(:mod:`fedapp.web.reads`), only for what the API let the user read. aiohttp serves Jinja2
templates; the CSS, the small refresh script and the icon ship in the package (``static/``),
charts are SVG drawn on the server -- no CDN, no external URL.

Public surface: :class:`WebConfig`, :func:`create_app`, :func:`start_web` / :class:`WebServer`,
:class:`~fedapp.web.api.ApiConfig`, :class:`~fedapp.web.reads.Reads`.
"""

from fedapp.web.api import ApiConfig, ApiError
from fedapp.web.app import WebConfig, WebServer, create_app, start_web
from fedapp.web.reads import Reads

__all__ = ["ApiConfig", "ApiError", "Reads", "WebConfig", "WebServer", "create_app", "start_web"]
