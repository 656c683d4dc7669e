"""The in-process training probe: step and collective timing sent to the node agent.

    probe = gpuwatch.probe.start()      # after init_process_group
    for batch in data: train_step(batch); probe.step()

Tiny on purpose: stdlib only at import; torch is touched in start(), and only if the job has it.
"""
from gpuwatch.probe.probe import Probe, start

__all__ = ["Probe", "start"]
