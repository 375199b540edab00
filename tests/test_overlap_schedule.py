"""The overlapped loop (schedule and resolve while the device runs) against the synchronous one,
the step plan the scheduler emits, and the device-side sampler state."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import pytest
import torch

import transformers

from oracle import PROMPTS
from freetoken import LLM, FinishReason, SamplingParams

PAD_TO = 8
SMALL = dict(dtype="float32", device="cpu", max_prefill_length=16, page_size=4)


def _mixed_params(llm: LLM) -> list[SamplingParams]:
    greedy = llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    stop = greedy.text[5:8]
    eos = sorted(llm.runtime.eos_token_ids)
    return [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=10, seed=11, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.8, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3,
                       max_tokens=10, seed=5, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
        # Stop tokens that min_tokens must block at first; then they may end the request.
        SamplingParams(temperature=1.5, max_tokens=14, min_tokens=6, seed=3, stop_token_ids=eos + [5, 9, 17]),
        SamplingParams(temperature=1.0, min_p=0.05, max_tokens=6, seed=21),
    ]


def _run(llm: LLM, params: list[SamplingParams]) -> list[tuple]:
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params)
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason,
             None if o.logprobs is None else [lp.logprob for lp in o.logprobs]) for o in outputs]


def _assert_pools_full(llm: LLM) -> None:
    stats = llm.runtime.stats()
    assert (stats.pages_used, stats.slots_used, stats.num_running, stats.num_waiting) == (0, 0, 0, 0)
    assert llm.runtime._in_flight is None


@pytest.fixture(scope="module")
def llms(demo_checkpoint):
    return {overlap: LLM(model=str(demo_checkpoint), overlap_schedule=overlap, **SMALL) for overlap in (True, False)}


def test_overlapped_and_synchronous_runs_give_identical_outputs(llms):
    params = _mixed_params(llms[False])
    _mixed_params(llms[True])  # the same prompts cached in both (a prefix hit moves logprobs in the last bits)
    synchronous = _run(llms[False], params)
    overlapped = _run(llms[True], params)
    assert overlapped == synchronous
    stop_out, min_out = synchronous[3], synchronous[4]
    assert stop_out[2] is FinishReason.STOP and isinstance(stop_out[3], str)
    assert len(min_out[0]) >= 6
    for llm in llms.values():
        _assert_pools_full(llm)


def test_min_tokens_blocks_stop_tokens_on_the_device(llms):
    # Every token but a handful is a stop token: without the block the first draw would stop.
    llm = llms[True]
    vocab = llm.runtime.engine.vocab_size
    stops = [t for t in range(vocab) if t not in (7, 8, 9)]
    params = SamplingParams(temperature=1.0, max_tokens=12, min_tokens=6, seed=1, stop_token_ids=stops)
    out = llm.generate(PROMPTS[0], params)[0]
    assert all(t in (7, 8, 9) for t in out.token_ids[:6])
    assert len(out.token_ids) >= 6


def test_repetition_penalty_equals_transformers(demo_checkpoint, llms):
    """Greedy with a repetition penalty, from the device-side per-slot token counts, is
    transformers' ``generate(repetition_penalty=...)`` (the same prompt + output rule)."""
    llm = llms[True]
    prompt = llm.runtime.tokenize(PROMPTS[3])
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, repetition_penalty=1.8, max_tokens=12, ignore_eos=True))[0]
    architecture = transformers.AutoConfig.from_pretrained(str(demo_checkpoint)).architectures[0]
    model = getattr(transformers, architecture).from_pretrained(str(demo_checkpoint), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                  repetition_penalty=1.8)[0, len(prompt):].tolist()
    assert out.token_ids[: len(expected)] == expected


def _drive(llm: LLM, prompts: list[list[int]], params: SamplingParams, abort_at: dict[int, list[str]]):
    """Step the runtime by hand, aborting the named requests right before the given steps."""
    runtime = llm.runtime
    for i, prompt in enumerate(prompts):
        runtime.submit(runtime.make_request(f"r{i}", prompt, params))
    finished, step = {}, 0
    while runtime.has_work:
        for request_id in abort_at.get(step, []):
            runtime.abort(request_id)
        for output in runtime.step():
            if output.finished:
                finished[output.request_id] = output
        step += 1
    return finished


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 250) for _ in range(n)] for n in lengths]


def test_aborts_mid_flight_release_everything(llms):
    prompts = _prompts(4, [9, 30, 14, 22, 5])
    params = SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True)
    # Step 2: r1 mid-prefill and r0 decoding, each with a step in flight; step 6: r3 decoding.
    aborts = {2: ["r0", "r1"], 6: ["r3"], 7: ["r3", "missing"]}
    results = {overlap: _drive(llm, prompts, params, aborts) for overlap, llm in llms.items()}
    for overlap, finished in results.items():
        assert {finished[f"r{i}"].finish_reason for i in (0, 1, 3)} == {FinishReason.ABORT}
        assert finished["r2"].finish_reason is FinishReason.LENGTH
        _assert_pools_full(llms[overlap])
    for request_id in ("r2", "r4"):
        assert results[True][request_id].token_ids == results[False][request_id].token_ids


