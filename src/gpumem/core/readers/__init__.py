"""Reading memory: typed readings in bytes from PyTorch's caching allocator, NVML and the host process,
and the state of torch and CUDA that decides what can be read."""
