"""hw-agnostic versions of the classes in `strata.layers`; the resolver falls back per missing symbol."""
