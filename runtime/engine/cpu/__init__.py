"""The CPU wing: everything that exists only to make the CPU fast.

- ``kernel_library``: builds ``csrc/*.c`` once per instruction-set level (AVX-512 + BF16 with
  AMX where present, AVX-512, AVX2, plain C) and loads the best one this CPU runs;
- ``kernels`` and ``attention_kernels`` (+ ``attention_kernels_f32``, ``attention_abi``): the C kernels' wrappers,
  bf16 and fp32;
- ``prepacked``: packed copies of the linears' weights (oneDNN's layouts, the fp32 panels) and the
  calls of the kernels that read them;
- ``weight_plan``: ``CpuWeightPlan``, each linear weight's kernel at each row count, made once and
  owned by its layer: the one place that decides which kernel runs a weight;
- ``quant_kernels``: products on weights kept quantized (or a dual weight's blocks);
- ``decode_layers`` and ``stack_description``: ``CpuLayerStack``, a decode step's decoder layers in
  one C call (the layer stack ``CpuOps.layer_stack`` gives the model runner), and the per-model
  description it runs from (which declared layer choices the C layer implements, every weight's address);
- ``ops``: ``CpuOps``, the device-ops seam's CPU implementation (the layers' C kernels
  and prepacked linears behind ``runtime.engine.ops``);
- ``attention``, ``attention_plan`` and ``decode_mirror``: the torch-native attention backend's
  CPU fast paths (``CpuAttnBackend``: cascade over shared prefixes, the C decode/prefill kernels,
  the dense decode-key mirror) and the plan fields they add (``CpuAttnGroup``);
- ``host_memory``: MemAvailable and glibc's allocator settings for a CPU serving process, and
  ``CPU_PLATFORM``, the KV memory defaults the model runner gets from ``CpuOps.platform``.
- ``process_env``: the OpenMP environment the serving processes start with (imports nothing:
  ``launch.py`` reads it before any child, without torch);

Layers and the model runner never test for the CPU: ``runtime.engine.ops.get_ops`` and the attention
registry pick these implementations once, by device (and the device-neutral ops, which run on
either device, answer ``platform`` by it).
"""
