"""Memory a user can plan: weights + KV cache + activations, computed the one way both a
starting worker and `pdserve plan` use.

    KV budget   --num-blocks            exactly that many blocks
                --kv-cache-memory B     B bytes
                a device of M bytes     M * gpu_memory_utilization - weights - activation peak
                a CPU, none of these    1 GiB
    blocks      budget // bytes per block (every layer's K and V, plus a draft model's),
                never more than max_num_seqs full-length sequences need

The weight bytes are counted on the model itself: a worker counts what it loaded, a plan
builds the same model on torch's meta device (no memory, no weights read), so the two
agree for every scheme. The activation peak is measured on a GPU (a forward of
max_num_batched_tokens tokens before the KV cache exists); on a CPU, and in a plan, it
is the estimate `activation_estimate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.config import ModelConfig, resolve_dtype
from pdserve.engine.quant.config import kv_torch_dtype

if TYPE_CHECKING:  # torch loads on first use: `pdserve plan`'s parser and the launchers import this
    import torch

DEFAULT_CPU_KV_BYTES = 1 << 30
GIB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int
    weight_scheme: str  # "float32", or the quantization scheme's label ("int8/online")
    activation_peak_bytes: int
    kv_cache_dtype: str  # the pages' torch dtype: "float32", "float8_e4m3fn", ...
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    kv_cache_bytes: int  # num_blocks * kv_bytes_per_block
    num_blocks: int
    block_size: int
    max_model_len: int
    host_tier_bytes: int = 0  # the KV tiers below the device pool (engine/offload/), 0: off
    disk_tier_bytes: int = 0

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency(self) -> int:
        """Sequences of max_model_len tokens the KV cache holds at once."""
        return self.num_blocks // self.blocks_per_sequence

    def sequences_of(self, tokens: int) -> int:
        return self.num_blocks // -(-tokens // self.block_size)

    def log_line(self) -> str:
        return (f"memory: weights {self.weight_bytes} bytes ({self.weight_scheme}), activation peak "
                f"{self.activation_peak_bytes} bytes, kv {self.kv_cache_dtype} {self.kv_bytes_per_token} bytes/token, "
                f"{self.num_blocks} blocks of {self.block_size} ({self.kv_cache_bytes} bytes), max concurrency "
                f"{self.max_concurrency} at max_model_len {self.max_model_len}" + self._tiers())

    def _tiers(self) -> str:
        if not (self.host_tier_bytes or self.disk_tier_bytes):
            return ""
        return f"; kv offload: host tier {self.host_tier_bytes} bytes, disk tier {self.disk_tier_bytes} bytes"


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: torch.dtype) -> int:
    import torch

    return cfg.num_layers * 2 * cfg.kv_size * torch.empty((), dtype=kv_dtype).element_size()


def activation_estimate(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, dtype: torch.dtype) -> int:
    """The largest tensors alive in one forward of a full token budget: the residual
    stream and a layer's normed input, its fused q/k/v and attention output, its fused
    gate/up and their product, and fp32 logits for every sequence."""
    import torch

    elem = torch.empty((), dtype=dtype).element_size()
    per_token = 3 * cfg.hidden_size + cfg.q_size + 2 * cfg.kv_size + cfg.q_size + 3 * cfg.intermediate_size
    return max_num_batched_tokens * per_token * elem + min(max_num_seqs, max_num_batched_tokens) * cfg.vocab_size * 4


def kv_budget(*, num_blocks: int | None, kv_cache_memory: int | None, device_memory: int | None,
              gpu_memory_utilization: float, weight_bytes: int, activation_bytes: int, per_block: int) -> int | None:
    """The KV cache's bytes (None when `num_blocks` fixes the count)."""
    if num_blocks is not None:
        return None
    if kv_cache_memory is not None:
        return kv_cache_memory
    if device_memory is not None:
        budget = int(device_memory * gpu_memory_utilization) - weight_bytes - activation_bytes
        if budget < per_block:
            raise ValueError(
                f"gpu_memory_utilization: {gpu_memory_utilization} of {device_memory} bytes leaves {budget} bytes "
                f"after weights ({weight_bytes}) and activations ({activation_bytes}): no room for one KV block "
                f"of {per_block} bytes")
        return budget
    return DEFAULT_CPU_KV_BYTES


def count_blocks(budget: int | None, num_blocks: int | None, per_block: int, max_num_seqs: int,
                 max_model_len: int, block_size: int) -> int:
    if num_blocks is not None:
        return num_blocks
    assert budget is not None
    most = max_num_seqs * -(-max_model_len // block_size)  # never more than every sequence could use
    num = min(budget // per_block, most)
    if num < 1:
        raise ValueError(f"kv_cache_memory: {budget} bytes holds no block of {per_block} bytes")
    return int(num)


def plan_memory(
    model: str,
    *,
    dtype: str = "float32",
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    block_size: int = 16,
    max_model_len: int | None = None,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    device_memory: int | None = None,
    gpu_memory_utilization: float = 0.9,
    device: str = "cpu",
    enforce_eager: bool = False,
    kv_offload_host_bytes: int = 0,
    kv_offload_disk_bytes: int = 0,
) -> MemoryPlan:
    """What a worker started with these settings would allocate (no weights are read);
    on a CPU without `enforce_eager`, with the tied LM head's prepacked copy (captured
    decode steps share the weights: engine/captured.py). The KV tiers below the device
    pool (engine/offload/): the host tier holds whole blocks of its bytes, the disk
    tier's budget is taken as given."""
    import torch

    from pdserve.engine import prepacked
    from pdserve.engine.model.loader import build_model
    from pdserve.engine.quant import apply

    cfg = ModelConfig.from_dir(model)
    torch_dtype, _ = resolve_dtype(dtype, device, cfg.checkpoint_dtype)
    fmt, scheme = apply.resolve_scheme(model, quantization)  # type: ignore[arg-type]
    skeleton = build_model(cfg, torch_dtype, torch.device("meta"), 1, scheme, online=fmt is None)
    if fmt is None and scheme is not None:
        apply.quantize_model(skeleton, scheme)
    apply.prepare(skeleton)
    weights = apply.weight_bytes(skeleton)
    if not enforce_eager:
        weights += prepacked.added_bytes(skeleton, torch.device(device), torch_dtype)
    max_len = max_model_len or cfg.max_position_embeddings
    kv_dtype = kv_torch_dtype(kv_cache_dtype, torch_dtype)
    per_token = kv_bytes_per_token(cfg, kv_dtype)
    activations = activation_estimate(cfg, max_num_batched_tokens, max_num_seqs, torch_dtype)
    budget = kv_budget(num_blocks=num_blocks, kv_cache_memory=kv_cache_memory, device_memory=device_memory,
                       gpu_memory_utilization=gpu_memory_utilization, weight_bytes=weights,
                       activation_bytes=activations, per_block=per_token * block_size)
    blocks = count_blocks(budget, num_blocks, per_token * block_size, max_num_seqs, max_len, block_size)
    per_block = per_token * block_size
    return MemoryPlan(weights, scheme.label if scheme else str(torch_dtype).removeprefix("torch."), activations,
                      str(kv_dtype).removeprefix("torch."), per_token, per_block, blocks * per_block, blocks,
                      block_size, max_len, host_tier_bytes=kv_offload_host_bytes // per_block * per_block,
                      disk_tier_bytes=kv_offload_disk_bytes)
