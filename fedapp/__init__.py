"""The composition layer: what wires the services together and drives them.

``fedapp`` sits above ``services/`` which sits above ``fedsched/`` (the library every service
uses); imports go only downwards (``tests/unit/test_layers.py`` checks it):

- :mod:`fedapp.runtime` -- starts the embedded NATS server and the services in one process;
- :mod:`fedapp.cli` -- the ``fedsched`` command line;
- :mod:`fedapp.client` -- the gRPC client of admission the CLI and the replay use;
- :mod:`fedapp.replay` -- the trace replay driver and its report;
- :mod:`fedapp.reports` -- saved queries, HTML and Grafana reports over the audit store.
"""
