"""Detokenization (incremental, UTF-8 safe, special tokens) and stop conditions."""

from __future__ import annotations

import pytest

from freetoken import LLM, FinishReason, SamplingParams
from freetoken.tokenizer import IncrementalDetokenizer
from freetoken.tokenizer.detokenizer import REPLACEMENT_CHAR

MULTIBYTE = "Unicode: café 日本語の文章 🙂🚀 한국어 ß"


@pytest.fixture(scope="module")
def llm(demo_checkpoint) -> LLM:
    return LLM(model=str(demo_checkpoint), dtype="float32", device="cpu")


def test_streamed_deltas_never_split_a_character(llm):
    tokenizer = llm.tokenizer
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    single_byte_tokens = [i for i in ids if REPLACEMENT_CHAR in tokenizer.decode([i])]
    assert single_byte_tokens, "the text must contain characters split over several tokens"
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Say:", add_special_tokens=False), True)
    deltas = [detok.step([i]) for i in ids] + [detok.flush()]
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE


def test_special_tokens_skipped_or_kept(llm):
    tokenizer = llm.tokenizer
    ids = tokenizer.encode("hello<|im_end|> world", add_special_tokens=False)
    for skip, expected in ((True, "hello world"), (False, "hello<|im_end|> world")):
        detok = IncrementalDetokenizer(tokenizer, [], skip)
        assert "".join(detok.step([i]) for i in ids) + detok.flush() == expected


def test_stream_deltas_add_up_to_the_final_text(llm):
    runtime = llm.runtime
    runtime.submit(runtime.make_request("s", "The quick brown", SamplingParams(temperature=0.0, max_tokens=30)))
    deltas, final = [], None
    while runtime.has_work:
        for output in runtime.step():
            deltas.append(output.new_text)
            final = output
    assert "".join(deltas) == final.text
    assert final.text == llm.tokenizer.decode(final.token_ids, skip_special_tokens=True)


def test_stop_string_cuts_the_text_and_is_never_streamed(llm):
    greedy = llm.generate("The quick brown", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop = greedy.text[10:13]
    before = greedy.text[: greedy.text.index(stop)]
    runtime = llm.runtime
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    runtime.submit(runtime.make_request("stop", "The quick brown", params))
    streamed, final = "", None
    while runtime.has_work:
        for output in runtime.step():
            streamed += output.new_text
            final = output
    assert final.finish_reason is FinishReason.STOP and final.stop_reason == stop
    assert final.text == before and streamed == before
    kept = llm.generate(
        "The quick brown", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=stop,
                                          include_stop_str_in_output=True)
    )[0]
    assert kept.text == before + stop


def test_stop_token_ids_and_eos(llm):
    greedy = llm.generate("The quick brown", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    third = greedy.token_ids[2]
    out = llm.generate("The quick brown", SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[third]))[0]
    assert out.token_ids == greedy.token_ids[:3]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == third


def test_min_tokens_blocks_stop_tokens(llm):
    greedy = llm.generate("The quick brown", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0]
    first = greedy.token_ids[0]
    out = llm.generate(
        "The quick brown", SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, stop_token_ids=[first])
    )[0]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]
