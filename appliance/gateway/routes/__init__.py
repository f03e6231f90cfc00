"""The gateway's HTTP routes; the composition root (appliance/app.py) includes ``ROUTERS``."""

from appliance.gateway.routes import batches, health, metrics, openai, requests, runbooks

ROUTERS = (openai.router, batches.router, batches.admin_router, health.router, metrics.router, runbooks.router,
           requests.router)
CLIENT_ROUTERS = (openai.router, batches.router)  # /v1: not on a node pod (appliance.app.data_routes)
