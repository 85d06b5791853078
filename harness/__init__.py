"""attnbench harness: the `bench` CLI and everything that measures."""
