"""End-to-end tier: real `hotlora` processes, the CLI and a uvicorn server on the embedded model."""