def test_preemption_mid_flight(demo_checkpoint):
    # 14 pages of 4 tokens: both prompts fit, their outputs do not, so decodes preempt the newer
    # request while its last step is still in flight (overlapped).
    outputs = {}
    for overlap in (True, False):
        llm = LLM(model=str(demo_checkpoint), dtype="float32", device="cpu", page_size=4, num_pages=14,
                  max_prefill_length=64, overlap_schedule=overlap)
        prompts = _prompts(2, [17, 18, 6])
        params = SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True, frequency_penalty=0.5)
        scheduler = llm.runtime.scheduler
        preempt, in_flight_at_preemption = scheduler._preempt, []

        def recording_preempt(req):
            in_flight_at_preemption.append(req.num_in_flight)
            preempt(req)

        scheduler._preempt = recording_preempt
        finished = _drive(llm, prompts, params, {})
        assert scheduler.num_preemptions >= 1
        if overlap:  # the victim's last token was still on its way to the host
            assert max(in_flight_at_preemption) >= 1
        _assert_pools_full(llm)
        outputs[overlap] = {k: (v.token_ids, v.text) for k, v in finished.items()}
    assert outputs[True] == outputs[False]


def test_padded_decode_steps_give_the_same_tokens(llms, monkeypatch):
    """Decode steps padded to a larger batch (as a CUDA graph replays them): padding rows sit on
    scratch slot 0 / page 0 and change no real row."""
    llm = llms[True]
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=2, max_tokens=12, ignore_eos=True, logprobs=0)]
    plain = _run(llm, params)
    buffers = llm.runtime.engine.buffers
    stage = buffers.stage
    padded_steps = []

    def padded(plan, last_tokens, pad_to=None, all_logits=False):
        if plan.num_decodes == len(plan.rows) and not all_logits:
            padded_steps.append(len(plan.rows))
            pad_to = PAD_TO
        return stage(plan, last_tokens, pad_to=pad_to, all_logits=all_logits)

    monkeypatch.setattr(buffers, "stage", padded)
    again = _run(llm, params)
    assert [o[:4] for o in again] == [o[:4] for o in plain]
    # Batched float32 matmuls of another row count may round differently in the last bits.
    assert torch.allclose(torch.tensor(again[1][4]), torch.tensor(plain[1][4]), atol=1e-5)
    assert padded_steps and max(padded_steps) < PAD_TO
    _assert_pools_full(llm)


def test_decode_view_is_a_fixed_prefix_of_the_buffers(llms):
    buffers = llms[True].runtime.engine.buffers
    first, second = buffers.decode_view(4), buffers.decode_view(4)
    assert first.input_ids.data_ptr() == second.input_ids.data_ptr() == buffers.inputs["input_ids"].data_ptr()
    assert first.page_table.shape == (4, buffers.max_pages_per_slot)
    assert first.num_decodes == 4 and first.logits_indices.shape == (4,)


def test_step_plan_names_slots_and_sends_token_ids_only_when_the_host_knows_them(llms):
    runtime = llms[False].runtime
    runtime.submit(runtime.make_request("a", list(range(10, 30)), SamplingParams(max_tokens=4, ignore_eos=True)))
    runtime._drain_inbox()
    step = runtime.scheduler.schedule()
    (row,) = step.plan.rows
    assert (row.num_computed, row.num_new, row.samples) == (0, 16, False)
    assert row.token_ids.tolist() == list(range(10, 26))
    assert step.plan.reset_slots == [row.slot] and step.plan.admissions[0].slot == row.slot
    assert [(u.slot, u.start, len(u.pages)) for u in step.plan.page_updates] == [(row.slot, 0, 4)]
    assert step.plan.copy_slots == []
    pending = runtime.engine.launch(step.plan)
    runtime.scheduler.launched(step)
    assert runtime._land(step, pending) == []
    step = runtime.scheduler.schedule()  # the rest of the prompt: samples
    assert step.plan.rows[0].token_ids.tolist() == list(range(26, 30)) and step.plan.rows[0].samples
    assert step.plan.admissions == [] and step.plan.reset_slots == []
    runtime.scheduler.launched(step)
    runtime._land(step, runtime.engine.launch(step.plan))
    step = runtime.scheduler.schedule()  # a decode: its input is the slot's last sampled token
    (row,) = step.plan.rows
    assert (row.num_computed, row.num_new, row.token_ids, row.samples) == (20, 1, None, True)
    assert step.plan.page_updates[0].start == 5
    runtime.scheduler.launched(step)
    runtime._land(step, runtime.engine.launch(step.plan))
    while runtime.has_work:
        runtime.step()
    _assert_pools_full(llms[False])


def test_engine_imports_only_lower_floors():
    """docs/architecture.md's floors: engine/ may not import the scheduler or anything above it."""
    import freetoken.engine

    above = ("freetoken.scheduler", "freetoken.runtime", "freetoken.output", "freetoken.llm", "freetoken.serving")
    for path in Path(freetoken.engine.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [n for n in names if n.startswith(above)], f"{path.name} imports {names}"
