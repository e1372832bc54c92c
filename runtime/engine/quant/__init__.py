"""Weights kept quantized (``--quantization``): the layouts (``weight``), GGUF's blocks repacked
into them (``gguf_blocks``) and how a layer's loader keeps them (``loading``)."""
