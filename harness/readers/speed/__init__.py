"""A `bench run` sweep read back: its rows as a frame, what they say (exponents, crossovers), its figures and
report section, and two runs compared."""
