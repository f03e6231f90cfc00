"""The intake: what the gateway accepts before any route runs (connection caps, body size and time, the
body-buffer budget); settings: ``intake``."""
