"""What a run reports: the metrics dict per step, the console, experiment trackers, run reports and
comparisons.
"""
