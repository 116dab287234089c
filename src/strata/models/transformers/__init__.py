"""A transformers model made a Strata model: built on meta, its layers resolved to registered ops, its
attention routed to the paged cache, sharded or split for parallelism, and its weights loaded."""
