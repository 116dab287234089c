"""How users reach the engine: the offline `LLM` API, the `strata` command line and the OpenAI server."""
