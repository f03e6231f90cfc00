"""Precise prefix routing: the engines' own KV-cache events, an exact index per replica, and prompts tokenized and
hashed as the engine does (docs/architecture.md, Routing)."""
