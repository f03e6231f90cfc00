"""Errors a request caused, kept apart from an engine's failure (Envoy's outlier detection separates "local origin"
from external errors the same way), and a circuit breaker per request shape.

vLLM answers 500 (or ends a stream with a 5xx error event) to any unexpected exception one request causes. Counted
as the engine's failure, one input that makes vLLM raise would eject replica after replica, up to the panic
threshold, again and again; and sent again elsewhere after each failure, it would fail there too.

- ``shape``: a request's shape, a digest of what makes it reproduce (route, model, prompt or messages, the
  parameters that change what the engine computes);
- ``circuit``: the breakers, one per shape that failed (a bounded LRU): which replicas a shape failed on, when the
  input is at fault (it failed on ``breaker.replicas`` otherwise healthy replicas), open, half-open;
- ``hook``: the request path's part: refuses a shape whose breaker is open (422), judges each error answer (the
  input's: never counted toward ejection; the engine's: counted), and judges a stream's first byte that came later
  than the idle timeout (a long prefill when the engine answers /health);
- ``settings``: the ``breaker`` section.
"""
