"""What runs a step on the model: the model runner (inputs, KV cache tensors, the forward) and the runners
that spread it over the processes of a tensor- or pipeline-parallel engine."""
