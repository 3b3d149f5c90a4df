"""`elastic-control tune`: a search over training settings, each candidate a real job judged on held-out lines.

space.py (what is searched), split.py (which lines judge), candidates.py (one candidate's folder, data.config
and worker), study.py (Optuna: sampling, pruning, resume), references.py (logistic regression, production),
leaderboard.py (the result), tracking.py (MLflow), apply.py (the winner into the plan), kube.py (Volcano
manifests), search.py (all of it as one library call), cli.py (the click layer).
"""
