"""The engine: a loaded model, its KV/state pools, and one forward + sample per step plan."""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from freetoken.config import EngineConfig
from freetoken.batch import ForwardBatch
from freetoken.engine.buffers import StepBuffers, split_decodes
from freetoken.engine.graph_runner import DecodeGraphRunner
from freetoken.engine.prefill_graphs import PrefillGraphRunner, prefill_capture_sizes
from freetoken.engine.memory import PoolSizes, size_expert_cache, size_pools
from freetoken.experts.cache import CacheCounters
from freetoken.experts.offload import ExpertOffload
from freetoken.engine.outputs import OutputRing, StepOutput
from freetoken.engine.sample import SlotSampler
from freetoken.kernels import KernelBackend, get_kernel_backend, set_kernel_backend
from freetoken.kernels.prefill_snapshots import PrefillSnapshots
from freetoken.layers.moe import DECODE_MAX_TOKENS
from freetoken.models.loader import LoadedModel, load_model, load_random_model
from freetoken.models.registry import text_config_of
from freetoken.plan import PageUpdate, PlanRow, StepPlan

logger = logging.getLogger(__name__)

# The in-forward snapshot tables of a prefill (``ForwardBatch.snapshots``) are built when the first
# Gated DeltaNet layer asks, behind its in_proj GEMM on the device, instead of before the forward's
# first launch (0.4-0.6 ms of host time on the H200 host at an 8k prompt). False: before (A/B runs).
DEFER_SNAPSHOT_TABLES = True


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but torch sees no CUDA device")
    return torch.device(name)


def configure_precision(dtype: torch.dtype) -> None:
    """float32 runs use true float32 dot products (no TF32), so they match the reference."""
    exact = dtype == torch.float32
    torch.backends.cuda.matmul.allow_tf32 = not exact
    torch.backends.cudnn.allow_tf32 = not exact
    torch.set_float32_matmul_precision("highest" if exact else "high")


