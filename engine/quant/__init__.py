"""Quantization: weight schemes (int8, int4, fp8, fp4), checkpoint formats
(compressed-tensors, GPTQ), quantized linear layers, and the FP8 KV cache's dtype and
scales. The model imports the layers; the loader reads the formats."""
