"""The proof pass: real TensorFlow runs that check what the other passes claim.

:mod:`~lmscli.prove.steps` trains a graph on CPU and compares two runs bit for bit;
:mod:`~lmscli.prove.verify` is ``lms verify`` (identical results, memory measured by
:mod:`~lmscli.prove.measure` from TensorFlow's allocation records); :mod:`~lmscli.prove.standin`
is a stand-in GPU with a hard memory limit, on which :mod:`~lmscli.prove.realmem` proves a rewrite
at a limit and finds the smallest limit a step trains under; :mod:`~lmscli.prove.scratch` observes
traced steps (kernel scratch, the executor's order, op times) for predictions.
"""
