"""The composition roots: where a process's parts are chosen and put together, and nowhere
else. `roots.api` builds an API process (the web app with its scheduler port); `roots.worker`
a Celery worker or beat process. Nothing below imports this package."""
