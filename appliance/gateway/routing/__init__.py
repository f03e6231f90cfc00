"""Routing as a pipeline: filters (who may take a request), then a policy (weighted scorers, or round robin);
the router that runs it, ejection, and the ``routing`` settings. The package imports nothing itself, so reading
its settings does not load the router."""
