"""`bench advise` and the trade-off report: measured cost (speed runs) joined with measured loss (quality runs)."""
