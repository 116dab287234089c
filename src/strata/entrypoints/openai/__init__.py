"""OpenAI-compatible HTTP server: `strata serve`."""
