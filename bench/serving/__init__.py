"""`pdserve bench` (`command`): an open-loop load generator against a router, with its
backends, workloads and metrics; and what serving over HTTP (`http`) and recording metrics
(`metrics_cost`) cost."""
