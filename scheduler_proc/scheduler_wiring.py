"""The scheduler's parts, built once: pools, prefix cache, queues, the deciders, the executors
of their decisions and the model worker.

Why a module of its own: a new feature's part has a single place to be built, and each part gets
the others it uses as constructor arguments, so what a part depends on is written where it is
built. The deciders (``Admission``, ``DecodeMemory``, ``PriorityPreemption``, ``BatchBuilder``...)
only decide; the executors carry decisions out on the queues and the prefix cache, one job each:
``RequestIntake`` (``scheduler_input``: requests and aborts in), ``BatchLauncher``
(``scheduler_launch``: the next batch and the room it needs), ``StepResults`` (``scheduler_results``:
the step in flight and its tokens) and ``RequestRelease`` (``scheduler_release``: memory going back).
They call each other only through public methods, in that order downwards. ``Scheduler``
(``scheduler.py``) is this class plus the step loop and the control side.
"""

from __future__ import annotations

import torch

from memory.prefix_cache import BasePrefixCache
from runtime.checkpoints.pooling import PoolingSpec
from runtime.config.args import ServerArgs
from runtime.config.lora_args import lora_enabled, lora_refs
from scheduler_proc import embedding
from scheduler_proc.admission import Admission
from scheduler_proc.batch_builder import BatchBuilder
from scheduler_proc.deadlines import Deadlines
from scheduler_proc.decode_memory import DecodeMemory
from scheduler_proc.grammar_queue import GrammarQueue
from scheduler_proc.long_rope import create_rope_switch
from scheduler_proc.lora_control import LoraAdapterControl
from scheduler_proc.lora_slots import LoraSlots
from scheduler_proc.memory_setup import create_allocator, create_tree_cache
from scheduler_proc.model_worker import ForwardRunner, create_model_runner, create_model_worker, overlap_default
from scheduler_proc.output import OutputProcessor
from scheduler_proc.priority import PriorityPreemption
from scheduler_proc.profiler import StepProfiler, tp_agreement
from scheduler_proc.queue_bound import QueueBound
from scheduler_proc.queues import RequestQueues
from scheduler_proc.req import StopChecker
from scheduler_proc.scheduler_input import RequestIntake
from scheduler_proc.scheduler_launch import BatchLauncher
from scheduler_proc.scheduler_release import RequestRelease
from scheduler_proc.scheduler_results import StepResults
from scheduler_proc.spec.verify import SpecDecoder
from scheduler_proc.weight_update import ServedWeights


