"""The graph as lms reads it: :mod:`~lmscli.graph.graphview`, a read-only index of nodes, edges,
loop frames and cond branches; :mod:`~lmscli.graph.shapes`, every output's shape and dtype as
TensorFlow infers them (and ``--batch-size``); :mod:`~lmscli.graph.inline`, function calls and
functional control flow replaced by their bodies when a graph is loaded.
"""
