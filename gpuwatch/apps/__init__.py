"""The applications: the `gpuwatch` command line, demo, replay, import and export.

They assemble the components; nothing below imports them.
"""
