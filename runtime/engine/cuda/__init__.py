"""The GPU wing: everything that exists only to make cuda fast (the CPU's is ``runtime.engine.cpu``).

- ``triton_common``: where a Triton kernel runs (compiled on cuda, interpreted on a CPU in
  tests) and the launch checks every kernel here shares;
- ``kernels``: the layers' Triton kernels (fused residual-add + RMSNorm, rotary, silu*mul,
  the KV store); ``ops``: ``TritonOps``, the device-ops seam's cuda implementation over them;
- ``attention_kernels``: the Triton attention kernels over the paged KV pool (decode, extend,
  kv_indices); ``attention``: ``TritonAttnBackend``, the attention backend that plans for them;
- ``graph_runner``: decode forwards captured as CUDA graphs and replayed.

Importing this package imports nothing: Triton decides between compiled and interpreted mode
when it is first imported, so each module is imported where it is first needed.
"""
