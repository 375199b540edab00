"""Random weights for a model built without a checkpoint (``load_format="dummy"``, vLLM's name).

Benchmarks of real shapes need weights that behave like trained ones where speed depends on
them, without a 70 GB checkpoint: values are drawn on the device the model lives on, chosen by
checkpoint name (``CausalLM.weight_targets``) so that

- every projection keeps activations at unit scale (``std = 1 / sqrt(fan_in)``, fan-in the last
  dim), so 40 layers of bf16 stay finite;
- router logits are about N(0, 1) per expert for every token: top-k choices vary from token to
  token and spread over all experts (near-uniform routing, as the HBM floor assumes), neither
  collapsed on a few experts nor tied;
- norm multipliers are near 1 (zero-centred norms store ``w`` around 0, the gated GDN norm around
  1), GDN decays ``A = exp(A_log)`` in [1, 16] and ``dt_bias = 1`` as transformers initialises them;
- an NVFP4 weight (an NVFP4 config's dummy load) gets uniform random bytes (every e2m1 code, both
  signs), e4m3 block scales in [1, 1.875] and a per-row scale that gives the dequantized weight the
  same ``1 / sqrt(fan_in)`` standard deviation; made in place on the device, never in bf16.
"""

from __future__ import annotations

import math

import torch

from freetoken.layers.linear import NVFP4Weight
from freetoken.layers.weights import WeightTarget
from freetoken.models.base import CausalLM

NORM_NOISE = 0.1
# e4m3 codes of the random block scales: 0x38..0x3f are 1, 1.125, ..., 1.875.
SCALE_CODES = range(0x38, 0x40)


def _mean_square(values: torch.Tensor) -> float:
    return values.float().square().mean().item()


# A uniform random byte holds two uniform e2m1 codes: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
E2M1_MEAN_SQUARE = _mean_square(torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]))
SCALE_MEAN_SQUARE = _mean_square(
    torch.tensor(list(SCALE_CODES), dtype=torch.uint8).view(torch.float8_e4m3fn)
)


def fill_nvfp4(weight: NVFP4Weight, generator: torch.Generator) -> None:
    """Random codes and block scales, and the row scale that makes ``std(w) = 1 / sqrt(fan_in)``.
    Drawn on the generator's device and copied where the weight lives (offloaded experts sit in
    host memory, where drawing gigabytes of bytes one by one takes minutes)."""
    fan_in = weight.shape[-1]
    draw_on = generator.device
    for dst, low, high in ((weight.packed, 0, 256), (weight.scales.view(torch.uint8), SCALE_CODES.start, SCALE_CODES.stop)):
        if dst.device == draw_on:
            dst.random_(low, high, generator=generator)
        else:
            dst.copy_(torch.empty(dst.shape, dtype=dst.dtype, device=draw_on).random_(low, high, generator=generator))
    weight.row_scales.fill_(1.0 / math.sqrt(fan_in * E2M1_MEAN_SQUARE * SCALE_MEAN_SQUARE))


def _fill(name: str, dst: torch.Tensor, generator: torch.Generator) -> None:
    parts = name.rsplit(".", 2)
    module = parts[-2] if len(parts) > 1 else ""
    if name.endswith("A_log"):
        dst.uniform_(1.0, 16.0, generator=generator).log_()
    elif name.endswith("dt_bias"):
        dst.fill_(1.0)
    elif name.endswith("linear_attn.norm.weight"):
        dst.normal_(1.0, NORM_NOISE, generator=generator)
    elif "norm" in module:
        dst.normal_(0.0, NORM_NOISE, generator=generator)
    elif name == "embed_tokens.weight" or "ngram_embedding" in name:
        dst.normal_(0.0, 1.0, generator=generator)
    else:
        dst.normal_(0.0, 1.0 / math.sqrt(dst.shape[-1]), generator=generator)


@torch.no_grad()
def randomize_weights(
    model: CausalLM, seed: int, targets: dict[str, WeightTarget] | None = None, device: torch.device | None = None
) -> None:
    """Fill every parameter of ``model`` in place (buffers computed from the config stay).
    ``targets``: the model's weight targets (default ``model.weight_targets()``; after an NVFP4 plan,
    the plan's). Values are drawn on ``device`` (default: where each parameter lives) and copied to
    parameters that live elsewhere: offloaded experts in host memory are drawn on the GPU, which is
    fast, and get the values the resident model of the same seed has."""
    named_targets = model.weight_targets() if targets is None else targets
    parameters = {id(p): (name, p) for name, p in model.named_parameters()}
    generators: dict[torch.device, torch.Generator] = {}

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device).manual_seed(seed)
        return generators[device]

    filled: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, NVFP4Weight):
            fill_nvfp4(module, generator(_indexed(device) if device is not None else module.packed.device))
            filled.update({id(p): p.numel() for p in module.parameters()})
    # Whole-parameter targets first: fused expert tensors fill all experts at once, and the
    # per-expert names that alias them are then skipped.
    for name, target in sorted(named_targets.items(), key=lambda item: _is_part(item[1])):
        key = id(target.param)
        if key not in parameters or filled.get(key, 0) >= target.param.numel():
            continue
        dst = target.destination()
        draw_on = _indexed(device) if device is not None else dst.device
        if target.zero:
            dst.zero_()
        elif dst.device == draw_on:
            _fill(name, dst, generator(draw_on))
        else:
            drawn = torch.empty(dst.shape, dtype=dst.dtype, device=draw_on)
            _fill(name, drawn, generator(draw_on))
            dst.copy_(drawn)
        filled[key] = filled.get(key, 0) + dst.numel()
    for missing, source in model.tied_weights().items():
        named_targets[missing].destination().copy_(named_targets[source].destination())
    unfilled = [name for key, (name, p) in parameters.items() if filled.get(key, 0) < p.numel()]
    if unfilled:
        raise ValueError(f"no weight target covers the parameters {unfilled[:5]}: cannot randomize them")


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as the ``cuda:N`` that tensors made on it report."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _is_part(target: WeightTarget) -> bool:
    return target.index is not None or target.rows is not None
