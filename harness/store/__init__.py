"""A run directory's format: rows, JSONL files, metadata, the lock, start and resume. Imports no torch."""
