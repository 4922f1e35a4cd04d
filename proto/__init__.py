"""pdserve protocol buffers, by versioned package."""
