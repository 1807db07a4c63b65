"""The Python API: the same passes the CLI runs, for scripted pipelines.

>>> from lmscli import api
>>> model = api.load("sample_graphs/cnn.meta")
>>> prepared = api.prepare(model)
>>> facts = api.analyze(prepared)
>>> facts.peak_bytes > 0
True
"""

from __future__ import annotations

from lmscli.analysis import Analysis, Prepared, analyze, prepare
from lmscli.loader import Model, atomic_write, load, serialize

__all__ = ["Analysis", "Model", "Prepared", "analyze", "atomic_write", "load", "prepare", "serialize"]
