"""Layout planning (issue 32): a memory model calibrated by measurement, a time model on the pipeline
simulator's bubbles, and the planner that ranks layouts with both (``tools/plan_layout.py``)."""
