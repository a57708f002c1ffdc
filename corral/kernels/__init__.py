"""Device kernels, one file per operation: a Triton kernel and its pure-torch twin (the CPU path and oracle)."""
