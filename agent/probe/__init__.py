"""The in-process training probe (gpuwatch.probe)."""
