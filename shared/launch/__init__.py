"""`skiff serve MODEL.gguf`: every Skiff role as a process on this machine.

Owns what one-machine serving needs around the services themselves: which devices get a worker,
the free ports that join the gateway and the workers, the command line of each process, their
output (every line prefixed with the process's name), readiness (the gateway's /health), and
shutdown (terminate, then kill). The services are started exactly as compose.yaml starts them
(`python -m services.gateway`, `python -m services.decode`, `python -m services.prefill` with
`--prefill-devices`), so both paths run the same code.

Imports no torch: CUDA devices are counted in a short-lived subprocess, so the supervisor holds
neither torch's memory nor a CUDA context while the workers own the devices.
"""

from shared.launch.devices import count_cuda_devices, resolve_devices
from shared.launch.plan import (
    DTYPES,
    Endpoints,
    Plan,
    ServeConfig,
    add_serve_arguments,
    local_endpoints,
    plan_processes,
    resolve_split,
)
from shared.launch.supervise import Child, Console, ready_workers, serve, supervise

__all__ = [
    "DTYPES",
    "Child",
    "Console",
    "Endpoints",
    "Plan",
    "ServeConfig",
    "add_serve_arguments",
    "count_cuda_devices",
    "local_endpoints",
    "plan_processes",
    "ready_workers",
    "resolve_devices",
    "resolve_split",
    "serve",
    "supervise",
]
