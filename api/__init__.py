"""The Phalanx control plane: FastAPI routes, schemas, auth and the store."""
