"""The engine core: requests, scheduling over the paged KV cache, sampling, structured output, speculation. It knows nothing about Redis."""
