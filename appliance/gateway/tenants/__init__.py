"""Tenants: who calls the appliance (API keys grouped by team or service), what each used, what each may use, and
their fair share of the engines when one floods the gateway.

- ``settings``: ``tenants`` in the configuration (``APPLIANCE_TENANTS`` as JSON);
- ``directory``: an API key -> its tenant, in constant time per key;
"""
