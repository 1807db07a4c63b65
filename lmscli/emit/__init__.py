"""The emit pass: :mod:`~lmscli.emit.rewriter` writes a plan into a copy of the graph (swap nodes,
recomputed clones, control edges, stacks on the host) and validates the result."""
