"""The memory plan (python -m workbench.plan): tables <- tracer <- report <- gate (before a launch), measure (in it)."""
