"""Attention backends that run on every device; platforms add their own (`strata.platforms.<name>.attention`)."""
