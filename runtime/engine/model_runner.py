"""ModelRunner: owns the model, the KV memory and the attention backend of one TP rank.

The scheduler hands it a ForwardBatch (packed tokens, KV slots already allocated) and
gets back the next token of each request. Memory sizing happens once at start-up:
the KV pool takes what is left of the memory budget after the weights.

Everything that differs by device comes from the device ops (``runtime.engine.ops``), asked once:
the memory defaults and whether decode may run in CUDA graphs (``DeviceOps.platform``), and
the device's own way of running the decoder layers (``DeviceOps.layer_stack``: the CPU's
one-call decode stack), which every eager forward hands to the model.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from memory.kv_format import KVCacheFormat, kv_cache_format
from memory.kv_pool import MHATokenToKVPool, kv_bytes_per_token
from memory.req_to_token_pool import ReqToTokenPool
from memory.swa_kv_pool import SWAKVPool, swa_pool_sizes
from runtime.checkpoints.model_source import checkpoint_folder
from runtime.checkpoints.pooling import PoolingSpec
from runtime.engine.attention.base import AttentionBackend
from runtime.engine.attention.registry import (
    create_attention_backend,
    get_attention_backend_class,
    resolve_attention_backend_name,
)
from runtime.engine.cuda.graph_runner import CudaGraphRunner, eager_forward, setup_cuda_graphs
from runtime.engine.cuda.triton_common import interpreted_dtype
from runtime.engine.device import (
    concrete_device,
    cpu_has_amx,
    cpu_supports_bf16,
    dtype_reason,
    resolve_device,
    resolve_dtype,
)
from runtime.engine.distributed import get_tp_group
from runtime.engine.forward_batch import ForwardBatch, InputLogprobRows
from runtime.engine.kv_sizing import KVPoolSize, check_weights_fit, kv_pool_tokens
from runtime.engine.loading.kv_scales import checkpoint_kv_scales
from runtime.engine.loading.weight_loader import gguf_footprint, load_model_weights, weight_bytes_estimate
from runtime.engine.loading.weight_reload import reload_weights
from runtime.engine.lora.manager import LoraManager, LoraSettings
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.base import CausalLM
from runtime.engine.models.registry import get_model_class
from runtime.engine.ops import DeviceOps, LayerStack, get_ops
from runtime.engine.ops.linear_weights import resident_tensor_bytes
from runtime.engine.pooling import pooled_parts
from runtime.engine.quant import loading as quant_loading
from runtime.engine.quant.loading import DUAL_RAM_SHARE, activation_numerics, quantized_bytes, resolve_quantization
from runtime.engine.sampling.sampler import Sampler

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 512
# What a LoRA server's kernel report says of the steps that carry adapters.
LORA_PATH_NOTE = (
    "each adapted linear adds its adapters' products after its base product (DeviceOps.lora_add), in the "
    "device's layer stack too where it has one (the CPU's one-call decode stack, in C); a step with adapters "
    "runs no CUDA graph"
)


@dataclass
class ModelOutput:
    next_token_ids: torch.Tensor  # int64 [bs]
    logprobs: torch.Tensor | None = None  # float32 [bs]: log_softmax of the raw logits at the chosen token
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None  # (values [bs, k], ids [bs, k])
    # token_ids_logprob: float32 [bs, width], each row's logprobs at its ids (SamplingBatchInfo's index)
    token_ids_logprobs: torch.Tensor | None = None
    logits: torch.Tensor | None = None  # float32 [bs, vocab]: raw logits (for tests / debugging)
    # Prompt logprobs, when the batch asks (``ForwardBatch.input_logprobs``): float32 [m], one per
    # prompt row, and with top_logprobs_num the k best of each row (values [m, k], ids [m, k]).
    input_token_logprobs: torch.Tensor | None = None
    input_top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None
    # and with token_ids_logprob, float32 [m, width]: each prompt row's logprobs at its ids
    input_token_ids_logprobs: torch.Tensor | None = None
    # An embedding forward's (``pooling``): float32 [bs, width], each request's part of its pooled
    # vector (runtime.engine.pooling); next_token_ids are then zeros, never read.
    pooled: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        attention_backend: str = "auto",
        max_total_tokens: int | None = None,
        mem_fraction_static: float | None = None,
        page_size: int = 1,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        ep_size: int = 1,
        dp_size: int = 1,
        random_seed: int = 0,
        load_progress: bool = True,
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int | None = None,
        cuda_graph_bs: list[int] | None = None,
        swa_full_tokens_ratio: float = 0.8,
        disable_hybrid_swa_memory: bool = False,
        kv_cache_dtype: str = "auto",
        quantization: str | None = None,
        int8_activations: bool = False,
        pooling: PoolingSpec | None = None,
        lora: LoraSettings | None = None,
    ) -> None:
        """``pooling``: an embedding server's rule (--is-embedding): every forward pools hidden states
        instead of sampling (``runtime.engine.pooling``). ``lora``: serve LoRA adapters over the model
        (``runtime.engine.lora``): each batch says which of its requests use which. ``kv_cache_dtype``
        (--kv-cache-dtype): the KV cache's format (``memory.kv_format``)."""
        start = time.perf_counter()
        self.pooling = pooling
        self.model_path = checkpoint_folder(str(model_path))  # a GGUF file or a model name works too
        self.device = concrete_device(resolve_device(device))
        self.attention_backend_name = resolve_attention_backend_name(attention_backend, self.device)
        if dtype == "auto" and self.attention_backend_name == "triton":
            dtype = interpreted_dtype(self.device) or dtype  # the Triton interpreter gets bf16 math wrong
        platform = get_ops(self.device, torch.float32).platform(self.device)
        host_ram = platform.ram_bytes() if platform.ram_bytes is not None else 0
        footprint = gguf_footprint(self.model_path)  # (None: not a GGUF file's folder)
        native_bf16 = cpu_supports_bf16()  # the CPU class, read once: every rule below follows it
        quantization, quantization_why = resolve_quantization(
            quantization,
            dtype,
            self.device,
            footprint,
            native_bf16,
            cpu_has_amx(),
            int(host_ram * DUAL_RAM_SHARE) // max(dp_size, 1),
        )
        self.dtype = resolve_dtype(dtype, self.device, quantization, native_bf16)
        self.bf16_prefill = quant_loading.bf16_prefill(quantization, dtype, self.device, native_bf16)  # same class
        # Device-specific work (fused kernels, prepacked weights, process settings): picked once.
        self.ops: DeviceOps = get_ops(self.device, self.dtype)
        self.ops.prepare_process()
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.dp_size = dp_size  # (CPU: the host's schedulers, tp_size x dp_size, share its RAM budget)
        self.page_size = page_size
        self.random_seed = random_seed
        torch.manual_seed(random_seed)

        # ep_size: of the tp_size ranks, the groups that each hold whole experts (a mixture of experts)
        self.ep_size = ep_size
        self.model_config = ModelConfig.from_pretrained(self.model_path, context_length=context_length, ep_size=ep_size)
        cfg = self.model_config
        self.context_len = cfg.context_len
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = list(cfg.eos_token_ids)
        # (the scheduler keeps each request's KV on one side of it: scheduler_proc.long_rope)
        self.rope_switch_len = cfg.rope_switch_len
        logger.info(
            "loading %s (%s, %d layers, hidden %d) on %s as %s (%s), weights %s (%s; %s), tp %d/%d",
            self.model_path,
            cfg.architecture,
            cfg.num_hidden_layers,
            cfg.hidden_size,
            self.device,
            self.dtype,
            dtype_reason(dtype, self.device, quantization, native_bf16),
            f"kept quantized ({quantization})" if quantization else "dense",
            quantization_why,
            activation_numerics(quantization, int8_activations, self.bf16_prefill),
            tp_rank,
            tp_size,
        )

        if max_total_tokens is None:  # (a pool given outright: the user sized the memory)
            share = mem_fraction_static if mem_fraction_static is not None else platform.mem_fraction
            ranks = tp_size * dp_size
            check_weights_fit(
                weight_bytes_estimate(self.model_path, self.dtype, quantization, footprint) // tp_size,
                platform.budget_bytes(self.device, share, 0, ranks),
                share,
                ranks,
            )
        with torch.device(self.device):
            self.model: CausalLM = get_model_class(cfg)(
                cfg, tp_rank=tp_rank, tp_size=tp_size, dtype=self.dtype, ops=self.ops
            )
        self.quantization = quantization  # --quantization: which weights stay quantized (runtime.engine.quant.loading)
        self.int8_activations = int8_activations  # --quantized-activations int8: how the kept blocks multiply
        load_model_weights(
            self.model,
            self.model_path,
            progress=load_progress and tp_rank == 0,
            quantization=quantization,
            int8_activations=int8_activations,
            bf16_prefill=self.bf16_prefill,
        )
        self.model.eval()
        self.ops.prepare_model(self.model)
        self.lora = LoraManager(self.model, lora, self.dtype, self.device) if lora is not None else None
        first_attention = self.model.attention_layers()[0]
        self.num_heads = first_attention.num_heads  # query heads on this rank
        self.num_kv_heads = first_attention.num_kv_heads  # KV heads on this rank
        self.head_dim = cfg.head_dim
        self.kv_format = kv_cache_format(kv_cache_dtype, self.dtype)

        self.max_total_tokens = self._kv_capacity(max_total_tokens, mem_fraction_static, max_running_requests)
        self.max_running_requests = max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS, self.max_total_tokens)
        # Pools: owned here, written by the scheduler (req_to_token) and the attention backend (KV).
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, self.context_len + 8, self.device)
        self.token_to_kv_pool: MHATokenToKVPool | SWAKVPool
        if cfg.is_hybrid_swa and page_size == 1 and not disable_hybrid_swa_memory:
            # Windowed layers keep their last W tokens in a pool of their own (memory.swa_kv_pool);
            # max_total_tokens counts the full pool's tokens. Sized from memory, the budget of a
            # full-attention pool is shared out between the two by the ratio.
            if max_total_tokens is None:
                windowed = sum(w is not None for w in cfg.layer_windows)
                self.max_total_tokens, _ = swa_pool_sizes(
                    self.max_total_tokens, swa_full_tokens_ratio, cfg.num_hidden_layers - windowed, windowed
                )
            self.token_to_kv_pool = SWAKVPool(
                self.max_total_tokens,
                max(1, int(self.max_total_tokens * swa_full_tokens_ratio)),
                page_size,
                self.dtype,
                cfg.layer_windows,
                self.num_kv_heads,
                cfg.head_dim,
                self.device,
                self.kv_format,
            )
        else:
            if cfg.is_hybrid_swa and not disable_hybrid_swa_memory:
                logger.info("page size %d: the windowed layers keep KV for every token (one pool)", page_size)
            self.token_to_kv_pool = MHATokenToKVPool(
                self.max_total_tokens,
                page_size,
                self.dtype,
                cfg.num_hidden_layers,
                self.num_kv_heads,
                cfg.head_dim,
                self.device,
                self.kv_format,
            )
        if self.kv_format.is_fp8:  # (int8 scales each token itself; an unquantized cache has none)
            scales = checkpoint_kv_scales(self.model_path, cfg.num_hidden_layers)
            if scales is not None:
                self.token_to_kv_pool.set_layer_scales(*scales)
        # Budgeted bytes per token: the pool's own (a hybrid SWA pool's is smaller than the formula's)
        # plus its share of the backend's extra KV copy.
        ram = self.ops.platform(self.device).ram_bytes
        self.kv_pool = KVPoolSize(
            tokens=self.max_total_tokens,
            context_len=self.context_len,
            max_running_requests=self.max_running_requests,
            bytes_per_token=int(self.token_to_kv_pool.bytes_per_token() * self._kv_copy_factor()),
            ram_bytes=ram() if ram is not None else None,
            kv_dtype=self.kv_format.name,
            kv_bytes_per_token=self.token_to_kv_pool.bytes_per_token(),
        )
        logger.info("%s", self.kv_pool.log_line())
        self.attn_backend: AttentionBackend = create_attention_backend(self.attention_backend_name, self)
        self.sampler = Sampler(ops=self.ops)
        # The decode path, as the device ops say: a device's own layer stack for every eager forward
        # (the CPU's one-call decode stack), captured graphs for decode batches (cuda).
        self.layer_stack: LayerStack | None = self.ops.layer_stack(self.model)
        self.graph_runner: CudaGraphRunner | None = None
        # (an encoder has no decode step to capture)
        if not disable_cuda_graph and self.ops.platform(self.device).cuda_graphs and not self.model.is_encoder:
            if self.ops.graph_safe(self.model):
                self.graph_runner = setup_cuda_graphs(self, max_bs=cuda_graph_max_bs, batch_sizes=cuda_graph_bs)
            else:
                logger.info("decode runs eagerly: the %s ops cannot capture this model's layers", self.ops.name)
        self.kernels = self.ops.kernel_report(self.model, self.layer_stack, self.kv_format)
        if self.lora is not None:
            self.kernels["lora"] = LORA_PATH_NOTE
        logger.info("kernels: %s", self.kernels["summary"])
        logger.info(
            "model ready in %.1fs (attention backend %s, %s)",
            time.perf_counter() - start,
            self.attention_backend_name,
            self.graph_runner.summary() if self.graph_runner is not None else "no cuda graphs",
        )

    def load_lora_adapter(self, uid: str, path: str) -> None:
        """Read and prepare the PEFT adapter at ``path`` as load id ``uid`` (every TP rank at the same
        step); ``LoraAdapterError`` naming what is wrong, nothing loaded."""
        if self.lora is None:
            raise ValueError("this server serves no LoRA adapters (start it with --enable-lora)")
        self.lora.load(uid, path)

    def unload_lora_adapter(self, uid: str) -> None:
        if self.lora is not None:
            self.lora.unload(uid)

    def update_weights_from_disk(self, folder: str | Path, load_format: str | None = None) -> None:
        """Reload the weights in place from another checkpoint of this model (every TP rank at the
        same step); ``weight_reload.WeightReloadError``, the served weights kept, when it cannot."""
        reload_weights(self, Path(folder), load_format)
        self.kernels = self.ops.kernel_report(self.model, self.layer_stack, self.kv_format)  # (copies made again)

    # ---- memory sizing ---------------------------------------------------------------

    def kv_bytes_per_token(self) -> int:
        """Memory one token of KV pool capacity costs: its K and V in every layer, plus the share
        of any extra KV copy the attention backend keeps (``kv_copy_fraction``: the CPU decode
        mirror), so that a pool sized from a memory budget leaves room for that copy inside it."""
        return self._kv_bytes_per_token(self.kv_format)

    def _kv_bytes_per_token(self, kv_format: KVCacheFormat) -> int:
        cfg = self.model_config
        pool = kv_bytes_per_token(cfg.num_hidden_layers, self.num_kv_heads, cfg.head_dim, kv_format)
        return int(pool * self._kv_copy_factor())

    def _kv_copy_factor(self) -> float:
        """1 + the share of an extra KV copy the attention backend keeps (the CPU decode mirror)."""
        backend = get_attention_backend_class(self.attention_backend_name, self.device)
        return 1.0 + getattr(backend, "kv_copy_fraction", 0.0)

    def weight_bytes(self) -> int:
        """Memory this rank's weights take (parameters and buffers, each storage once): on CPU
        they come out of the same share of RAM as the KV pool."""
        return resident_tensor_bytes(self.model)

    def resident_weight_bytes(self) -> int:
        """The weights' tensors and what the device laid out beside them (``DeviceOps.prepared_bytes``:
        a CPU weight's packed copy), the memory the KV pool's budget leaves out."""
        return self.weight_bytes() + self.ops.prepared_bytes(self.model)

    def weight_info(self) -> dict[str, object]:
        """``server_info``'s ``weights``: resident bytes in all, the ``--quantization`` method, the
        bytes of the weights kept quantized by source format (``runtime.engine.quant``: what the format
        says, e.g. 0.75 bytes a value for Q4_1 as repacked), and the kernels the device ops chose."""
        return {
            "bytes": self.weight_bytes(),
            "prepacked_bytes": self.ops.prepared_bytes(self.model),
            "quantization": self.quantization,
            "activations": activation_numerics(self.quantization, self.int8_activations, self.bf16_prefill),
            "quantized_bytes": quantized_bytes(self.model),
            "kernels": self.kernels,
        }

    def _kv_capacity(
        self, max_total_tokens: int | None, mem_fraction_static: float | None, max_running_requests: int | None
    ) -> int:
        """Tokens the KV pool holds: ``max_total_tokens`` if given, else the memory budget at the
        device's share (``runtime.engine.kv_sizing.kv_pool_tokens``); at the default share, no more
        than the device says the configured work needs (CPU: ``host_memory.cpu_demand_tokens``,
        the default there: a pool sized by the work, not by the machine's RAM)."""
        platform = self.ops.platform(self.device)  # the device's memory defaults
        frac = platform.mem_fraction if mem_fraction_static is None else mem_fraction_static
        if not 0.0 < frac <= 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {frac}")
        budget = platform.budget_bytes(self.device, frac, self.resident_weight_bytes(), self.tp_size * self.dp_size)
        demand = None
        if platform.demand_tokens is not None and mem_fraction_static is None:
            demand = platform.demand_tokens(max_running_requests, self.context_len)
            # The work's need is memory at the model's dtype: a narrower cache (--kv-cache-dtype) holds
            # more tokens in it (an int8 cache about twice a bf16 one's), the point of choosing it.
            demand = demand * self._kv_bytes_per_token(kv_cache_format("auto", self.dtype)) // self.kv_bytes_per_token()
        return kv_pool_tokens(
            per_token=self.kv_bytes_per_token(),
            budget_bytes=budget,
            page_size=self.page_size,
            max_total_tokens=max_total_tokens,
            demand_tokens=demand,
            warn_over_budget=platform.warn_over_budget,
            warn=logger.warning,
        )

    # ---- forward --------------------------------------------------------------------

    @torch.inference_mode()
    def compute_logits(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the model; fp32 logits at ``batch.logit_rows()`` (``[bs, vocab]``, each request's last
        new token, unless the batch asks for prompt logprobs)."""
        if self.lora is None:
            return self._logits(batch)
        self.lora.begin(batch)  # the batch's adapters in their slots, its runs the linears' context
        try:
            return self._logits(batch)
        finally:
            self.lora.end()

    def _logits(self, batch: ForwardBatch) -> torch.Tensor:
        # (a captured graph holds no adapter products: a batch with adapters runs eagerly)
        if batch.lora is None and self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        return eager_forward(self, batch)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, top_logprobs_num: int | None = None) -> ModelOutput:
        """One model step. Greedy argmax when ``batch.sampling_info`` is None, else the Sampler.

        ``top_logprobs_num`` (default: ``batch.top_logprobs_num``, the largest any request
        in the batch asked for) asks for the k best logprobs of every request.
        """
        if self.pooling is not None:
            parts = pooled_parts(self.model, batch, self.attn_backend, self.pooling, self.layer_stack)
            zeros = torch.zeros(batch.batch_size, dtype=torch.int64, device=parts.device)
            return ModelOutput(next_token_ids=zeros, pooled=parts)
        k = top_logprobs_num if top_logprobs_num is not None else batch.top_logprobs_num
        logits = self.compute_logits(batch)
        prompt = None
        if batch.input_logprobs is not None:
            # Before sampling, which may scale its rows in place; the sampled rows are a copy.
            prompt = prompt_logprobs(logits, batch.input_logprobs, k)
            logits = logits.index_select(0, batch.input_logprobs.sample_rows)
        out = self._sample(batch, logits, k)
        if prompt is not None:
            out.input_token_logprobs, out.input_top_logprobs, out.input_token_ids_logprobs = prompt
        return out

    def _sample(self, batch: ForwardBatch, logits: torch.Tensor, k: int) -> ModelOutput:
        """The next token of each request from its row of ``logits`` (and its output logprobs)."""
        info = batch.sampling_info
        if info is None:
            next_ids = self.ops.argmax_rows(logits)
            out = ModelOutput(next_token_ids=next_ids, logits=logits)
            if batch.return_logprob or k > 0:
                logprobs = torch.log_softmax(logits, dim=-1)
                if batch.return_logprob:
                    out.logprobs = logprobs.gather(1, next_ids[:, None]).squeeze(1)
                if k > 0:
                    values, ids = logprobs.topk(min(k, logits.shape[1]), dim=-1)
                    out.top_logprobs = (values, ids)
            return self._same_on_every_rank(out)
        sampled = self.sampler(logits, info, return_logprob=batch.return_logprob, top_logprobs_num=k)
        return self._same_on_every_rank(
            ModelOutput(
                next_token_ids=sampled.next_token_ids,
                logprobs=sampled.logprobs,
                top_logprobs=sampled.top_logprobs,
                token_ids_logprobs=sampled.token_ids_logprobs,
                logits=logits,
            )
        )

    def _same_on_every_rank(self, out: "ModelOutput") -> "ModelOutput":
        """Under TP every rank must append the same tokens: rank 0's samples win.

        Logits are already identical after the vocab all-gather, so greedy rows
        agree anyway; this makes random sampling agree without relying on every
        rank's RNG staying in lockstep.
        """
        if self.tp_size == 1:
            return out
        group = get_tp_group()
        group.broadcast_tensor(out.next_token_ids, src=0)
        if out.logprobs is not None:
            group.broadcast_tensor(out.logprobs, src=0)
        if out.top_logprobs is not None:
            group.broadcast_tensor(out.top_logprobs[0], src=0)
            group.broadcast_tensor(out.top_logprobs[1], src=0)
        if out.token_ids_logprobs is not None:
            group.broadcast_tensor(out.token_ids_logprobs, src=0)
        return out


# Prompt rows log-softmaxed at a time: bounds the fp32 [rows, vocab] copies of a long prompt.
PROMPT_LOGPROB_ROWS = 1024


def prompt_logprobs(
    logits: torch.Tensor,
    rows: InputLogprobRows,
    k: int,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
    """Each prompt row's logprob of its target token, with ``k`` its k best, and with
    ``rows.token_ids`` its logprobs at those ids: log_softmax of the raw fp32 logits, as the output
    logprobs are (the logits are the same on every TP rank, so every rank gets the same values
    without a broadcast)."""
    chosen: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    ids: list[torch.Tensor] = []
    named: list[torch.Tensor] = []
    for start in range(0, int(rows.prompt_rows.shape[0]), PROMPT_LOGPROB_ROWS):
        part = rows.prompt_rows[start : start + PROMPT_LOGPROB_ROWS]
        logprobs = torch.log_softmax(logits.index_select(0, part).float(), dim=-1)
        targets = rows.target_ids[start : start + PROMPT_LOGPROB_ROWS]
        chosen.append(logprobs.gather(1, targets[:, None]).squeeze(1))
        if k > 0:
            top = logprobs.topk(min(k, logprobs.shape[1]), dim=-1)
            values.append(top.values)
            ids.append(top.indices)
        if rows.token_ids is not None:
            named.append(rows.token_ids.gather(logprobs, start))
    if not chosen:  # (no prompt rows: the builder leaves such batches without input_logprobs)
        empty = logits.new_empty((0,))
        return empty, None, None
    top_k = (torch.cat(values), torch.cat(ids)) if k > 0 else None
    return torch.cat(chosen), top_k, (torch.cat(named) if named else None)
