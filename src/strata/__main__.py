"""`python -m strata ...`: the `strata` command."""

from strata.entrypoints.cli import main

raise SystemExit(main())
