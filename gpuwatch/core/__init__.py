"""The shared core every component builds on: fields, events, wire batches, recordings, settings, security.

Nothing here imports a component (agent, probe, collector, efficiency, models, simulator) or an application.
"""
