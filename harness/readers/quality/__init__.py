"""A `bench quality` run read back: accuracy, distance and cost tables, the figures and the report section."""
