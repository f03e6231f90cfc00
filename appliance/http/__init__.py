"""HTTP plumbing shared by the gateway, maintenance and the admin API: OpenAI error JSON, authentication."""
