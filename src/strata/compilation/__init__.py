"""`torch.compile` for the forward: Dynamo tracing, splitting the graph at attention, compiling and caching
each piece, and the pass manager that runs a platform's graph passes."""
