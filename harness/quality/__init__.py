"""`bench quality`: its schema and presets (config.py, torch-free), the tasks, training, planning and session. Imports nothing itself."""
