"""`LatheEngine`: lathe's built-in rollout engine, a `Rollout` over the paged KV cache.

    engine = LatheEngine.from_pretrained(path, eos_token_id=tok.eos_token_id)
    out = engine.generate(prompt_token_ids, SamplingParams(n=8, temperature=1.0, max_tokens=512, seed=0))

`generate` returns `len(prompts) * n` samples, prompt-major, as `HFRollout` does; greedy output equals
transformers' greedy `generate`. Sample `j` of prompt `i` samples with the seed `(seed, i * n + j)`:
reproducible, and independent of batching, preemption and of the prompts after it. (Different batch
shapes can change logits in the last bits — on a GPU, bf16 matmuls pick kernels by batch size — so a
token exactly on a sampling boundary may still differ; this is the only dependence.)

Requests can also stream in and out while the engine runs, and be interrupted for a weight sync (partial
rollout): `add_request`, `step`, `pop_finished`, `interrupt`, `load_weights` (`lathe.engine.stream`).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import weakref
from collections.abc import Iterable

import torch

from lathe import device as accel
from lathe.engine import decode_forms, expert_parallel, fp8
from lathe.engine.block_manager import BlockManager
from lathe.engine.kv_cache import KVCache, kv_storage_dtype
from lathe.engine.linear_state import LinearStateCache, StateBlockManager, has_states, hybrid_settings, kv_layers, \
    state_slots
from lathe.engine.mla import cache_layout, is_mla, mla_settings
from lathe.engine.model_runner import ModelRunner
from lathe.engine.multimodal import (MultiModalPrompt, check_continuation, ensure_embeddings, prepare_prompt,
                                     text_config)
from lathe.engine.routing import RoutingRecorder
from lathe.engine.sampler import fused_settings, sample_on_device
from lathe.engine.scheduler import Scheduler
from lathe.engine.mtp_draft import MtpDrafter
from lathe.engine.sequence import PENDING, Sequence, SequenceParams, SequenceStatus
from lathe.engine.spec_step import SpeculativeMixin, refuse_speculative
from lathe.engine.speculative import spec_metrics
from lathe.engine.stream import StreamingMixin
from lathe.engine.data_parallel import dp_settings, idle_step
from lathe.engine.tensor_parallel import TensorParallel, layout_of
from lathe.generation import RolloutOutput, SamplingParams
from lathe.generation.stop import StopStringMatcher, StopStrings
from lathe.models.io import copy_named_tensors
from lathe.models.vl import is_vl

logger = logging.getLogger(__name__)


def sequence_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for sample `index` of a call seeded with `seed`."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


FINISHED = SequenceStatus.FINISHED
# `sleep` keeps the allocator's cached memory (and the decode graphs) while the device holds at most this share of
# its memory in all (every process's, as the driver counts it): the next `wake_up` then takes the cache back from the
# allocator, the trainer's cached blocks stay for its next update, and nothing is freed to the driver and allocated
# again each step
KEEP_CACHED_FRACTION = 0.8
# Shared-prefix decode attention for hybrid models, whose samples share their prompt's blocks through forks
# (`Scheduler`): its GPU test at their 256-wide attention heads passed on an H200
# (`test_hybrid_engine.py::test_cuda_shared_prefix_graphs_with_forked_samples`), but the one A/B of the Qwen3.5-2B grpo
# load showed no gain (6 of 24 layers attend; its results file was not kept): off until a measurement says otherwise
HYBRID_SHARED_PREFIX = False
FUSE_MAX_FRACTION = 0.04     # fused projections by default while their copy is at most this share of the device


class _InFlight:
    """A step whose samples are still on the device: `out` (2, B) token ids and log-probs, copied to pinned host
    memory behind the step's work (CUDA); `pending` the (sequence, row, index in token_ids) placeholders."""

    def __init__(self, seqs: list[Sequence], out: torch.Tensor):
        self.seqs, self.out = seqs, out
        self.tokens = out[0].long()             # (`out` may be a graph's static buffer, which the next step rewrites:
        if not out.is_cuda:                     # on CUDA the copies below are queued before that step; elsewhere
            self.out = out.clone()              # it is read at resolve time, so kept)
        self._rows: dict[Sequence, int] | None = None
        self.pending: list[tuple[Sequence, int, int]] = []
        self.host, self.event = None, None
        if out.is_cuda:
            self.host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self.host.copy_(out, non_blocking=True)
            self.event = accel.new_event(out.device)
            self.event.record()

    @property
    def rows(self) -> dict[Sequence, int]:
        """Each sequence's row (built when the next step is not simply this one's first rows)."""
        if self._rows is None:
            self._rows = {s: i for i, s in enumerate(self.seqs)}
        return self._rows

    def add_placeholders(self, engine: "LatheEngine") -> None:
        """A placeholder for each sequence still running; one that reaches its length limit with it ends now
        (its last token arrives later), so the next step does not run it."""
        pending, finish, nan = self.pending, engine.scheduler.finish, float("nan")
        for row, seq in enumerate(self.seqs):       # (runs for every sequence at every step: kept lean)
            if seq.status is FINISHED:          # stopped at the previous step's tokens: this row is dropped
                continue
            ids = seq.token_ids
            ids.append(PENDING)
            seq.logprobs.append(nan)
            pending.append((seq, row, len(ids) - 1))
            if len(ids) >= seq.length_limit:
                seq.num_fed = len(ids) - 1      # (its last token, on the device, is never fed)
                finish(seq, "length")

    def to_host(self) -> tuple[list[float], list[float], float]:
        """(token ids, log-probs) as host lists, and the seconds the host waited for the device to reach them."""
        if self.event is None:
            return *self.out.tolist(), 0.0
        start = time.perf_counter()
        self.event.synchronize()
        waited = time.perf_counter() - start
        return *self.host.tolist(), waited


