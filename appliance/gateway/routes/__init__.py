"""The gateway's HTTP routes; the composition root (appliance/app.py) includes ``ROUTERS``."""

from appliance.gateway.routes import health, metrics, openai, requests, runbooks

ROUTERS = (openai.router, health.router, metrics.router, runbooks.router, requests.router)
