"""Values the user feeds placeholders (``--feed NAME=VALUE``): checked against the placeholder's
type and spread over its shape, for the steps lms runs (:func:`lmscli.prove.steps.feeds`) and for
the loop bounds its model computes from them (:class:`lmscli.graph.loopvalues.Evaluator`)."""

from __future__ import annotations

from lmscli.errors import InputError


def checked(name: str, value, dtype):
    """``value`` (a bool, int or float) if a placeholder of TensorFlow type ``dtype`` can hold it
    exactly, else an input error saying what it takes (``2.5`` is no sequence length)."""
    if dtype.name == "string" or not dtype.is_numpy_compatible:
        raise InputError(f"--feed {name}: a placeholder of type {dtype.name} takes no number")
    if dtype.is_bool:
        if not (isinstance(value, bool) or value in (0, 1)):
            raise InputError(f"--feed {name}: a bool placeholder takes true or false, not {value}")
        return bool(value)
    if dtype.is_integer:
        if isinstance(value, (bool, float)) or not dtype.min <= value <= dtype.max:
            raise InputError(f"--feed {name}: a placeholder of type {dtype.name} takes an integer within its range, "
                             f"not {str(value).lower() if isinstance(value, bool) else value}")
        return int(value)
    if isinstance(value, bool):
        raise InputError(f"--feed {name}: a placeholder of type {dtype.name} takes a number, not {str(value).lower()}")
    return value


def filled(name: str, value, shape, dtype, batch_size: int):
    """A numpy array of placeholder ``name``'s shape (unknown dimensions: ``batch_size``) holding
    ``value`` everywhere: ``--feed lengths=128`` gives every sequence of a ``[None]`` length
    placeholder the length 128."""
    import numpy as np

    value = checked(name, value, dtype)
    if shape.rank is None:
        raise InputError(f"--feed {name}: the placeholder has no known rank, so lms cannot shape a value for it")
    return np.full([batch_size if d is None else d for d in shape.as_list()], value, dtype=dtype.as_numpy_dtype)
