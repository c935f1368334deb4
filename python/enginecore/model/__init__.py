"""Model side: architecture configs, loaders (HF directory, GGUF), the torch
Llama-family model on a paged KV cache, the sampler and the model runner."""