class SchedulerWiring:
    """Builds and holds one TP rank's scheduler parts (see the module docstring)."""

    def __init__(
        self,
        server_args: ServerArgs,
        tp_rank: int = 0,
        model_runner: ForwardRunner | None = None,
        kv_events: bool = False,
        dp_rank: int = 0,
    ) -> None:
        self.tp_rank = tp_rank
        self.dp_rank = dp_rank
        if model_runner is None:
            model_runner = create_model_runner(server_args, tp_rank)
        self.runner = model_runner
        # An embedding server's rule (the runner's, read from the model folder): what it allows of the
        # prefix cache and chunking is applied to the flags once, here (scheduler_proc.embedding).
        self.pooling: PoolingSpec | None = getattr(model_runner, "pooling", None)
        server_args = embedding.serving_args(server_args, self.pooling)
        self.args = server_args
        self.page_size = server_args.page_size
        self.context_len: int = model_runner.context_len
        self.max_running_requests: int = model_runner.max_running_requests
        self.allocator = create_allocator(model_runner, self.page_size)  # (hybrid with windowed layers)
        self.req_to_token_pool = model_runner.req_to_token_pool
        # The allocator rounds the pool down to whole pages: that is the real capacity.
        self.max_total_tokens: int = self.allocator.size
        self.tree_cache: BasePrefixCache
        # host_tier: the hierarchical cache's per-step copies and load-back (scheduler_proc.hicache).
        self.tree_cache, self.host_tier = create_tree_cache(server_args, model_runner, self.allocator, kv_events)
        # Multi-LoRA (scheduler_proc/lora_slots.py): the adapters loaded and the slots of each batch.
        self.lora: LoraSlots | None = None
        if lora_enabled(server_args):
            self.lora = LoraSlots(server_args.max_loras_per_batch, server_args.max_loaded_loras, lora_refs(server_args))
        self.admission = Admission(
            server_args,
            self.tree_cache,
            self.allocator,
            self.max_total_tokens,
            self.max_running_requests,
            self.host_tier,
            self.lora,
        )
        # How the model's RoPE depends on a request's length (a LongRoPE switch, or one RoPE throughout).
        self.rope_switch = create_rope_switch(model_runner.rope_switch_len)
        self.builder = BatchBuilder(
            model_runner, self.allocator, self.tree_cache, self.page_size, self.rope_switch, self.lora
        )
        self.output = OutputProcessor(
            StopChecker(set(model_runner.eos_token_ids), self.context_len),
            server_args.stream_interval,
            server_args.decode_log_interval,
        )
        self.stats = self.output.stats
        self.memory = DecodeMemory(self.context_len)
        self.spec = SpecDecoder.create(
            server_args,
            self.context_len,
            self.stats,  # None: no speculation
            torch.device(model_runner.device),
        )
        self.preemption = PriorityPreemption() if server_args.priority_preemption else None
        overlap = server_args.disable_overlap_schedule
        overlap = overlap_default(torch.device(model_runner.device)) if overlap is None else not overlap
        self.worker = create_model_worker(model_runner, overlap)
        self.queues = RequestQueues()
        # Constrained requests wait here until their grammar is compiled (off this thread).
        self.grammars = GrammarQueue(
            lambda: self.output.stop_checker.load_tokenizer(server_args),
            model_runner.vocab_size,
            model_runner.eos_token_ids,
            server_args.grammar_compile_timeout,
            tp_rank,
            server_args.tp_size,
        )
        # Jump-forward re-prefills through the prefix cache: without one it would recompute everything.
        self.jump_forward = not (server_args.disable_jump_forward or server_args.disable_radix_cache)
        # --max-queued-requests (scheduler_proc/queue_bound.py) and request deadlines
        # (scheduler_proc/deadlines.py: rank 0 decides; under TP its expiries reach the others as aborts).
        self.queue_bound = QueueBound(server_args.max_queued_requests)
        self.deadlines = Deadlines()
        # /start_profile, /stop_profile (scheduler_proc/profiler.py) and /update_weights_from_disk
        # (scheduler_proc/weight_update.py: the update waiting for the running requests to finish).
        device = torch.device(model_runner.device)
        self.profiler = StepProfiler(
            device,
            tp_rank,
            server_args.tp_size,
            dp_rank,
            server_args.dp_size,
            tp_agreement(server_args.tp_size, device),
        )
        self.served_weights = ServedWeights(str(getattr(model_runner, "model_path", None) or server_args.model_path))
        # The executors (module docstring), each given the parts it works on.
        self.release = RequestRelease(self.queues, self.tree_cache, self.output, self.spec, self.rope_switch)
        self.intake = RequestIntake(
            server_args,
            self.context_len,
            self.queues,
            self.grammars,
            self.queue_bound,
            self.rope_switch,
            self.output,
            self.release,
            self.lora,
        )
        # /load_lora_adapter, /unload_lora_adapter (an unload waits for the adapter's requests to finish).
        self.lora_control: LoraAdapterControl | None = None
        if self.lora is not None:
            self.lora_control = LoraAdapterControl(
                self.lora,
                model_runner,  # type: ignore[arg-type]  # (a runner of a LoRA server loads adapters)
                lambda: [*self.queues.waiting, *self.queues.holders(), *self.grammars.requests()],
                self.output.outbox_append,
            )
        self.results = StepResults(
            self.queues,
            self.tree_cache,
            self.allocator,
            self.req_to_token_pool,
            self.output,
            self.spec,
            self.grammars,
            self.jump_forward,
            self.context_len,
            self.release,
            self.pooling,
        )
        self.launcher = BatchLauncher(
            self.queues,
            self.admission,
            self.memory,
            self.preemption,
            self.rope_switch,
            self.builder,
            self.worker,
            self.spec,
            self.allocator,
            self.tree_cache,
            self.max_total_tokens,
            self.host_tier,
            self.output,
            self.results,
            self.release,
            server_args.enable_mixed_chunk,
        )
