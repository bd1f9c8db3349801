"""The model and how it runs: the Llama-family forward pass, its compiled and CUDA-graph forms, KV cache memory."""
