"""Reports over the audit log and usage: saved queries, tables, an HTML page and Grafana.

Public surface:

* :data:`REPORTS` / :class:`SavedQuery` / :func:`render` -- the saved queries (``queries``);
* :func:`run_reports` / :func:`data_window` / :class:`Window` -- running them (``run``);
* :func:`html_page` -- the self-contained HTML page with charts (``html``);
* :func:`dashboard` -- the Grafana dashboard built from the same SQL (``grafana``).
"""

from fedapp.reports.queries import BY_NAME, REPORTS, SavedQuery, render
from fedapp.reports.run import QueryFn, ReportResult, Window, data_window, run_report, run_reports

__all__ = ["BY_NAME", "REPORTS", "QueryFn", "ReportResult", "SavedQuery", "Window", "data_window", "render",
           "run_report", "run_reports"]
