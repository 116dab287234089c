"""Models Strata runs: today those of Hugging Face transformers (`strata.models.transformers`)."""
