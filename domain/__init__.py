"""The domain the API and the scheduler both stand on: the store (models, transitions, the rules
that read and write them), settings, domain errors (no HTTP in them) and the task metrics.
It imports neither `api` nor `scheduler`."""
