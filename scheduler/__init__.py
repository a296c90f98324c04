"""The Phalanx scheduler: Celery app, reconcile loop, placement policy, step application."""
