"""The ``fedsched`` command line (entry point :func:`main`, commands in :mod:`fedapp.cli.root`).

Submodules: :mod:`~fedapp.cli.jobs` (job API commands), :mod:`~fedapp.cli.admin` (tenants,
quotas, principals, approvals, policy), :mod:`~fedapp.cli.reports`, :mod:`~fedapp.cli.sql`,
and :mod:`~fedapp.cli.text` (console output helpers).
"""

from fedapp.cli.root import app, main

__all__ = ["app", "main"]
