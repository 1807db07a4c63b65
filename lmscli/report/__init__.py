"""What lms shows people: :mod:`~lmscli.report.terminal` (Rich tables, ``[LMS]`` log lines),
:mod:`~lmscli.report.termchart` (the memory chart in the terminal), :mod:`~lmscli.report.plots`
(``--plot``, matplotlib), :mod:`~lmscli.report.html` (``--report``) and
:mod:`~lmscli.report.tensorboard` (``--tensorboard-logdir``). Nothing here computes a figure.
"""


SEARCH_WORDS = {"tflms_search": "the plan of the TFLMS-style search, the best candidate here"}


def parameters_line(params: dict) -> str:
    """A plan's ``parameters`` in words: ``{'tflms_search': {'swapout_threshold': 95}}`` (the hybrid
    or swap strategy took the TFLMS-style search's candidate) as "the plan of the TFLMS-style search, ...:
    swapout_threshold 95"; TFLMS's own parameters as ``swapout_threshold 95; ...`` (QA r49: a hybrid
    plan listing ``tflms_search`` did not say the hybrid had taken that search's plan)."""
    parts = []
    for key, value in params.items():
        if isinstance(value, dict):
            parts.append(f"{SEARCH_WORDS.get(key, key)}: " + ", ".join(f"{k} {v}" for k, v in value.items()))
        else:
            parts.append(f"{key} {value}")
    return "; ".join(parts)
