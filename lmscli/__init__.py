"""lms: offline large-model-support rewriting for TensorFlow training graphs.

The package is a typed library with a thin CLI on top (``lmscli.cli``).
The Python API lives in :mod:`lmscli.api`; TensorFlow is imported lazily,
only by the modules that need it.
"""

__version__ = "0.1.0"
