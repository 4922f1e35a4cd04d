"""The quantization benchmark's settings (bench/quant/schemes.py runs them; quant_transfer.py and
quant_cluster.py read them): its variants, its models, its quick and GPU presets."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.bench.engine.workload import QUICK_MODEL, QUICK_WORKLOAD, WorkloadSpec
from pdserve.bench.common.random_model import ModelSpec

MIB = 1 << 20


@dataclass(frozen=True)
class Variant:
    """One engine configuration: weights' scheme (None: the base dtype) and KV dtype."""

    name: str
    quantization: str | None = None
    kv_cache_dtype: str = "auto"


VARIANTS = (
    Variant("base"), Variant("int8", "int8"), Variant("int4", "int4"), Variant("fp8", "fp8"), Variant("fp4", "fp4"),
    Variant("kv_fp8_e4m3", kv_cache_dtype="fp8_e4m3"), Variant("kv_fp8_e5m2", kv_cache_dtype="fp8_e5m2"),
    Variant("int8+kv_fp8", "int8", "fp8_e4m3"),
)
GPU_MODEL = ModelSpec(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=5632,
                      vocab_size=32000, max_position_embeddings=2048)


@dataclass(frozen=True)
class QuantBenchConfig:
    model: ModelSpec = ModelSpec()
    workload: WorkloadSpec = WorkloadSpec()
    variants: tuple[Variant, ...] = VARIANTS
    kv_cache_memory: int = 256 * MIB  # every engine's KV budget: holds the workload in the base dtype
    decode_batch: int = 16
    decode_prompt: int = 120  # decode_batch * decode_prompt <= max_num_batched_tokens: one prefill step
    decode_steps: int = 8
    transfer_prompt: int = 1008  # tokens: 63 whole blocks, within the model's 1024 positions
    transfer_reps: int = 5  # per repetition, the engine pair
    cluster_prompts: int = 4  # per repetition, through the 1P+1D cluster
    gemm_min_seconds: float = 0.2
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    repeats: int = 3
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"  # the base; bfloat16 on a GPU
    fp4_throughput: bool = False  # on a CPU: fp4 dequantizes every weight on every call
    transfer_only: bool = False  # only the KV transfer parts (engine pair, cluster)
    quick: bool = False

    def throughput_of(self, variant: Variant) -> bool:
        return variant.quantization != "fp4" or self.device != "cpu" or self.fp4_throughput or self.quick


QUICK = QuantBenchConfig(model=QUICK_MODEL, workload=QUICK_WORKLOAD, kv_cache_memory=4 * MIB, decode_batch=4,
                         decode_prompt=32, decode_steps=4, transfer_prompt=128, transfer_reps=3,
                         cluster_prompts=2, gemm_min_seconds=0.01, repeats=2, quick=True)
GPU = QuantBenchConfig(model=GPU_MODEL, workload=replace(WorkloadSpec(), num_requests=64), kv_cache_memory=4 << 30,
                       decode_batch=32, decode_prompt=64, decode_steps=16, transfer_prompt=2000, device="cuda",
                       dtype="bfloat16")
