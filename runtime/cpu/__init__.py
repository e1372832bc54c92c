"""The CPU wing: everything that exists only to make the CPU fast.

- ``kernels`` (+ ``csrc/cpu_kernels.c``): the bf16 C kernels, compiled on first use;
- ``prepacked``: oneDNN-prepacked weights for half-precision linears;
- ``ops``: ``CpuOps``, the device-ops seam's CPU implementation (the layers' C kernels
  and prepacked linears behind ``runtime.ops``);
- ``attention`` and ``decode_mirror``: the torch-native attention backend's CPU fast paths
  (cascade over shared prefixes, the C decode/prefill kernels, the dense decode-key mirror);
- ``host_memory``: MemAvailable and glibc's allocator settings for a CPU serving process.

Nothing outside this package tests for the CPU: ``runtime.ops.get_ops`` and the attention
registry pick these implementations once, by device.
"""
