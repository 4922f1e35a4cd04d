"""The Ray launcher's settings (launch/ray.py), importable without Ray: `pdserve up`
offers these flags whichever launcher runs."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.services.common.flags import check, flag


@dataclass(frozen=True)
class RayConfig:
    address: str | None = flag(None, "Ray cluster to join: auto | HOST:PORT (none: start one on this machine)")
    ray_prefill_resource: str = flag("pdserve_prefill", "custom resource a prefill worker takes one unit of ('': none)")
    ray_decode_resource: str = flag("pdserve_decode", "custom resource a decode or mixed worker takes one unit of "
                                                      "('': none)")
    ray_prefill_accelerator_type: str | None = flag(None, "accelerator type prefill workers need (e.g. H100)")
    ray_decode_accelerator_type: str | None = flag(None, "accelerator type decode and mixed workers need (e.g. H200)")
    ray_gpus_per_worker: int | None = flag(None, "GPUs per worker, packed on one node (default: 1 with --device "
                                                 "cuda, else 0)")
    ray_cpus_per_worker: float = flag(1.0, "CPUs each worker reserves")
    ray_max_restarts: int = flag(3, "times Ray restarts a worker whose process died (-1: without limit)")

    def __post_init__(self) -> None:
        check(self.ray_gpus_per_worker is None or self.ray_gpus_per_worker >= 0, "ray_gpus_per_worker",
              "must be >= 0", self.ray_gpus_per_worker)
        check(self.ray_cpus_per_worker > 0, "ray_cpus_per_worker", "must be > 0", self.ray_cpus_per_worker)
        check(self.ray_max_restarts >= -1, "ray_max_restarts", "must be >= -1", self.ray_max_restarts)

    def gpus(self, device: str) -> int:
        if self.ray_gpus_per_worker is not None:
            return self.ray_gpus_per_worker
        return 1 if device.startswith("cuda") else 0

    def resource(self, role: str) -> str:
        return self.ray_prefill_resource if role == "prefill" else self.ray_decode_resource

    def accelerator_type(self, role: str) -> str | None:
        return self.ray_prefill_accelerator_type if role == "prefill" else self.ray_decode_accelerator_type

    def bundles(self, role: str, device: str, host_tier_bytes: int = 0) -> list[dict[str, float]]:
        """The placement group of one worker: bundle 0 holds the actor (its CPUs, its
        first GPU, its pool's resource, the host memory of its KV tier as Ray's
        `memory`), one more bundle per further GPU."""
        first: dict[str, float] = {"CPU": self.ray_cpus_per_worker}
        if host_tier_bytes:
            first["memory"] = host_tier_bytes
        if self.resource(role):
            first[self.resource(role)] = 1
        if self.accelerator_type(role):
            first[f"accelerator_type:{self.accelerator_type(role)}"] = 0.001  # Ray's own unit for it
        gpus = self.gpus(device)
        if gpus:
            first["GPU"] = 1
        return [first] + [{"GPU": 1} for _ in range(gpus - 1)]
