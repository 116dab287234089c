"""The engine: requests and their sequences, scheduling over the paged KV cache blocks, the step loop and
its outputs, and the engines a server drives (on a thread, or as data-parallel replicas in processes)."""
