"""Plans checked before submitting: the step time a layout will take (steptime.py), fitted to a
finished run (calibration.py), and the layouts a node budget allows, ranked (advice.py)."""
