"""Paged attention: the one attention op, its forward context and metadata, and the backends."""
