"""Byte units, defined once."""

GiB = 1024**3
MiB = 1024**2
