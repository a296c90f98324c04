"""How the agent configures a compute worker subprocess (agent.runtime.worker): the environment
variables it reads before importing numpy. stdlib only, importable by both sides."""

CORES_ENV = "PHALANX_WORKER_CORES"
BACKEND_ENV = "PHALANX_WORKER_BACKEND"
THREADS_ENV = "PHALANX_WORKER_THREADS"

# glibc's malloc (Linux agents; Android's bionic ignores it) returns a freed block above its
# mmap threshold to the kernel at once and trims the heap's free top past 128 KiB, so each
# shard's activations and gradients (MBs each) came back as fresh, zeroed pages: every shard
# paid for its page faults again (27-31 ms a cnn shard instead of 23, bench/phone_cores.py).
# A worker keeps blocks up to 32 MiB in its heap and up to 64 MiB of it free instead.
MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864"


def with_malloc_tunables(operators: str | None) -> str:
    """GLIBC_TUNABLES for a worker: the operator's own, then ours that they do not set."""
    theirs = [t for t in (operators or "").split(":") if t]
    named = {t.split("=", 1)[0] for t in theirs}
    return ":".join(theirs + [t for t in MALLOC_TUNABLES.split(":")
                              if t.split("=", 1)[0] not in named])
