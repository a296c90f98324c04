"""The step protocol's transport: handlers shared by the routes, the ASGI fast path and the bulk
listener; the bulk listener (its own port for weights and uploads); the whole-body reader for
gradient uploads on the API port."""
