"""Side effects at the edge: the run directory, ports, starting and supervising processes."""
