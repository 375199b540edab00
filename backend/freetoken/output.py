"""After each step: append the sampled tokens, detokenize, decide which requests are done, and
build the deltas that go back to callers."""

from __future__ import annotations

import time
from dataclasses import dataclass

from freetoken.core import FinishReason, RequestOutput, TokenLogprobs
from freetoken.scheduler.request import Request
from freetoken.tokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class OutputText:
    """A request's text as its caller sees it (the scheduler never needs it)."""

    detokenizer: IncrementalDetokenizer
    text: str = ""  # the output text so far, stop strings cut
    num_sent_chars: int = 0  # of text, already streamed


def _find_stop(req: Request, out: OutputText, new_text_len: int) -> tuple[int, str] | None:
    """The earliest stop string that the newest text completes: ``(index in out.text, stop)``."""
    best: tuple[int, str] | None = None
    for stop in req.params.stop_strings:
        window_start = max(0, len(out.text) - new_text_len - len(stop) + 1)
        index = out.text.find(stop, window_start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def append_token(req: Request, out: OutputText, token_id: int, logprob: TokenLogprobs | None) -> None:
    """Add one sampled token, its text, and finish the request if a stop condition holds."""
    now = time.monotonic()
    req.times.first_token = req.times.first_token or now
    req.times.last_token = now
    req.token_ids.append(token_id)
    if logprob is not None:
        req.output_logprobs.append(logprob)
        req.cumulative_logprob += logprob.logprob
    new_text = out.detokenizer.step([token_id])
    out.text += new_text
    if token_id in req.stop_token_ids:  # sampling blocks them before min_tokens
        req.finish_reason = FinishReason.STOP
        req.stop_reason = None if token_id in req.eos_token_ids else token_id
    elif req.num_output_tokens >= req.params.max_tokens or len(req.token_ids) >= req.max_total_tokens:
        req.finish_reason = FinishReason.LENGTH
    if req.finish_reason is not None:
        out.text += out.detokenizer.flush()
    if req.params.stop_strings and req.num_output_tokens >= req.params.min_tokens:
        found = _find_stop(req, out, len(new_text))
        if found:
            index, stop = found
            out.text = out.text[: index + (len(stop) if req.params.include_stop_str_in_output else 0)]
            req.finish_reason, req.stop_reason = FinishReason.STOP, stop


def streamable_text(req: Request, out: OutputText) -> str:
    """Text not yet sent. While running, the last ``len(longest stop) - 1`` characters are held back,
    since they may turn out to start a stop string that must not be sent."""
    end = len(out.text)
    if req.finish_reason is None and req.params.stop_strings:
        end -= max(len(s) for s in req.params.stop_strings) - 1
    if end <= out.num_sent_chars:
        return ""
    delta = out.text[out.num_sent_chars : end]
    out.num_sent_chars = end
    return delta


def make_output(
    req: Request, out: OutputText, new_token_ids: list[int], new_logprobs: list[TokenLogprobs] | None
) -> RequestOutput:
    """The delta since the last output; the whole output (tokens, text, logprobs) only once the
    request finished, so a request costs O(its length) in outputs, not O(length^2)."""
    wants_logprobs = req.params.logprobs is not None
    whole = req.finish_reason is not None
    return RequestOutput(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        token_ids=req.output_token_ids if whole else [],
        text=out.text if whole else "",
        logprobs=list(req.output_logprobs) if wants_logprobs and whole else None,
        cumulative_logprob=req.cumulative_logprob if wants_logprobs else None,
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        error=req.error,
        new_token_ids=new_token_ids,
        new_text=streamable_text(req, out),
        new_logprobs=new_logprobs if wants_logprobs else None,
        metrics=request_metrics(req),
        num_cached_tokens=req.num_cached_tokens,
    )


def request_metrics(req: Request) -> dict[str, float | int]:
    times = req.times
    metrics: dict[str, float | int] = {
        "num_prompt_tokens": req.num_prompt_tokens,
        "num_output_tokens": req.num_output_tokens,
        "num_preemptions": req.num_preemptions,
    }
    if times.scheduled is not None:
        metrics["queue_time"] = times.scheduled - times.arrival
    if times.first_token is not None:
        metrics["time_to_first_token"] = times.first_token - times.arrival
    return metrics
