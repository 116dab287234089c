"""More than one process per engine: the process group of its ranks and the collectives its layers call."""
