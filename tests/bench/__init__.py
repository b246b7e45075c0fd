"""`make bench` and `make soak`: the benchmark sections and the soak, run as scripts."""
