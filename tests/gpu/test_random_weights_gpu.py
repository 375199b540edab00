"""Random NVFP4 weights drawn on the GPU for a weight that lives in host memory (offloaded experts):
the same bytes as a weight of the same seed made on the GPU itself."""

from __future__ import annotations

import pytest
import torch

from freetoken.layers.linear import NVFP4Weight
from freetoken.models.random_weights import fill_nvfp4

pytestmark = pytest.mark.gpu


def test_a_host_weight_drawn_on_the_gpu_equals_the_resident_draw() -> None:
    cuda = torch.device("cuda", torch.cuda.current_device())
    resident = NVFP4Weight((3, 64, 96), cuda)
    host = NVFP4Weight((3, 64, 96), torch.device("cpu"))
    fill_nvfp4(resident, torch.Generator(cuda).manual_seed(7))
    fill_nvfp4(host, torch.Generator(cuda).manual_seed(7))
    assert host.packed.device.type == "cpu"
    assert torch.equal(host.packed, resident.packed.cpu())
    assert torch.equal(host.scales.view(torch.uint8), resident.scales.view(torch.uint8).cpu())
    assert torch.equal(host.row_scales, resident.row_scales.cpu())
    assert host.packed.float().std() > 50  # random bytes, not a constant fill
