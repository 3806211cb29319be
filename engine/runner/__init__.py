"""The tensor side of the engine: the ``ModelRunner`` (batch tensors, the forward pass,
CUDA graphs or the compiled forward), the KV page formats and their tensors, the host
tier's swapper and the mixed-precision arena. It turns the scheduler's output into tensor
work through ``kernels``; nothing here decides what the cache holds."""
