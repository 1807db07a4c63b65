"""What lms shows people: :mod:`~lmscli.report.terminal` (Rich tables, ``[LMS]`` log lines),
:mod:`~lmscli.report.termchart` (the memory chart in the terminal), :mod:`~lmscli.report.plots`
(``--plot``, matplotlib), :mod:`~lmscli.report.html` (``--report``) and
:mod:`~lmscli.report.tensorboard` (``--tensorboard-logdir``). Nothing here computes a figure.
"""
