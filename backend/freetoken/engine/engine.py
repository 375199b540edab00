"""The engine: a loaded model, its KV/state pools, and one forward + sample per scheduled batch."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch

from freetoken.batch import ForwardBatch
from freetoken.config import EngineConfig
from freetoken.engine.graph_runner import DecodeGraphRunner
from freetoken.engine.memory import PoolSizes, size_pools
from freetoken.engine.sample import SampleResult, sample
from freetoken.kernels import KernelBackend, get_kernel_backend, set_kernel_backend
from freetoken.models.loader import LoadedModel, load_model, load_random_model, read_config
from freetoken.models.registry import text_config_of
from freetoken.scheduler.cache import PagePool, SlotPool
from freetoken.scheduler.scheduler import ScheduledBatch

logger = logging.getLogger(__name__)


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


@dataclass
class BatchEntry:
    """One request's part of a step: its tokens ``[num_computed, num_computed + num_tokens)``."""

    token_ids: list[int]
    num_computed: int
    num_tokens: int
    pages: list[int]
    slot: int
    logits: Literal["last", "all"] | None  # which of its positions need logits


class Engine:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        set_kernel_backend(None if config.kernel_backend == "auto" else config.kernel_backend)
        if config.load_format == "dummy":
            self.loaded: LoadedModel = load_random_model(read_config(model_dir), config.dtype, self.device, config.seed)
        else:
            self.loaded = load_model(model_dir, config.dtype, self.device)
        self.model = self.loaded.model
        configure_precision(self.loaded.dtype)
        text_config = text_config_of(self.loaded.config)
        self.max_model_len = min(config.max_model_len or self.model.max_position_embeddings,
                                 self.model.max_position_embeddings)
        self.pool_sizes: PoolSizes = size_pools(
            self.model, config, self.device, self.max_model_len, text_config.hidden_size
        )
        self.model.allocate_state(self.pool_sizes.num_pages, config.page_size, self.pool_sizes.num_slots)
        self.max_pages_per_request = -(-self.max_model_len // config.page_size)
        self.graph_runner: DecodeGraphRunner | None = None
        if self._graphs_wanted():
            max_bs = min(config.cuda_graph_max_bs or config.max_running_requests, config.max_running_requests)
            self.graph_runner = DecodeGraphRunner(
                self.model, self.device, max_bs, self.max_pages_per_request, self.max_model_len, use_graphs=True
            )
            self.graph_runner.capture()

    def _graphs_wanted(self) -> bool:
        """CUDA graphs on CUDA with the Triton kernels, unless ``enforce_eager``. The torch reference
        ops read sizes back to the host (``.tolist()``), which a graph cannot capture."""
        if self.config.enforce_eager or self.device.type != "cuda":
            return False
        if get_kernel_backend() is KernelBackend.TORCH:
            logger.info("CUDA graphs off: kernel_backend torch reads sizes back to the host")
            return False
        return True

    def create_pools(self) -> tuple[PagePool, SlotPool]:
        return PagePool(self.pool_sizes.num_pages, self.config.page_size), SlotPool(self.pool_sizes.num_slots)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def build_forward_batch(self, entries: list[BatchEntry]) -> ForwardBatch:
        """The device batch for requests given in the ``ForwardBatch`` order (single tokens first)."""
        page_size = self.config.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        kv_locations: list[int] = []
        cu_seqlens = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        page_table = torch.zeros(len(entries), max(len(e.pages) for e in entries), dtype=torch.int32)
        for i, entry in enumerate(entries):
            start, end = entry.num_computed, entry.num_computed + entry.num_tokens
            input_ids += entry.token_ids[start:end]
            positions += range(start, end)
            kv_locations += [entry.pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
            first_token = cu_seqlens[-1]
            cu_seqlens.append(first_token + entry.num_tokens)
            seq_lens.append(end)
            page_table[i, : len(entry.pages)] = torch.tensor(entry.pages, dtype=torch.int32)
            if entry.logits == "last":
                logits_indices.append(cu_seqlens[-1] - 1)
            elif entry.logits == "all":
                logits_indices += range(first_token, cu_seqlens[-1])
        num_tokens = [e.num_tokens for e in entries]
        num_decodes = 0
        while num_decodes < len(num_tokens) and num_tokens[num_decodes] == 1:
            num_decodes += 1

        def to_device(values, dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        return ForwardBatch(
            input_ids=to_device(input_ids, torch.int64),
            positions=to_device(positions, torch.int64),
            cu_seqlens=to_device(cu_seqlens, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            page_table=page_table.to(self.device, non_blocking=True),
            kv_locations=to_device(kv_locations, torch.int64),
            state_slots=to_device([e.slot for e in entries], torch.int32),
            logits_indices=to_device(logits_indices, torch.int64),
            num_decodes=num_decodes,
            max_query_len=max(num_tokens),
            query_lens=num_tokens,
            max_seq_len=max(seq_lens),
        )

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> SampleResult:
        """Run the batch and sample a token for each request that reached its last known token."""
        if batch.fresh_slots:
            self.model.reset_slots(torch.tensor(batch.fresh_slots, dtype=torch.int64, device=self.device))
        entries = [
            BatchEntry(req.token_ids, req.num_computed, n, req.pages, req.slot, "last" if samples else None)
            for req, n, samples in zip(batch.requests, batch.num_tokens, batch.samples)
        ]
        logits = self._forward(entries)
        if logits.shape[0] == 0:
            return SampleResult([], [])
        return sample(logits, batch.sampling_requests)

    def _forward(self, entries: list[BatchEntry]) -> torch.Tensor:
        """Logits of the entries' wanted rows, in order. With graphs, a step mixing decodes and
        prefill chunks runs as two forwards, the decodes replayed and the chunks eager (the
        requests are independent, so the split changes no result; docs/architecture.md)."""
        runner = self.graph_runner
        num_decodes = next((i for i, e in enumerate(entries) if e.num_tokens != 1), len(entries))
        if runner is not None and 0 < num_decodes < len(entries) and num_decodes <= runner.max_batch_size:
            return torch.cat([self._run(entries[:num_decodes]), self._run(entries[num_decodes:])])
        return self._run(entries)

    def _run(self, entries: list[BatchEntry]) -> torch.Tensor:
        batch = self.build_forward_batch(entries)
        if self.graph_runner is not None and self.graph_runner.supports(batch):
            return self.graph_runner.run(batch)
        return self.model(batch)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], pages: list[int], slot: int) -> torch.Tensor:
        """float32 logits after every position of one prompt ``[len, vocab]``, computed in chunks of
        ``max_prefill_length`` as a request would be, in the given pages and state slot."""
        self.model.reset_slots(torch.tensor([slot], device=self.device))
        chunk = self.config.max_prefill_length
        logits = []
        for start in range(0, len(token_ids), chunk):
            entry = BatchEntry(token_ids, start, min(chunk, len(token_ids) - start), pages, slot, "all")
            logits.append(self.model(self.build_forward_batch([entry])))
        return torch.cat(logits)
