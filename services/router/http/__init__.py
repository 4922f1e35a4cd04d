"""The OpenAI-compatible HTTP API of the router (FastAPI on uvicorn), beside gRPC."""
