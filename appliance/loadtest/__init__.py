"""Load testing and capacity planning: ``appliance bench``, ``appliance capacity`` and ``appliance plan``.

Modules by concern: ``prompts`` (seeded prompts of exact token counts), ``client`` (streaming client timing
every chunk), ``load`` (closed/open loop schedulers, intended-send-time accounting), ``stats`` (percentiles,
Wilson intervals, the concurrency search, drift), ``bench`` (one run and its summary), ``capacity`` (search and
soak), ``metrics_scrape`` (the appliance's /metrics), ``report`` (JSON/Markdown/PNG, atomic), ``plan`` (memory
planner) and ``cli`` (``register(subparsers)``).
"""
