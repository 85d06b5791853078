"""`bench lm`: a pretrained model with each attention (run.py) and the run's life (session.py)."""
