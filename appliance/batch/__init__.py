"""OpenAI's Batch API on the capacity interactive traffic leaves (docs/batch.md).

``store.py`` (the storage Protocol) and ``sqlite.py`` (its implementation), ``blobs.py`` (files on disk), ``lines.py``
(the JSONL formats), ``service.py`` (the API's operations, per tenant), ``runner.py`` (the life cycle, and the lines
sent on idle capacity), ``submit.py`` (the in-process seam into the gateway's request path), ``metrics.py``;
settings ``batch`` (``settings.py``). Built by ``appliance.composition.batch``; its routes are
``appliance/gateway/routes/batches.py``, which reach it through the context's ``BatchAPI``.
"""
