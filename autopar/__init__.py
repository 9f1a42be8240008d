"""autopar: a compiler for training parallelism."""