class Engine:
    """A loaded model with its pools, persistent step buffers and per-slot sampler; it runs
    ``StepPlan``s. ``launch`` only queues device work and returns the step's pending output, so a
    caller may prepare the next step while this one runs. All device work goes to one stream:
    a later step can never overtake an earlier one, which is what lets the runtime reuse a page
    or slot as soon as the host knows it is free."""

    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        set_kernel_backend(None if config.kernel_backend == "auto" else config.kernel_backend)
        self.offload: ExpertOffload | None = None
        if config.moe_offload:
            self.offload = ExpertOffload(
                config.expert_cache_policy, pin=self.device.type == "cuda", prefetch=config.expert_prefetch,
                prefill_stream=config.expert_prefill_stream, stream_depth=config.prefill_stream_depth,
            )
        if config.load_format == "dummy":
            self.loaded: LoadedModel = load_random_model(model_dir, config.dtype, self.device, config.seed, self.offload)
        else:
            self.loaded = load_model(model_dir, config.dtype, self.device, self.offload)
        self.model = self.loaded.model
        configure_precision(self.loaded.dtype)
        text_config = text_config_of(self.loaded.config)
        self.max_model_len = min(config.max_model_len or self.model.max_position_embeddings,
                                 self.model.max_position_embeddings)
        self.pool_sizes: PoolSizes = size_pools(
            self.model, config, self.device, self.max_model_len, text_config.hidden_size
        )
        num_slots = self.pool_sizes.num_slots
        if self.offload is not None:
            if not self.offload.layers:
                raise ValueError("moe_offload: the model has no routed experts")
            cache_slots = size_expert_cache(
                config, self.device, self.pool_sizes, text_config.hidden_size, self.offload.expert_bytes,
                self.offload.num_experts, len(self.offload.layers),
            )
        # Snapshot slots are state rows only: no page-table row, no sampling tables.
        self.model.allocate_state(self.pool_sizes.num_pages, config.page_size, self.pool_sizes.num_state_slots)
        if self.offload is not None:
            self.offload.allocate(cache_slots, self.device, decode_tokens=DECODE_MAX_TOKENS)
        self.max_pages_per_request = -(-self.max_model_len // config.page_size)
        max_rows = num_slots - 1
        self.buffers = StepBuffers(
            max_rows=max_rows,
            max_tokens=config.max_prefill_length + max_rows,
            num_slots=num_slots,
            max_pages_per_slot=self.max_pages_per_request,
            page_size=config.page_size,
            device=self.device,
        )
        self.sampler = SlotSampler(num_slots, self.model.vocab_size, self.device)
        self.outputs = OutputRing(max_rows, self.device)
        self.graph_runner: DecodeGraphRunner | None = None
        self.prefill_runner: PrefillGraphRunner | None = None
        if self._graphs_wanted():
            max_bs = min(config.cuda_graph_max_bs or config.max_running_requests, config.max_running_requests)
            if self.offload is not None:  # larger decode steps read the routed ids on the host
                max_bs = min(max_bs, DECODE_MAX_TOKENS)
            self.graph_runner = DecodeGraphRunner(
                self.model, self.device, max_bs, self.max_pages_per_request, self.max_model_len, use_graphs=True
            )
            self.graph_runner.capture()
            sizes = self._prefill_graph_sizes()
            if sizes:
                self.prefill_runner = PrefillGraphRunner(
                    self.model, self.device, sizes, config.prefill_cuda_graph_max_seqs, self.max_pages_per_request,
                    self.max_model_len, use_graphs=True,
                )
                self.prefill_runner.capture(self.graph_runner.pool)

    def _graphs_wanted(self) -> bool:
        """CUDA graphs on CUDA with the Triton kernels, unless ``enforce_eager``. The torch reference
        ops read sizes back to the host (``.tolist()``), which a graph cannot capture. With
        ``moe_offload`` the graphs hold the zero-copy decode kernels, so only decode steps of at
        most ``DECODE_MAX_TOKENS`` requests are captured."""
        if self.config.enforce_eager or self.device.type != "cuda":
            return False
        if self.offload is not None and not self.offload.zero_copy:
            logger.info("CUDA graphs off: moe_offload without the zero-copy decode decides on the host which "
                        "experts to copy in each layer")
            return False
        if get_kernel_backend() is KernelBackend.TORCH:
            logger.info("CUDA graphs off: kernel_backend torch reads sizes back to the host")
            return False
        return True

    def _prefill_graph_sizes(self) -> list[int]:
        """The token buckets of the prefill graphs (none if off). Their static batch always takes
        snapshots inside the forward (fixed-size tables), so a model that cannot (Qwen4-Exp: its
        PLE windows and n-gram context have no in-forward snapshot) prefills eagerly. With
        ``moe_offload`` a prefill reads its routed ids on the host (its experts are copied in, in
        passes), which no graph can hold: prefill stays eager."""
        cap = min(self.config.prefill_cuda_graph_max_tokens, self.config.max_prefill_length)
        if cap and self.offload is not None:
            logger.info("prefill CUDA graphs off: moe_offload prefills read their routed ids on the host")
            return []
        if cap and not self.model.snapshots_in_forward:
            logger.info("prefill CUDA graphs off: %s takes no snapshots inside a forward", type(self.model).__name__)
            return []
        return prefill_capture_sizes(cap)

    def expert_cache_counters(self) -> tuple[CacheCounters, int] | None:
        """The expert cache's counters and its slots; None when the experts are resident."""
        if self.offload is None:
            return None
        return self.offload.counters, self.offload.num_slots

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def _slot_tensor(self, slots: list[int]) -> torch.Tensor:
        """Slot ids on the device without a host sync: from pinned memory, asynchronously, on CUDA."""
        pinned = self.device.type == "cuda"
        return torch.tensor(slots, dtype=torch.int64, pin_memory=pinned).to(self.device, non_blocking=pinned)

    def _prepare(self, plan: StepPlan) -> None:
        """Slot copies, then resets, queued before the forward (on the one stream, after every
        earlier step). The copies are one parallel copy per state tensor: each reads the state as
        the previous step left it, so a snapshot of a slot and a restore into the same slot, reused
        by another request, may share a plan; resets come after, so a slot snapshotted and then
        handed to a fresh request is read before it is zeroed. (Sampling admissions are queued
        after the forward: only the sampling reads them.)"""
        if plan.copy_slots:
            src, dst = zip(*plan.copy_slots)
            self.model.copy_slots(self._slot_tensor(list(src)), self._slot_tensor(list(dst)))
        if plan.reset_slots:
            self.model.reset_slots(self._slot_tensor(plan.reset_slots))

    @staticmethod
    def _snapshot_entries(plan: StepPlan) -> list[tuple[int, int, int]]:
        """The plan's in-forward snapshots as ``(prefill row, offset, slot)`` (rows after the decodes)."""
        first = plan.num_decodes
        for snapshot in plan.snapshots:
            if snapshot.row < first or snapshot.row >= len(plan.rows):
                raise ValueError(f"snapshot {snapshot}: row {snapshot.row} is no prefill row of the plan")
        return [(s.row - first, s.offset, s.slot) for s in plan.snapshots]

    def _prefill_snapshots(self, plan: StepPlan) -> PrefillSnapshots:
        """The plan's in-forward snapshots' device layout, by prefill row."""
        query_lens = [row.num_new for row in plan.rows[plan.num_decodes :]]
        return self.model.prefill_snapshots(query_lens, self._snapshot_entries(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> StepOutput:
        """Queue the plan's forward and sampling; the result comes through the returned output.
        The host work before the forward is only what it reads (slot copies and resets, staging).
        With ``moe_offload``, the expert cache's updates between steps (what arrived settled, slots
        lent for the read-through fill) are queued first and the step's routed ids are settled when
        it is resolved (``experts.offload``)."""
        on_resolve = None
        if self.offload is not None and self.offload.zero_copy:
            self.offload.between_steps()
            on_resolve = self.offload.settle
        self._prepare(plan)
        staged = self.buffers.stage(plan, self.sampler.last_token)
        prefill = self.prefill_runner
        if prefill is not None and prefill.supports(staged.batch, len(plan.snapshots)):
            logits = prefill.run(staged.batch, self._snapshot_entries(plan))
        else:
            if plan.snapshots:
                build = functools.partial(self._prefill_snapshots, plan)
                staged.batch.snapshots = build if DEFER_SNAPSHOT_TABLES else build()
            decode_logits = sum(1 for row in plan.rows[: plan.num_decodes] if row.samples)
            logits = self._forward(staged.batch, decode_logits)
        # Behind the forward's launches: the host stages the admissions while the device computes,
        # not before its first kernel (a prompt's time to first token).
        self.sampler.admit(plan.admissions)
        host_slots = [row.slot for row in plan.sampling_rows]
        if not host_slots:  # prompt chunks only
            return self.outputs.send(torch.zeros(0, dtype=torch.int64, device=self.device), None, [], on_resolve)
        token_ids, logprobs = self.sampler.sample(logits, staged.sample_slots, host_slots)
        return self.outputs.send(token_ids, logprobs, staged.sampled_rows, on_resolve)

    def _forward(self, batch: ForwardBatch, decode_logits: int) -> torch.Tensor:
        """Logits of the batch's logits rows, in order. With graphs, a decode-only step replays; a
        step mixing decodes and prefill chunks runs as two forwards, the decodes replayed and the
        chunks eager (the requests are independent, so the split changes no result;
        docs/architecture.md). ``decode_logits``: how many logits rows are decode rows'."""
        runner = self.graph_runner
        if runner is None:
            return self._eager(batch)
        if 0 < batch.num_decodes < batch.num_requests and batch.num_decodes <= runner.max_batch_size:
            decodes, chunks = split_decodes(batch, decode_logits)
            return torch.cat([self._replay(runner, decodes), self._eager(chunks)])
        if runner.supports(batch):
            return self._replay(runner, batch)
        return self._eager(batch)

    def _eager(self, batch: ForwardBatch) -> torch.Tensor:
        if self.offload is not None and self.offload.streams(batch.num_tokens):
            # The first layer's experts cross PCIe during its attention (``experts.offload``).
            self.offload.start_forward(F.embedding(batch.input_ids, self.model.embed_tokens))
        logits = self.model(batch)
        self._collect_routing(batch.num_tokens, batch.num_tokens)
        return logits

    def _replay(self, runner: DecodeGraphRunner, batch: ForwardBatch) -> torch.Tensor:
        logits = runner.run(batch)
        self._collect_routing(runner.padded_size(batch.num_requests), batch.num_requests)
        return logits

    def _collect_routing(self, forward_tokens: int, real_tokens: int) -> None:
        """After a forward of ``forward_tokens`` (a graph's padded size) that ran the offloaded
        layers' zero-copy decode kernels: their routed ids of the ``real_tokens`` go to the host."""
        if self.offload is not None and self.offload.decodes(forward_tokens):
            self.offload.collect(real_tokens)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], pages: list[int], slot: int) -> torch.Tensor:
        """float32 logits after every position of one prompt ``[len, vocab]``, computed in chunks of
        ``max_prefill_length`` as a request would be, in the given pages and state slot."""
        self.model.reset_slots(torch.tensor([slot], device=self.device))
        chunk, page_size = self.config.max_prefill_length, self.config.page_size
        logits = []
        for start in range(0, len(token_ids), chunk):
            end = min(start + chunk, len(token_ids))
            first_page, last_page = -(-start // page_size), -(-end // page_size)
            plan = StepPlan(
                rows=[PlanRow(slot, start, end - start, False, tuple(token_ids[start:end]))],
                page_updates=[PageUpdate(slot, first_page, tuple(pages[first_page:last_page]))],
            )
            staged = self.buffers.stage(plan, self.sampler.last_token, all_logits=True)
            if self.offload is not None:
                self.offload.between_steps()
            logits.append(self._eager(staged.batch))
        if self.offload is not None:
            self.offload.settle(wait=True)
        return torch.cat(logits)
