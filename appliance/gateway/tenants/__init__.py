"""Tenants: who calls the appliance (API keys grouped by team or service), what each used, what each may use, and
their fair share of the engines when one floods the gateway (docs/tenants.md).

- ``settings``: ``tenants`` in the configuration (``APPLIANCE_TENANTS`` as JSON);
- ``directory``: an API key -> its tenant, in constant time per key;
- ``quota``: tokens and requests per minute, one bucket per tenant and limit, levels kept across reloads, and
  the reservation each request holds in them (``cost``: a request's worst case);
- ``accounting``: per-tenant requests, tokens (from the engines' usage), TTFT and queue wait, for /metrics and
  ``appliance status``;
- ``reconcile``: what tenants were charged for each replica's work against its engine's own token counters;
- ``fair_share``: the admission queue's order between tenants (priority, then weighted least-served) and each
  tenant's share of a replica while others want it (``appliance.gateway.admission`` applies it);
- the hooks on the request path: ``metering`` (quota, usage, accounting), ``isolation`` (each tenant's prefix
  cache: vLLM's ``cache_salt``), ``priority`` (the tenant's place in the engine's own queue: vLLM's ``priority``),
  ``revocation`` (ending a removed tenant's streams).
"""