def _recording(items: Iterable[tuple[str, torch.Tensor]], names: set[str]):
    """`items` passed through, their names added to `names`."""
    for name, tensor in items:
        names.add(name)
        yield name, tensor


class LatheEngine(StreamingMixin, SpeculativeMixin):
    """Continuous-batching generation with a `LatheCausalLM` (fp32/bf16, CPU or CUDA).

    On CUDA, by default: the model's layers are compiled (`compile_model`, torch.compile per layer), decode
    steps replay CUDA graphs (`enforce_eager=False`; one per decode batch size of `cudagraph_capture_sizes`, or of
    lathe's buckets, see `cuda_graph.batch_buckets`) that also sample, decode attention is the fastest kernel
    measured at start-up (`decode_backend="auto"`: Triton paged decode or the PyTorch reference), so are a MoE
    model's experts in decode steps (fused Triton kernels or `experts_forward`: `triton_moe.choose_moe_backend`,
    reported as `runner.moe_backend`), and a small model's q/k/v and gate/up projections run as one matmul each
    (`fuse_projections`, see `_should_fuse`).

    KV memory: `num_kv_blocks` blocks of `block_size` tokens; when not given it is sized from
    `gpu_memory_utilization` of the device's free memory (CUDA) or to hold `max_num_seqs` sequences of
    `max_model_len` tokens (capped at 64 sequences on CPU). `kv_cache_dtype` (vLLM's name): "auto" (None) stores K/V in
    the model's dtype; "fp8" (= "fp8_e4m3") in float8_e4m3fn with a float32 scale per token and KV head (`kv_cache`),
    ~1.94x the tokens at head_dim 128 in the same memory; attention still runs in the model's dtype. The hybrids'
    linear-attention states stay in the model's dtype (only their full-attention layers' K/V are FP8).

    Admission reserves KV room for the responses still to come (`reserve_new_tokens`, see
    `lathe.engine.scheduler`), so that a large GRPO load queues instead of preempting; `generate`'s output
    reports `rollout/num_preemptions`. `reserve_new_tokens=False` admits whatever prompt fits (tests use it to
    force preemption).

    Scheduling overlaps the device (`async_scheduling`, on by default on CUDA): see `step`.

    `shared_prefix_attention` (on by default): in graph-replayed decode steps on the Triton kernel, rows whose block
    tables share a prompt (the `n` samples of a prompt: prefix caching shares its blocks) of at least
    `cuda_graph.PREFIX_MIN_TOKENS` tokens (`PREFIX_MIN_TOKENS_WIDE` where a token's K/V in a layer are 512 values or
    more) attend over it once per group of rows, each K/V tile read once for the group (`triton_decode.paged_decode`'s
    `prefix`), and each row over the rest of its context on its own.

    `num_speculative_tokens=k > 0`: speculative decoding with the model's first MTP layer drafting k tokens per decode
    step, verified in one forward with exact acceptance (`lathe.engine.spec_step`); its steps run eagerly, without
    the overlap. A model without MTP layers is refused.
    """

    def __init__(self, model, *, eos_token_id: int | list[int] | None, block_size: int = 16,
                 num_kv_blocks: int | None = None, gpu_memory_utilization: float = 0.5, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 16384, max_model_len: int | None = None,
                 enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, decode_backend: str = "auto", enforce_eager: bool = False,
                 cudagraph_capture_sizes: list[int] | None = None,
                 compile_model: bool | None = None, tokenizer=None, reserve_new_tokens: bool = True,
                 async_scheduling: bool | None = None, fuse_projections: bool | None = None,
                 quantization: str | None = None, record_routing: bool = False, kv_cache_dtype: str | None = None,
                 num_speculative_tokens: int = 0, quantize_lm_head: bool = False, shared_prefix_attention: bool = True):
        hybrid = has_states(text_config(model))      # Qwen3.5 / Qwen3-Next, Nemotron-H: per-sequence states
        layout = layout_of(model)           # a tensor-parallel replica's rank (`tensor_parallel.shard_copy`)
        self.tp = layout.tp if layout is not None else TensorParallel(None, 0, 1)
        # data-parallel attention: this replica's place among its engine's (`data_parallel.py`), or None
        self.dp = layout.dp if layout is not None else None
        if self.dp is not None:
            enforce_eager = dp_settings(model, enforce_eager, num_speculative_tokens)
            # the largest decode batch whose gathered (token, choice) rows a graph's experts take in one piece
            c = text_config(model)
            per = self.dp.size * c.moe.num_experts_per_tok * c.hidden_size * model.dtype.itemsize
            self._dp_graph_batch = max(1, expert_parallel.GATHER_BYTES // per)
        if hybrid:
            enable_prefix_caching, fuse_projections = hybrid_settings(model, enable_prefix_caching, fuse_projections,
                                                                      quantization)
            # (the ranks of a replica from each one's free memory: the fewest, so their schedulers decide alike)
            max_num_seqs = self.tp.min_int(state_slots(text_config(model), max_num_seqs, model.dtype, model.device,
                                                       None if num_kv_blocks is not None else gpu_memory_utilization))
            if self.dp is not None:     # (and of an engine's replicas: the same decode graphs' buckets everywhere)
                max_num_seqs = self.dp.min_int(max_num_seqs)
        if is_mla(model):           # DeepSeek-V3 family: no CUDA graphs, fused projections or FP8 (`mla.py`)
            enforce_eager, fuse_projections = mla_settings(model, enforce_eager, fuse_projections, quantization)
        self.model = model.eval()
        # the paged cache's storage: the model's dtype ("auto"), or FP8 with a scale per token and KV head (`kv_cache`)
        self.kv_dtype = kv_storage_dtype(kv_cache_dtype, model.dtype, model.device)
        self.vl = is_vl(model)        # a vision-language model: prompts may carry images (`multimodal.py`)
        self.prepared_images = weakref.WeakSet()   # every prompt's images this engine prepared, while held anywhere
        if num_speculative_tokens:
            refuse_speculative(self, num_speculative_tokens, vl=self.vl, hybrid=hybrid, mla=is_mla(model),
                               quantization=quantization, record_routing=record_routing,
                               kv_cache_dtype=kv_cache_dtype)
        self.num_speculative_tokens = num_speculative_tokens
        if self._should_fuse(fuse_projections):
            decode_forms.fuse_projections(model)
        # (FP8 copies are new memory either way: one tensor for each q/k/v and gate/up, unless fusion was refused)
        self.quantization = self._quantize(quantization, fuse=fp8.FUSE_COPIES and fuse_projections is not False,
                                           lm_head=quantize_lm_head)
        # overlap needs a device that runs behind the host; on the CPU it would only run stopped rows once more
        self.async_scheduling = model.device.type == "cuda" if async_scheduling is None else async_scheduling
        self._inflight: _InFlight | None = None
        # seconds the host has waited for decode steps' sampled tokens: near the decode's time where the device paces
        # it, near 0 where the host does (its scheduling and launches slower than the device's steps)
        self.device_wait_s = 0.0
        if not self.vl and (compile_model if compile_model is not None else model.device.type == "cuda"):
            from lathe.models.compile import compile_decoder
            compile_decoder(model)    # fuses norms, RoPE, SwiGLU; the decode graphs capture the compiled kernels
        cfg = text_config(model)
        self.vocab_size = getattr(model.lm_head, "vocab_size", model.lm_head.weight.shape[0])
        self.eos_ids = [] if eos_token_id is None else (
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        self.tokenizer = tokenizer    # decodes outputs for SamplingParams.stop (stop strings); optional
        self._stop_matchers: weakref.WeakKeyDictionary[Sequence, StopStringMatcher] = weakref.WeakKeyDictionary()
        self.max_model_len = max_model_len or cfg.max_position_embeddings
        self._auto_size = None if num_kv_blocks is not None else (block_size, gpu_memory_utilization, max_num_seqs)
        self._sizing = (0, 0, 0)      # (bytes allocated, cached by the allocator, free) when the cache was last sized
        self._cache_kept, self._kv_address = False, None        # what `sleep` left for `wake_up`
        self.states = (LinearStateCache(cfg, max_num_seqs, dtype=model.dtype, device=model.device) if hybrid
                       else None)          # the linear-attention layers' per-sequence states (before sizing the KV)
        # the `n` samples of a prompt (its images too) fork from the first once it is computed (`Scheduler`): where
        # prefix caching, which shares their prompt otherwise, is off (hybrid models; or asked off, as several of
        # verl's scripts do); not beside speculative decoding, whose prefill keeps the drafts' hidden states
        self.fork_samples = not enable_prefix_caching and not num_speculative_tokens
        if num_kv_blocks is None:
            num_kv_blocks = self._default_num_blocks(block_size, gpu_memory_utilization, max_num_seqs)
        self.kv_cache = KVCache(kv_layers(cfg), num_kv_blocks, block_size, *cache_layout(cfg), dtype=self.kv_dtype,
                                device=model.device, latent=is_mla(model))    # (DeepSeek-V3's latent: `mla.py`)
        self.block_manager = (BlockManager(num_kv_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
                              if self.states is None else StateBlockManager(num_kv_blocks, block_size,
                                                                            enable_prefix_caching=False,
                                                                            states=self.states))
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_chunked_prefill=enable_chunked_prefill,
                                   reserve_new_tokens=reserve_new_tokens)
        self.runner = ModelRunner(model, self.kv_cache, max_model_len=self.max_model_len,
                                  decode_backend=decode_backend, cuda_graphs=not enforce_eager,
                                  max_graph_batch=min(max_num_seqs, 512), graph_sizes=cudagraph_capture_sizes,
                                  states=self.states,
                                  shared_prefix=shared_prefix_attention and (HYBRID_SHARED_PREFIX or not hybrid))
        self.routing = None         # routing replay: each token's MoE choices, per KV slot (`routing.py`)
        if record_routing:
            self.routing = model.routing_recorder = RoutingRecorder(model, self.kv_cache)
            self.scheduler.on_release = self._take_routing
        self._init_streaming()
        self._init_speculative(num_speculative_tokens)

    def _quantize(self, scheme: str | None, fuse: bool, lm_head: bool) -> str | None:
        """FP8 copies of the decoder layers' projections (`lathe.engine.fp8`), for `quantization="fp8"` (`fuse`: one
        copy for each q/k/v and gate/up group not fused already; `lm_head`: the lm_head's too)."""
        if scheme is None:
            if lm_head:
                raise ValueError("quantize_lm_head=True puts the lm_head in FP8 beside FP8 projections, but "
                                 "quantization is None. Fix: set actor_rollout_ref.rollout.quantization=fp8, or "
                                 "quantize_lm_head=false")
            return None
        if scheme not in fp8.SCHEMES:
            raise ValueError(f"quantization={scheme!r}: lathe's engine quantises to {', '.join(fp8.SCHEMES)} only")
        if self.vl or self.tp.size > 1 or self.dp is not None:
            raise ValueError(f"quantization={scheme!r}: not implemented for " + (
                "vision-language models" if self.vl else "tensor-parallel replicas" if self.tp.size > 1 else
                "data-parallel attention (rollout.data_parallel_size > 1 with expert_parallel_size = DP x TP)"))
        fp8.check_device(self.model.device, self.model.dtype)
        added = (decode_forms.fuse_fp8_copies(self.model) if fuse else 0) + fp8.quantize_model(self.model)
        added += fp8.quantize_lm_head(self.model) if lm_head else 0
        total = accel.total_memory(self.model.device) if self.model.device.type == "cuda" else None
        if total:       # measured at 7B beside the trainer: the cache halved, 25 preemptions a step (README)
            logger.warning("engine: quantization=fp8 keeps FP8 copies of the projections beside their bf16 weights "
                           "(%.1f GiB), which come out of gpu_memory_utilization's budget: the KV cache gets that "
                           "much less. To keep its size, raise actor_rollout_ref.rollout.gpu_memory_utilization by "
                           "%.3f", added / 2**30, added / total)
        return scheme

    def _should_fuse(self, requested: bool | None) -> bool:
        """Fused q/k/v and gate/up matmuls (`decode_forms.fuse_projections`): asked for, or by default on CUDA
        when the fused copy is small (at most `FUSE_MAX_FRACTION` of the device's memory). The copy is extra memory
        when the engine shares the trainer's tensors (one GPU), and it pays where it matters: a small model's decode
        step is latency-bound small matmuls, a large model's matmuls are bandwidth-bound either way."""
        if requested is not None:
            if requested and self.vl:
                raise ValueError("fuse_projections=True: not implemented for vision-language models")
            return requested
        if self.vl or self.model.device.type != "cuda":
            return False
        total = accel.total_memory(self.model.device) or 0
        return decode_forms.projection_bytes(self.model) <= FUSE_MAX_FRACTION * total

    @classmethod
    def from_pretrained(cls, path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        **kwargs) -> "LatheEngine":
        from lathe.models import load_lathe_model
        return cls(load_lathe_model(path, dtype, device=device), **kwargs)

    def _default_num_blocks(self, block_size: int, utilization: float, max_num_seqs: int) -> int:
        cfg, device = text_config(self.model), self.model.device
        per_block = KVCache.bytes_per_block(kv_layers(cfg), block_size, *cache_layout(cfg), self.kv_dtype,
                                            is_mla(self.model))
        if self.num_speculative_tokens:        # the draft layer's cache (`mtp_draft.py`)
            per_block += MtpDrafter.bytes_per_block(self.model, block_size)
        # the most blocks the running sequences can ever hold: max_num_seqs sequences of max_model_len tokens
        # (more only keep finished prefixes, which every weight update forgets). Without this cap a small
        # model on a large GPU gets millions of blocks, and the block manager's Python bookkeeping minutes.
        most = math.ceil(self.max_model_len / block_size) * max_num_seqs
        if device.type == "cuda":
            # Cached segments go back to the driver first: what PyTorch holds but has not allocated is mostly
            # fragments of the update's activations, useless for the cache's large tensors (counting it as room
            # ran a 7B step out of memory at wake-up), cuBLAS's workspaces first (one made inside a cached segment
            # keeps all of it). Then `free` is what the cache can take, less the allocator's rounding of its
            # 2 x layers tensors and a little for the step's own buffers.
            accel.clear_blas_workspaces(device)
            accel.empty_cache(device)
            free, total = accel.memory_info(device)
            allocated = accel.memory_allocated(device)
            self._sizing = (allocated, accel.memory_reserved(device) - allocated, free)     # (said if it shrinks)
            slack = 2 * cfg.num_hidden_layers * (2 << 20) + (256 << 20)
            budget = min(free - slack, total * utilization - allocated)
            # a tensor-parallel replica's ranks hold the same blocks (their schedulers must agree): the fewest
            return self.tp.min_int(max(1, min(most, int(budget // per_block) - 1)))      # - the scratch block
        return math.ceil(self.max_model_len / block_size) * min(max_num_seqs, 64)

    # ---- Rollout ----------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], params: SamplingParams, *, first_index: int = 0,
                 multi_modal_inputs: list[dict | None] | None = None) -> RolloutOutput:
        """`params.n` samples per prompt, prompt-major. Sample j of prompt i draws with the seed
        `(params.seed, first_index + i * n + j)`: a call over prompts k.. of a larger list, with
        `first_index = k * n`, samples exactly what the whole call samples for them (data-parallel rollout).

        `multi_modal_inputs[i]` (VL models): prompt i's images, `{"pixel_values", "image_grid_thw"}` in the
        processor's layout with the prompt's placeholder tokens expanded, or None for a text prompt (or what
        `prepare_images` made of them). Each prompt's images are encoded once for its `n` samples (see
        `lathe.engine.multimodal`)."""
        try:
            if not self.kv_cache.allocated and (prompt_token_ids or self.dp is None):     # (an idle replica: none)
                raise RuntimeError("LatheEngine.generate: the engine is asleep (KV cache freed); call wake_up() "
                                   "first")
            if not self.scheduler.is_finished():
                raise RuntimeError("LatheEngine.generate: streamed requests (add_request) are unfinished; run them "
                                   "out with step(), or add this batch as a request too")
            self._resolve(self._inflight)           # a streamed request's last tokens, if still on the device
            seqs = self._make_sequences(prompt_token_ids, params, first_index, multi_modal_inputs)
            self.scheduler.new_call()
            preempted, prefilled = self.scheduler.num_preemptions, self.scheduler.num_prefill_tokens
            waited = self.device_wait_s
            graphs = self.runner.graphs
            captured = (graphs.captures, graphs.capture_seconds) if graphs is not None else (0, 0.0)
            for seq in seqs:
                if params.max_tokens <= 0:
                    seq.finish_reason = "length"
                else:
                    self.scheduler.add(seq)
        except Exception:
            if self.dp is None:
                raise
            self.dp.any(True)                   # (the other replicas of the engine stop too, rather than wait)
            raise
        if self.dp is not None and self.dp.any(False):
            raise RuntimeError("LatheEngine.generate: another replica of this data-parallel-attention engine failed "
                               "before its first step (its own error is in its log); this replica stops too")
        self._inflight = None
        try:
            while not self.scheduler.is_finished() if self.dp is None else self.dp.any(
                    not self.scheduler.is_finished()):
                if self.scheduler.is_finished():    # (data-parallel attention: another replica runs a step)
                    self.dp_idle()
                else:
                    self.step()
        except BaseException:
            # the call's sequences go, their KV blocks freed: the caller's `sleep` (in its cleanup) then frees the
            # cache, and the error that stopped the call is the one raised
            self._inflight = None
            self.scheduler.abandon()
            raise
        self._resolve(self._inflight)
        self._inflight = None
        if self.tp.size > 1:
            self._check_replica_agrees(seqs)
        return RolloutOutput(token_ids=[s.output_token_ids for s in seqs], logprobs=[list(s.logprobs) for s in seqs],
                             routed_experts=self._routed(seqs),
                             finish_reasons=[s.finish_reason for s in seqs],
                             metrics={"rollout/num_preemptions": self.scheduler.num_preemptions - preempted,
                                      "rollout/prefill_tokens": self.scheduler.num_prefill_tokens - prefilled,
                                      "rollout/kv_cache_blocks": self.kv_cache.num_blocks,
                                      "rollout/kv_cache_gb": (self.kv_cache.nbytes + (
                                          self.drafter.cache.nbytes if self.drafter is not None else 0)) / 2**30,
                                      "rollout/graph_captures": (graphs.captures if graphs else 0) - captured[0],
                                      "timing_s/graph_capture": (graphs.capture_seconds if graphs else 0.0)
                                      - captured[1],
                                      **({"timing_s/rollout_device_wait": self.device_wait_s - waited}
                                         if self.drafter is None else spec_metrics(seqs))})

    def _take_routing(self, seq: Sequence) -> None:
        seq.routed_experts = self.routing.take(seq)

    def _routed(self, seqs: list[Sequence]) -> list[torch.Tensor] | None:
        """Each sequence's recorded routing (`routing.py`), in host memory (one copy), or None when not recorded."""
        if self.routing is None:
            return None
        if not seqs:                            # (an idle replica of a data-parallel-attention engine)
            return []
        per = [getattr(s, "routed_experts", None) for s in seqs]
        layers, _, top_k = self.routing.buffer.shape
        per = [self.routing.buffer.new_full((len(s.token_ids), layers, top_k), -1) if p is None else p
               for s, p in zip(seqs, per)]
        for s in seqs:
            s.routed_experts = None
        return list(torch.cat(per).cpu().split([len(p) for p in per]))

    def _check_replica_agrees(self, seqs: list[Sequence]) -> None:
        """The ranks of a tensor-parallel replica sampled the same tokens (they see the same logits and seeds; a rank
        that drew otherwise would make its scheduler part ways with the others')."""
        digest = hashlib.sha256(repr([s.output_token_ids for s in seqs]).encode()).digest()
        mine = int.from_bytes(digest[:7], "little")
        if self.tp.reduce_int(mine, "min") != self.tp.reduce_int(mine, "max"):
            raise RuntimeError(f"engine: the {self.tp.size} ranks of a tensor-parallel replica generated different "
                               "tokens from the same prompts; this is a bug (their logits or seeds differ)")

    def _copy_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], local: bool = False) -> None:
        """Copy whole weights (HF names) in place: a tensor-parallel rank takes its slice of each (`local`: they are
        its slices already)."""
        layout = layout_of(self.model)
        items = named_tensors if layout is None or local else layout.local_items(named_tensors)
        if self.quantization is None:
            copy_named_tensors(self.model, items, who="engine's model")
            return
        names: set[str] = set()           # the FP8 copies follow the new weights (also when shared: no copy)
        copy_named_tensors(self.model, _recording(items, names), who="engine's model")
        fp8.requantize(self.model, names)

    def _make_sequences(self, prompts: list[list[int]], params: SamplingParams, first_index: int = 0,
                        multi_modal_inputs: list[dict | None] | None = None) -> list[Sequence]:
        if not 0 < params.top_p <= 1 or params.temperature < 0:
            raise ValueError(f"SamplingParams(top_p={params.top_p}, temperature={params.temperature}): top_p must be "
                             "in (0, 1] (1 = off) and temperature >= 0 (0 = greedy)")
        stop = frozenset() if params.ignore_eos else frozenset(self.eos_ids) | frozenset(params.stop_token_ids)
        sp = SequenceParams(temperature=0.0 if params.greedy else params.temperature, top_p=params.top_p,
                            top_k=params.top_k, max_tokens=params.max_tokens, min_tokens=params.min_tokens,
                            stop_token_ids=stop)
        base = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
        if params.stop and self.tokenizer is None:
            raise ValueError(f"SamplingParams.stop={params.stop!r}: stop strings need a tokenizer to decode the "
                             "outputs; build the engine with LatheEngine(..., tokenizer=tokenizer)")
        stops = None
        if params.stop and params.max_tokens > 0:
            stops = StopStrings.from_tokenizer(params.stop, self.tokenizer)
        if multi_modal_inputs is not None and len(multi_modal_inputs) != len(prompts):
            raise ValueError(f"multi_modal_inputs has {len(multi_modal_inputs)} entries for {len(prompts)} prompts; "
                             "give one per prompt (None for a text prompt)")
        seqs = []
        for i, prompt in enumerate(prompts):
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompt {i}: {len(prompt)} tokens, max_model_len={self.max_model_len}; "
                                 "shorten it or raise max_model_len")
            mm = self._prompt_images(i, prompt, None if multi_modal_inputs is None else multi_modal_inputs[i])
            leader = None
            for j in range(params.n):
                index = i * params.n + j
                seed = None if sp.greedy else sequence_seed(base, first_index + index)
                seqs.append(Sequence(list(prompt), sp, seed, index=index,
                                     length_limit=min(len(prompt) + sp.max_tokens, self.max_model_len), mm=mm,
                                     leader=leader))
                if self.fork_samples and j == 0:
                    leader = seqs[-1]           # the others fork from the first once its prompt is computed
                if stops is not None:
                    self._stop_matchers[seqs[-1]] = stops.matcher(min_tokens=params.min_tokens, prompt_len=len(prompt))
        return seqs

    def prepare_images(self, prompt: list[int], inputs: dict | None, *, where: str = "prompt"):
        """A prompt's shared image state (`multimodal.prepare_prompt`: its images encoded, its 3D positions), None
        for a text prompt. Given as the prompt's `multi_modal_inputs` entry, to `generate` or `add_request`, for
        this prompt or any prompt that continues it (later turns of a conversation), it is reused: the images are
        encoded once, and the tokens after this prompt are text (`multimodal.check_continuation`). A weight load
        drops its embeddings wherever it is held (an agent's trajectory between two turns, across a fully-async
        weight sync): the next prefill of a prompt that carries it encodes them with the new vision tower."""
        if inputs is None or inputs.get("pixel_values") is None:
            return None
        if not self.vl:
            raise ValueError(f"{where} carries images, but the engine's model "
                             f"({type(self.model).__name__}) is a text model")
        prepared = prepare_prompt(self.model, prompt, inputs, where)
        self.prepared_images.add(prepared)      # (a weight load drops its embeddings wherever it is held)
        return prepared

    def _prompt_images(self, i: int, prompt: list[int], inputs):
        """Prompt i's shared image state: `inputs` prepared here, or as `prepare_images` prepared it."""
        if isinstance(inputs, MultiModalPrompt):
            return check_continuation(self.model, inputs, prompt, f"prompt {i}")
        return self.prepare_images(prompt, inputs, where=f"prompt {i}")

    def step(self) -> int:
        """One scheduler step (a prefill or a decode); returns how many sequences it ran.

        The step's sampled tokens stay on the device: the next step reads them there, and the host learns them
        one step later (`_resolve`), while that next step runs. Meanwhile each sequence holds a `PENDING`
        placeholder, so lengths, positions and KV slots are already right for scheduling; what needs the
        token's value (stop tokens and strings, prefix keys) waits for it. A sequence that stopped thus runs
        one extra step whose token is dropped. `async_scheduling=False` (the CPU's default) resolves each step
        at once. With nothing left to schedule it only resolves the step still on the device (and returns 0)."""
        if self.scheduler.is_finished():
            self._resolve(self._inflight)
            self._inflight = None
            return 0
        if not self.kv_cache.allocated:
            raise RuntimeError("LatheEngine.step: the engine is asleep (KV cache freed); call wake_up() first")
        if self.drafter is not None:
            return self._speculative_step()
        seqs, is_prefill, copies = self.scheduler.schedule()
        self.kv_cache.copy_blocks(copies)
        if self.routing is not None:
            self.routing.copy_blocks(copies)
        last = self._inflight
        if not seqs:        # (a decode step whose running sequences were all preempted: they wait to be recomputed)
            if self.dp is not None:
                self.dp_idle()
            self._inflight = None
            self._resolve(last)
            return 0
        sampling = (fused_settings(self.model.device, self.vocab_size, seqs)
                    if self.runner.graphs is not None and not is_prefill else None)   # sampled inside the step's graph
        agreed = self._dp_agree(len(seqs), is_prefill, sampling) if self.dp is not None else None
        if is_prefill:
            if self.vl:                         # images whose embeddings a weight load dropped: the new tower's
                for seq in seqs:
                    if seq.mm is not None:
                        ensure_embeddings(self.model, seq.mm)
            logits = self.runner.prefill(seqs, [s.num_scheduled_tokens for s in seqs])
            complete = self.scheduler.prefill_done(seqs)
            if complete != seqs:                # a prompt chunk (nothing to sample for it yet), forked samples
                rows = {id(s): i for i, s in enumerate(seqs)}       # (which sample from their leader's logits)
                logits = logits[[rows[id(s)] if id(s) in rows else rows[id(s.leader)] for s in complete]]
                seqs = complete
            sampled = None
        else:
            logits, sampled = self.runner.decode(seqs, self._pending_inputs(seqs, last), sampling,
                                                 eager=self.dp is not None and agreed is None, agreed=agreed)
        if seqs:
            out = sampled if sampled is not None else sample_on_device(logits, seqs)
            self._inflight = _InFlight(seqs, out)
        else:
            self._inflight = None
        self._resolve(last)                     # the previous step's tokens, while this one runs
        if self._inflight is not None:
            self._inflight.add_placeholders(self)
            if not self.async_scheduling:
                self._resolve(self._inflight)
                self._inflight = None
        return len(seqs)

    def dp_idle(self) -> None:
        """Data-parallel attention, a replica with no sequence this step: its experts take part in the other
        replicas' step with no rows (eagerly, or the agreed graph with padding rows only). `generate` calls it, and
        a loop that streams requests in the replicas' lockstep (the agent loop's `_run`)."""
        agreed = self._dp_agree(0, False, None)
        if agreed is None:
            idle_step(self.model)
        else:                   # (through decode: in inference mode, as the other replicas' replay)
            self.runner.decode([], agreed=agreed)

    def _dp_agree(self, batch: int, prefill: bool, sampling) -> tuple | None:
        """Data-parallel attention (`lathe.engine.data_parallel`): what every replica runs this step, agreed by one
        all-reduce among them (each replica's batch, idle ones with 0): the decode graph (bucket of the largest batch,
        the union of the sampler's searches), the same key everywhere because a capture first runs the step eagerly
        (its collectives execute) and so must happen on every replica at once; or None: eagerly, on every replica,
        when one of them prefills or holds more sequences than the largest graph (or the engine has no graphs: then
        without the all-reduce, as every replica's engine is built alike)."""
        graphs = self.runner.graphs
        if graphs is None:
            return None
        use_k, use_p = (int(sampling.use_k), int(sampling.use_p)) if sampling is not None else (0, 0)
        # eager also where a replica sleeps (an idle one called while its KV cache is freed) or a bucket's gathered
        # rows would pass GATHER_BYTES (the graph's path takes them in one piece)
        eager = (prefill or not graphs.fits(batch) or graphs._bucket(batch) > self._dp_graph_batch
                 or not self.kv_cache.allocated)
        eager, most, use_k, use_p, newest, oldest = self.dp.agree(
            [int(eager), batch, use_k, use_p, graphs.epoch, -graphs.epoch])
        if newest != -oldest:       # a replica reset its graphs (sleep, wake-up) and another not: all forget theirs
            graphs.reset()
            graphs.epoch = newest + 1
        return None if eager else (graphs._bucket(most), bool(use_k), bool(use_p))

    @staticmethod
    def _pending_inputs(seqs: list[Sequence], last: _InFlight | None):
        """(tokens, rows, src) for the decode inputs still on the device: rows of `seqs` whose last token is
        the previous step's sample `src` (see `ModelRunner.take_pending`)."""
        if last is None:
            return None
        n = len(seqs)
        if last.seqs[:n] == seqs:       # the previous batch's first rows, in order (identity comparison)
            return last.tokens, None, n
        rows, src, where = [], [], last.rows
        for i, s in enumerate(seqs):
            if s.token_ids[-1] == PENDING:
                rows.append(i)
                src.append(where[s])
        return (last.tokens, rows, src) if rows else None

    def _resolve(self, step: _InFlight | None) -> None:
        """Bring `step`'s sampled tokens to the host and act on them: fill the placeholders, key the blocks
        they complete (see below), stop the sequences that sampled a stop token or completed a stop string."""
        if step is None:
            return
        tokens, logprobs, waited = step.to_host()
        self.device_wait_s += waited
        bm, bs, matchers = self.block_manager, self.block_manager.block_size, self._stop_matchers
        # A block is keyed (reusable by later prompts) only once its last token's KV is computed: by the step now
        # running (`ahead`), or by the sequence's next decode step. A finished sequence's last token never gets KV,
        # so a later prompt continuing it (the agent loop's next turn) computes it instead of reading a stale slot.
        ahead = self._inflight if self._inflight is not step else None
        strings = len(matchers) > 0
        for seq, row, index in step.pending:       # (runs for every row of every step: kept lean)
            tok = int(tokens[row])
            seq.token_ids[index] = tok
            seq.logprobs[index - seq.num_prompt_tokens] = logprobs[row]
            if tok in seq.params.stop_token_ids or (
                    strings and (m := matchers.get(seq)) is not None and m.check(seq.token_ids)):
                if seq.is_finished:
                    seq.finish_reason = "stop"          # it ended at max_tokens with a stop token: stop, as vLLM
                else:                                   # (the running step, if it holds the row, feeds this token)
                    seq.num_fed = len(seq.token_ids) - (ahead is None or seq not in ahead.rows)
                    self.scheduler.finish(seq, "stop")
            if (index + 1) % bs == 0 and not seq.is_finished:     # the token fills a block: key it ...
                if ahead is not None and seq in ahead.rows:         # ... now, as the running step computes its KV,
                    bm.register_full(seq, index // bs)
                else:                                               # ... or when its decode step is scheduled
                    seq.tail_private = False                        # (`BlockManager.may_append`)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights in place (HF names) and drop every cached prefix: old KV must not serve new weights.
        (Image embeddings live as long as their sequences, and none is unfinished here; streamed requests that wait
        through new weights take them with `load_weights`.)"""
        if not self.scheduler.is_finished():
            raise RuntimeError("LatheEngine.update_weights: sequences are still being generated")
        self._copy_weights(named_tensors)
        self.block_manager.reset()

    def sleep(self) -> None:
        """Free the KV cache (and forget cached prefixes) so training can use the memory: back to PyTorch's
        allocator, or to the driver where it is fixed-address memory (`lathe.engine.vmm`, which brings it back under
        the same addresses). The decode graphs and the allocator's cached blocks are kept while the device has room
        to spare (`KEEP_CACHED_FRACTION`), else released too (the graphs kept where the cache is fixed-address).
        Unfinished streamed requests must hold no KV (`interrupt()` first); they continue after `wake_up()`."""
        if self.scheduler.running or self.scheduler.prefilling is not None:
            raise RuntimeError("LatheEngine.sleep: sequences hold KV blocks; call engine.interrupt() first")
        self._resolve(self._inflight)
        self._inflight = None
        self.block_manager.reset()
        self._kv_address = self._addresses()
        self._free_kv()
        if self.states is not None:             # a hybrid model's linear-attention states go too
            self.states.free_memory()
        device = self.model.device
        # With room to spare, the freed cache stays with the allocator (the trainer may use it; `wake_up` takes it
        # back, at the same address if nothing split it, and the decode graphs stay valid). Near the device's
        # limit everything goes back to the driver, graphs' pool included, as the trainer may need all of it.
        if device.type == "cuda":
            free, total = accel.memory_info(device)
            # a tensor-parallel replica's ranks keep or drop their decode graphs together (captured collectives pair
            # up only while every rank replays the same graphs)
            self._cache_kept = bool(self.tp.min_int(total - free <= KEEP_CACHED_FRACTION * total))
        else:
            self._cache_kept = False
        if not self._cache_kept:
            self._release_memory()

    def _free_kv(self) -> None:
        """Free the KV cache and a speculative engine's draft-layer cache."""
        self.kv_cache.free()
        if self.drafter is not None:
            self.drafter.cache.free()

    def _addresses(self) -> tuple:
        """Where the decode graphs' device memory lives: the KV cache and a hybrid model's linear-attention states
        (graphs captured against them are kept across a sleep only when both come back there)."""
        return self.kv_cache.address, None if self.states is None else self.states.address

    def _release_memory(self) -> None:
        """Everything the engine holds goes back to the driver: the allocator's cached blocks, and the decode graphs
        with their pool, unless the cache is fixed-address memory (`lathe.engine.vmm`), which comes back under the
        graphs' addresses: they are kept then, with their pool, rather than captured again at each rollout."""
        fixed = self.kv_cache.fixed_address and self.states is None and (
            self.drafter is None or self.drafter.cache.fixed_address)
        # (a tensor-parallel replica's ranks keep or drop their graphs together, as in `sleep`)
        if self.runner.graphs is not None and not self.tp.min_int(int(fixed)):
            self.runner.graphs.reset()
        accel.clear_blas_workspaces(self.model.device)      # (see `_default_num_blocks`)
        accel.empty_cache(self.model.device)

    def _blocks_within_utilization(self) -> int:
        """The blocks `gpu_memory_utilization` leaves room for beside the memory allocated now (the allocator's
        accounting alone; `_default_num_blocks` also asks the driver, after emptying the allocator's cache). A block
        of a speculative engine also takes the draft layer's entries (its cache has as many blocks)."""
        device, utilization = self.model.device, self._auto_size[1]
        per_block = self.kv_cache.nbytes // self.kv_cache.shape[0]
        if self.drafter is not None:
            per_block += self.drafter.cache.nbytes // self.drafter.cache.shape[0]
        return int((accel.total_memory(device) * utilization - accel.memory_allocated(device)) // per_block) - 1

    def wake_up(self) -> None:
        """Take the KV cache back after `sleep()`.

        A cache sized from `gpu_memory_utilization` is sized again first: training may now hold more memory
        (an optimizer whose state appears at its first step; `lathe.train.optim` makes AdamW's up front, but other
        classes and tensors kept across steps remain), so the cache shrinks, with a warning that says where the
        device's memory is, rather than
        running the device out of memory. It never grows past its first size. When `sleep` kept the allocator's
        cached memory and the budget still holds the cache, it is taken from there (on an out-of-memory error,
        everything cached goes back to the driver and the cache is sized as above); when it (and a hybrid model's
        linear-attention states) lands where it was, the captured decode graphs are kept, else they are captured
        again."""
        if self.kv_cache.allocated:
            return
        kept, self._cache_kept = self._cache_kept, False
        if kept:
            # cuBLAS's workspaces go first: the update's backward makes one at its first product inside the freed
            # cache (32 MiB splitting its segment), and the cache (or the states) would land elsewhere, the graphs
            # captured again. Safe beside live graphs: a capture keeps no workspace outside its pool (`DecodeGraphs`)
            accel.clear_blas_workspaces(self.model.device)
        if self.states is not None:
            self.states.allocate()
        if kept and (self._auto_size is None or self._blocks_within_utilization() >= self.kv_cache.num_blocks):
            try:
                self.kv_cache.allocate()
                if self.drafter is not None:        # (the draft layer's cache too, or both are sized again)
                    self.drafter.cache.allocate()
            except torch.OutOfMemoryError:
                self._free_kv()
                logger.info("engine: the allocator's cached memory did not hold the KV cache; releasing it")
        # a rank of a tensor-parallel replica that sizes its cache again makes them all do it, to the same size
        if self.tp.size > 1 and not self.tp.min_int(int(self.kv_cache.allocated)) and self.kv_cache.allocated:
            self._free_kv()
        if not self.kv_cache.allocated:
            if kept:
                self._release_memory()
            if self._auto_size is not None and self.model.device.type == "cuda":
                blocks = self._default_num_blocks(*self._auto_size)
                if blocks < self.kv_cache.num_blocks:
                    logger.warning("engine: KV cache shrinks from %d to %d blocks of %d tokens to stay within "
                                   "gpu_memory_utilization=%.2f (%.2f GiB allocated, %.2f GiB held by PyTorch's "
                                   "allocator unallocated, %.2f GiB free)", self.kv_cache.num_blocks, blocks,
                                   self.kv_cache.block_size, self._auto_size[1], *(b / 2**30 for b in self._sizing))
                    self.kv_cache.shape = (blocks + 1,) + self.kv_cache.shape[1:]
                    self.block_manager.resize(blocks)
            self.kv_cache.allocate()
        if self.drafter is not None:            # the draft layer's cache: as many blocks as the main one
            self.drafter.cache.shape = self.kv_cache.shape[:1] + self.drafter.cache.shape[1:]
            self.drafter.cache.allocate()
        graphs = self.runner.graphs
        if graphs is not None:
            if self.tp.min_int(self._addresses() == self._kv_address):
                graphs.forget_rows()         # the block manager started over: every table row is written anew
            else:
                graphs.reset()
