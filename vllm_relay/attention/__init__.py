"""vLLM V1 glue: the relay attention backends. No math here; kernels live in vllm_relay.ops."""
