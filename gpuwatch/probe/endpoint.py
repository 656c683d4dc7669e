"""Where the probe sends its records and where the agent listens: one rule for both sides."""
from __future__ import annotations

import os
from collections.abc import Mapping

SYSTEM_DIR = "/run/gpuwatch"
ENV_VAR = "GPUWATCH_PROBE_SOCKET"


def default_endpoint(env: Mapping[str, str] | None = None) -> str:
    """$GPUWATCH_PROBE_SOCKET, else /run/gpuwatch/probe.sock when that directory is writable, else
    $XDG_RUNTIME_DIR/gpuwatch-probe.sock, else /tmp/gpuwatch-probe-<uid>.sock."""
    env = os.environ if env is None else env
    if env.get(ENV_VAR):
        return env[ENV_VAR]
    if os.path.isdir(SYSTEM_DIR) and os.access(SYSTEM_DIR, os.W_OK):
        return os.path.join(SYSTEM_DIR, "probe.sock")
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "gpuwatch-probe.sock")
    return f"/tmp/gpuwatch-probe-{os.getuid()}.sock"
