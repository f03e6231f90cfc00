"""What the gateway observes of its own requests: metrics, traces, the event-loop lag, the fleet's gauges, and
the request records, with the hooks that fill them."""
