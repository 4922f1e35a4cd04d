"""The router: public Generation API, validation, routing, streaming, retries."""
