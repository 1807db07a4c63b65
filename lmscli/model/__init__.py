"""The model of a training step: what it runs, in which order, and what memory and time that takes.

:mod:`~lmscli.model.schedule` orders the ops a step runs (Grappler's virtual scheduler, an order
observed on the stand-in, or :mod:`~lmscli.model.costmodel`'s roofline) and lists the tensors each
holds; :mod:`~lmscli.model.loops` sizes what v1 while loops keep across iterations;
:mod:`~lmscli.model.memmodel` says what the executor and allocator do with buffers; and
:mod:`~lmscli.model.simulator`, a pure function, plays a schedule with swaps and recomputations.
"""
