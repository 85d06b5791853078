"""A `bench lm` run read back: its tables, figures, the KV sweep's frontier and the report."""
