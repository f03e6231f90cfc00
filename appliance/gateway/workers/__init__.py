"""The gateway on several cores: decisions in one process, the relay in worker processes.

With ``gateway.workers`` above 1, ``appliance serve`` runs one *decider* (the process it always ran: engines,
maintenance, collectors, batch work, the admin API, and every piece of state that must be exact: admission's
per-replica limits, the queue and its fair share, routing and the prefix index, the tenants' quota buckets, the
slot audit) and that many *workers*. The workers hold the client port (SO_REUSEPORT: the kernel spreads the
connections), terminate the clients' connections, run the whole request path (the hooks, the transport, the relay
of every event) and ask the decider for each decision over a Unix socket: a slot (``Acquire`` in, a replica and a
lease out), a quota reservation, and back the plain results (a lease's release, the tokens charged, the request's
record). Every other path (/metrics, /admin, /health, the Batch API, /v1/models) a worker passes to the decider.

- ``messages``: what crosses the socket, typed.
- ``link``: the framed connection both sides speak, with request and answer matched by number.
- ``decider``: the decider's side: one session per worker, whose leases and reservations die with it.
- ``remote``: the worker's side: admission, routing view, quotas and records that ask the decider.
- ``pool``: the decider starts, watches and restarts the workers; drain and reload reach them from there.
- ``worker``: a worker process: its app and its server.
"""
