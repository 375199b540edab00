"""The engine: a loaded model, its KV/state pools, and one forward + sample per scheduled batch."""

from __future__ import annotations

import logging

import torch

from freetoken.batch import ForwardBatch
from freetoken.config import EngineConfig
from freetoken.engine.memory import PoolSizes, size_pools
from freetoken.engine.sample import SampleResult, sample
from freetoken.kernels import set_kernel_backend
from freetoken.models.loader import LoadedModel, load_model
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


class Engine:
    def __init__(self, config: EngineConfig, model_dir: str) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        set_kernel_backend(None if config.kernel_backend == "auto" else config.kernel_backend)
        self.loaded: LoadedModel = load_model(model_dir, config.dtype, self.device)
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

    def create_pools(self) -> tuple[PagePool, SlotPool]:
        return PagePool(self.pool_sizes.num_pages, self.config.page_size), SlotPool(self.pool_sizes.num_slots)

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    def build_forward_batch(self, batch: ScheduledBatch) -> ForwardBatch:
        page_size = self.config.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu_seqlens = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        max_pages = max(len(req.pages) for req in batch.requests)
        page_table = torch.zeros(len(batch.requests), max_pages, dtype=torch.int32)
        for i, (req, num_tokens) in enumerate(zip(batch.requests, batch.num_tokens)):
            start = req.num_computed
            input_ids += req.token_ids[start : start + num_tokens]
            span = range(start, start + num_tokens)
            positions += span
            slot_mapping += [req.pages[p // page_size] * page_size + p % page_size for p in span]
            cu_seqlens.append(cu_seqlens[-1] + num_tokens)
            seq_lens.append(start + num_tokens)
            page_table[i, : len(req.pages)] = torch.tensor(req.pages, dtype=torch.int32)
            if batch.samples[i]:
                logits_indices.append(cu_seqlens[-1] - 1)
        num_decodes = 0
        while num_decodes < len(batch.num_tokens) and batch.num_tokens[num_decodes] == 1:
            num_decodes += 1

        def to_device(values, dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        return ForwardBatch(
            input_ids=to_device(input_ids, torch.int64),
            positions=to_device(positions, torch.int64),
            cu_seqlens=to_device(cu_seqlens, torch.int32),
            seq_lens=to_device(seq_lens, torch.int32),
            page_table=page_table.to(self.device, non_blocking=True),
            slot_mapping=to_device(slot_mapping, torch.int64),
            state_slots=to_device([req.slot for req in batch.requests], torch.int32),
            logits_indices=to_device(logits_indices, torch.int64),
            num_decodes=num_decodes,
            max_query_len=max(batch.num_tokens),
            query_lens=list(batch.num_tokens),
        )

    @torch.inference_mode()
    def step(self, batch: ScheduledBatch) -> SampleResult:
        """Run the batch and sample a token for each request that reached its last known token."""
        if batch.fresh_slots:
            self.model.reset_slots(torch.tensor(batch.fresh_slots, dtype=torch.int64, device=self.device))
        forward_batch = self.build_forward_batch(batch)
        logits = self.model(forward_batch)
        if logits.shape[0] == 0:
            return SampleResult([], [])
        return sample(logits, batch.sampling_requests)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits at every position of one prompt, run as a single prefill in slot 1 / pages
        from 1 upward: a debugging and testing aid, only valid while no request is running."""
        page_size = self.config.page_size
        num_pages = -(-len(token_ids) // page_size)
        if num_pages >= self.pool_sizes.num_pages:
            raise ValueError("prompt longer than the KV cache")
        pages = list(range(1, num_pages + 1))
        self.model.reset_slots(torch.tensor([1], device=self.device))
        n = len(token_ids)
        batch = ForwardBatch(
            input_ids=torch.tensor(token_ids, device=self.device),
            positions=torch.arange(n, device=self.device),
            cu_seqlens=torch.tensor([0, n], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=self.device),
            page_table=torch.tensor([pages], dtype=torch.int32, device=self.device),
            slot_mapping=torch.tensor(
                [pages[p // page_size] * page_size + p % page_size for p in range(n)], device=self.device
            ),
            state_slots=torch.tensor([1], dtype=torch.int32, device=self.device),
            logits_indices=torch.arange(n, device=self.device),
            num_decodes=1 if n == 1 else 0,
            max_query_len=n,
            query_lens=[n],
        )
        return self.model(batch)
