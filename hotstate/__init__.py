"""Hot state: what the step protocol and the scheduler share in Redis (or in memory when
embedded): keys, blob store, gradient references, state blobs, upload bodies, locks, the
version key. Below both api and scheduler; recomputable or restorable from a checkpoint."""
