"""How the agent configures a compute worker subprocess (agent.runtime.worker): the environment
variables it reads before importing numpy. stdlib only, importable by both sides."""

CORES_ENV = "PHALANX_WORKER_CORES"
BACKEND_ENV = "PHALANX_WORKER_BACKEND"
THREADS_ENV = "PHALANX_WORKER_THREADS"
