"""Values the user feeds placeholders (``--feed NAME=VALUE``): checked against the placeholder's
type and spread over its shape, for the steps lms runs (:func:`lmscli.prove.steps.feeds`) and for
the loop bounds its model computes from them (:class:`lmscli.graph.loopvalues.Evaluator`)."""

from __future__ import annotations

from lmscli.errors import InputError


def check(feed_values: dict, dtypes: dict) -> None:
    """``feed_values`` name placeholders of ``dtypes`` (placeholder name -> its TensorFlow type) and
    give values of their types, else an input error naming the placeholders there are, or what
    the placeholder takes."""
    unknown = sorted(set(feed_values) - set(dtypes))
    if unknown:
        names = sorted(dtypes)
        listed = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        raise InputError(f"--feed {unknown[0]}: the graph has no placeholder of that name (its placeholders: "
                         f"{listed or 'none'})")
    for name, value in feed_values.items():
        checked(name, value, dtypes[name])


def shown(value) -> str:
    """A --feed value as written on the command line (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


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
                             f"not {shown(value)}")
        return int(value)
    if isinstance(value, bool):
        raise InputError(f"--feed {name}: a placeholder of type {dtype.name} takes a number, not {shown(value)}")
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
