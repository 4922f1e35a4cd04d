"""Decode role: Reserve (blocks for remotely prefilled KV) and the Decode token stream."""
