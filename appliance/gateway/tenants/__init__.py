"""Tenants: who calls the appliance (API keys grouped by team or service), what each used, what each may use, and
their fair share of the engines when one floods the gateway (docs/tenants.md).

- ``settings``: ``tenants`` in the configuration (``APPLIANCE_TENANTS`` as JSON);
- ``directory``: an API key -> its tenant, in constant time per key;
- ``quota``: tokens and requests per minute, one bucket per tenant and limit, levels kept across reloads;
- ``accounting``: per-tenant requests, tokens (from the engines' usage), TTFT and queue wait, for /metrics and
  ``appliance status``;
- ``fair_share``: the admission queue's order between tenants (priority, then weighted least-served) and each
  tenant's share of a replica while others want it (``appliance.gateway.admission`` applies it).
"""
