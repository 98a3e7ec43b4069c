"""Input and output at the edges: the run directory, batch files, scenario outputs."""
