"""A simulated node to point an agent at: ``gpuwatch agent --simulate N --sim-*`` in one object.

The agent reads GPUs only through pynvml, process environments through a reader it is given, and job spans only
through its probe intake; it knows nothing of the simulator. :class:`SimulatedNode` is what the application
layer installs beneath it: a :class:`~gpuwatch.simulator.fleet.SimulatedFleet` on a
:class:`~gpuwatch.simulator.clock.SimClock` (installed beneath pynvml while the node is entered), the scripted
degradations of ``--sim-fault``, and the synthetic training job of ``--sim-job``, whose spans reach the agent
as a span source like a probe's. ``clock``, ``environ`` and ``span_sources`` are what the agent is handed.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from gpuwatch.simulator.clock import SimClock
from gpuwatch.simulator.degrade import Degradation, FaultSpec
from gpuwatch.simulator.fail_slow import FailSlowDriver, FailSlowSpec, SlowRanks
from gpuwatch.simulator.fleet import SimulatedFleet
from gpuwatch.simulator.host import SimHost
from gpuwatch.simulator.job import SimJob
from gpuwatch.v1 import telemetry_pb2 as pb


class SimulatedNode:
    """``gpus`` simulated ``model`` GPUs named ``node``, on simulated time running ``speed`` x the wall clock.

    ``start``/``origin`` place the clock (:class:`SimClock`; or ``clock`` is one, e.g. stepped by a test);
    ``faults`` degrade GPUs from ``start`` on;
    ``job`` runs a synthetic training job of that id on every GPU (one rank each, steps of ``job_step_s``
    simulated seconds). ``fail_slow`` slows GPUs (or the host) of that job as :mod:`~gpuwatch.simulator.fail_slow`
    describes, and the job then has no built-in straggler (the injections decide who is slow; ``job_straggler``
    False also turns it off) and each compute chunk jitters by ``job_jitter`` as a real job's does.
    With a job or a fail-slow, the host metrics are simulated too (:class:`~gpuwatch.simulator.host.SimHost`).
    Raises ValueError naming the bad value (a model, a speed, a fault on a GPU the node lacks).
    """

    def __init__(self, gpus: int, *, node: str = "sim", model: str = "H100", speed: float = 1.0,
                 start: float | None = None, origin: float | None = None, faults: Sequence[FaultSpec] = (),
                 job: str | None = None, job_step_s: float = 1.0, fail_slow: Sequence[FailSlowSpec] = (),
                 job_straggler: bool = True, job_jitter: float | None = None, clock: SimClock | None = None) -> None:
        self.model = model
        self.clock = clock if clock is not None else SimClock(speed, start, origin)
        self.fleet = SimulatedFleet(gpus, model=model, node=node, clock=self.clock, job_id=job)
        slow = SlowRanks(fail_slow, self.clock.start)
        jitter = job_jitter if job_jitter is not None else (0.02 if fail_slow or not job_straggler else 0.0)
        self.job = (SimJob(job, node, self.clock, ranks=gpus, step_s=job_step_s,
                           straggler=job_straggler and not fail_slow, jitter=jitter, slow=slow) if job else None)
        self.host = SimHost(node, self.clock, slow.host_saturated) if job or fail_slow else None
        for spec in faults:  # a GPU the node lacks: ValueError from drive()
            self.fleet.drive(spec.gpu, Degradation.from_spec(spec, node, self.clock.start))
        for slow_spec in fail_slow:
            self.fleet.drive(slow_spec.gpu, FailSlowDriver(slow_spec, self.clock.start))

    @property
    def environ(self) -> Callable[[int], dict[str, str] | None]:
        """The environment of a simulated training process by PID (the agent's /proc/<pid>/environ)."""
        return self.fleet.environ

    @property
    def span_sources(self) -> list[Callable[[], pb.SpanTable]]:
        """The synthetic job's finished steps, drained like a probe listener's spans (none without a job)."""
        return [self.job.spans] if self.job is not None else []

    def __enter__(self) -> SimulatedNode:
        self.fleet.install()
        return self

    def __exit__(self, *exc) -> None:
        self.fleet.uninstall()
