"""The composition layer: what wires the services together and drives them.

``fedapp`` sits above ``services/`` which sits above ``fedsched/`` (the library every service
uses); imports go only downwards (``tests/unit/test_layers.py`` checks it):

- :mod:`fedapp.runtime` -- starts the embedded NATS server and the services in one process;
- :mod:`fedapp.cli` -- the ``fedsched`` command line;
- :mod:`fedapp.client` -- the gRPC client of admission the CLI and the replay use;
- :mod:`fedapp.replay` -- the trace replay driver and its report;
- :mod:`fedapp.reports` -- saved queries, HTML and Grafana reports over the audit store.

Importing this package (every entry point does, before gRPC is loaded) turns gRPC's fork
handlers off unless the environment says otherwise (``GRPC_ENABLE_FORK_SUPPORT``): a service
process forks to capture its restart checkpoint (:class:`fedsched.snapshots.ForkedCapture`), and
with gRPC calls in flight the C core's ``pthread_atfork`` handlers crashed the child with
SIGSEGV before it ran a line (8 of 38 admission checkpoints under load). The child never uses
gRPC, so it needs none of them.
"""

import os as _os

_os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
