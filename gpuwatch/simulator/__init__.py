"""The simulator: a fake NVML library with GPU physics and scripted faults, simulated training jobs, fleets with
failures, and a stand-in collector. Agents and tests are pointed at it; production code never imports it.
"""
