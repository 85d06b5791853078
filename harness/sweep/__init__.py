"""`bench run`: the sweep's schema (config.py, torch-free), planning, the cell worker, the executors and the session that owns a run's life. Imports nothing itself, so the schema stays torch-free."""
