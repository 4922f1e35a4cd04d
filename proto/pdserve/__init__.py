"""pdserve protocol packages."""
