"""The tuning pass: which tensors may be swapped (:mod:`~lmscli.plan.candidates`) or recomputed
(:mod:`~lmscli.plan.recompute`), which gradient stacks may live on the host
(:mod:`~lmscli.plan.hoststacks`), the planners (:mod:`~lmscli.plan.planner`), the checks of a
plan's rewrite (:mod:`~lmscli.plan.judge`, :mod:`~lmscli.plan.optguard`), the loop that plans,
checks and plans again (:mod:`~lmscli.plan.tuning`), and the plan itself, the reviewable JSON
document they hand on (:mod:`~lmscli.plan.document`).
"""
