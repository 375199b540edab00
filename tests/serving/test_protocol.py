"""The protocol and the config.pbtxt options, without a server."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from freetoken.config import EngineConfig
from freetoken.core import FinishReason, RequestOutput, TokenLogprobs
from freetoken.bench import loadgen
from freetoken.serving import install, repository
from freetoken.serving.options import BackendOptions, options_from_model_config, to_parameters
from freetoken.serving.protocol import ProtocolError, build_outputs, parse_request, parse_sampling_parameters

REPO_ROOT = Path(__file__).resolve().parents[2]


def inputs(**values):
    arrays = {}
    for name, value in values.items():
        if isinstance(value, str):
            arrays[name] = np.array([value.encode()], dtype=np.object_)
        elif isinstance(value, bool):
            arrays[name] = np.array([value])
        else:
            arrays[name] = np.array(value, dtype=np.int32)
    return arrays.get


def test_sampling_parameters_types_and_ranges():
    params = parse_sampling_parameters(json.dumps({
        "temperature": "0.5", "top_p": 0.9, "top_k": 5.0, "max_tokens": "7", "ignore_eos": "false",
        "stop": ["\n"], "stop_token_ids": [1, "2"], "seed": None,
    }))
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 5, 7)
    assert params.ignore_eos is False and params.stop == ["\n"] and params.stop_token_ids == [1, 2] and params.seed is None


@pytest.mark.parametrize("raw, message", [
    ('{"temperature": -0.1}', "'temperature' must be >= 0"),
    ('{"top_p": 0}', "'top_p' must be in (0, 1]"),
    ('{"max_tokens": 0}', "'max_tokens' must be >= 1"),
    ('{"max_tokens": 2.5}', "'max_tokens' must be an integer"),
    ('{"temperature": "warm"}', "'temperature' must be a number"),
    ('{"temperature": true}', "'temperature' must be a number"),
    ('{"temperature": "nan"}', "'temperature' must be a finite number"),
    ('{"ignore_eos": "yes"}', "'ignore_eos' must be a boolean"),
    ('{"n": 0}', "'n' must be >= 1"),
    ('{"logprobs": 21}', "'logprobs' must be in [0, 20]"),
    ('{"best_of": 2}', "unknown sampling parameter 'best_of'"),
    ('{"lora_name": "doll"}', "LoRA feature is not enabled."),
    ('{"structured_outputs": "{}"}', "'structured_outputs' is not supported"),
    ('{"stop": 3}', "'stop' must be a string or a list of strings"),
    ('[1, 2]', "sampling_parameters must be a JSON object"),
    ('{"max_tokens": ', "sampling_parameters is not valid JSON"),
])
def test_bad_sampling_parameters_name_the_field(raw, message):
    with pytest.raises(ProtocolError) as info:
        parse_sampling_parameters(raw)
    assert message in str(info.value)


def test_request_defaults_follow_the_vllm_backend():
    spec = parse_request(inputs(text_input="hi"))
    assert not spec.stream and spec.prepend_input and spec.outputs == frozenset() and spec.params.max_tokens == 16
    spec = parse_request(inputs(text_input="hi", stream=True, return_cumulative_logprob=True, return_logprobs=True))
    assert spec.stream and not spec.prepend_input and spec.params.logprobs == 0 and not spec.report_logprobs
    spec = parse_request(inputs(text_input="hi", return_logprobs=True))
    assert spec.params.logprobs is None and not spec.report_logprobs  # return_logprobs alone: null
    spec = parse_request(inputs(text_input="hi", sampling_parameters='{"n": "2", "logprobs": 2, "prompt_logprobs": 1}'))
    assert (spec.params.n, spec.params.logprobs, spec.report_logprobs) == (2, 2, True)
    spec = parse_request(inputs(input_ids=[1, 2, 3], exclude_input_in_output=True))
    assert spec.prompt == [1, 2, 3] and not spec.prepend_input


def test_request_parameters_stand_in_for_sampling_parameters():
    spec = parse_request(inputs(text_input="hi"), json.dumps({"max_tokens": 3, "stream": False}))
    assert spec.params.max_tokens == 3
    with pytest.raises(ProtocolError, match="'bogus'"):
        parse_request(inputs(text_input="hi"), json.dumps({"bogus": 1}))


@pytest.mark.parametrize("values, message", [
    ({}, "exactly one of 'text_input' and 'input_ids'"),
    ({"text_input": ""}, "'text_input' must not be empty"),
    ({"input_ids": []}, "'input_ids' must not be empty"),
    ({"text_input": "x", "stream": True, "exclude_input_in_output": False},
     r"^Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed\.$"),
])
def test_bad_requests_name_the_input(values, message):
    with pytest.raises(ProtocolError, match=message):
        parse_request(inputs(**values))


def output(new_text, new_ids, finished=None, text="", ids=(), logprobs=None):
    return RequestOutput(request_id="r", prompt_token_ids=[5, 6], token_ids=list(ids), text=text, new_text=new_text,
                         new_token_ids=list(new_ids), finish_reason=finished, new_logprobs=logprobs,
                         logprobs=logprobs, cumulative_logprob=sum(t.logprob for t in logprobs or []) or None)


def spell(token_id: int) -> str:
    return f"<{token_id}>"


def test_streaming_response_merges_deltas():
    spec = parse_request(inputs(text_input="hi", stream=True, return_output_ids=True, return_num_output_tokens=True,
                                return_finish_reason=True, return_num_input_tokens=True))
    last = output("bc", [2], FinishReason.LENGTH)
    arrays = build_outputs(spec, [last], [[output("a", [1]), last]], lambda: "unused", spell)
    assert arrays["text_output"].tolist() == [b"abc"] and arrays["output_ids"].tolist() == [1, 2]
    assert arrays["num_output_tokens"].tolist() == [2] and arrays["num_input_tokens"].tolist() == [2]
    assert arrays["finish_reason"].tolist() == [b"length"]
    running = output("a", [1])
    arrays = build_outputs(spec, [running], [[running]], lambda: "unused", spell)
    assert arrays["finish_reason"].tolist() == [b"None"]  # the vLLM backend's str(None) until the end


def test_non_streaming_response_is_whole_with_the_prompt():
    spec = parse_request(inputs(text_input="hi "))
    last = output("c", [3], FinishReason.STOP, text="abc", ids=[1, 2, 3])
    arrays = build_outputs(spec, [last], [[last]], lambda: "hi ", spell)
    assert arrays["text_output"].tolist() == [b"hi abc"] and set(arrays) == {"text_output"}


def test_logprobs_in_the_vllm_layout_and_null_unless_asked():
    chosen = [TokenLogprobs(-0.5, 2, [(7, -0.1), (3, -0.5)]), TokenLogprobs(-0.2, 1, [])]
    last = output("xy", [3, 9], FinishReason.LENGTH, text="xy", ids=[3, 9], logprobs=chosen)
    spec = parse_request(inputs(text_input="q", return_logprobs=True, exclude_input_in_output=True,
                                sampling_parameters='{"logprobs": 2}'))
    entries = json.loads(build_outputs(spec, [last], [[last]], lambda: "", spell)["logprobs"][0])
    assert entries == [
        {"3": {"logprob": -0.5, "rank": 2, "decoded_token": "<3>"}, "7": {"logprob": -0.1, "rank": 1, "decoded_token": "<7>"}},
        {"9": {"logprob": -0.2, "rank": 1, "decoded_token": "<9>"}},
    ]
    spec = parse_request(inputs(text_input="q", return_logprobs=True, return_cumulative_logprob=True))
    arrays = build_outputs(spec, [last], [[last]], lambda: "", spell)
    assert arrays["logprobs"].tolist() == [b"null"] and arrays["cumulative_logprob"][0] == pytest.approx(-0.7)


def test_n_samples_are_laid_out_one_element_each():
    spec = parse_request(inputs(text_input="p", stream=True, return_finish_reason=True, return_num_output_tokens=True,
                                return_output_ids=True, sampling_parameters='{"n": 2}'))
    first, second = output("a", [1]), output("b", [2], FinishReason.STOP)
    arrays = build_outputs(spec, [first, second], [[], [second]], lambda: "", spell)
    assert arrays["text_output"].tolist() == [b"", b"b"] and arrays["finish_reason"].tolist() == [b"None", b"stop"]
    assert arrays["num_output_tokens"].tolist() == [0, 1] and arrays["output_ids"].tolist() == [2]


def test_num_cached_tokens_per_sample_only_when_asked():
    """One element per sample (each sample prefills on its own), 0 before a sample's first output."""
    spec = parse_request(inputs(text_input="p", stream=True, return_num_cached_tokens=True,
                                sampling_parameters='{"n": 3}'))
    hit, miss = output("a", [1]), output("b", [2])
    hit.num_cached_tokens = 32
    arrays = build_outputs(spec, [hit, miss, None], [[hit], [miss], []], lambda: "", spell)
    assert arrays["num_cached_tokens"].dtype == np.uint32 and arrays["num_cached_tokens"].tolist() == [32, 0, 0]
    spec = parse_request(inputs(text_input="p", stream=True, return_num_input_tokens=True))
    assert "num_cached_tokens" not in build_outputs(spec, [hit], [[hit]], lambda: "", spell)


def test_options_round_trip_and_reject_unknown_names():
    engine = EngineConfig(model="/m", dtype="float32", num_pages=64)
    backend = BackendOptions(response_threads=3, report_metrics=False)
    params = {k: {"string_value": v} for k, v in to_parameters(engine, backend).items()}
    assert options_from_model_config({"parameters": params}) == (engine, backend)
    params["EXECUTION_ENV_PATH"] = {"string_value": "/env"}  # Triton's own: left alone
    options_from_model_config({"parameters": params})
    for value, expected in (("true", True), ("false", False)):  # the vLLM backend's switch decides
        params["REPORT_CUSTOM_METRICS"] = {"string_value": value}
        assert options_from_model_config({"parameters": params})[1].report_metrics is expected
    with pytest.raises(ValueError, match="max_runing_requests"):
        options_from_model_config({"parameters": {"max_runing_requests": {"string_value": "4"}}})
    with pytest.raises(ValueError, match="'dtype' must be one of"):
        options_from_model_config({"parameters": {"dtype": {"string_value": "fp8"}}})


def test_written_repository_carries_the_parameters(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    target = repository.write_model_repository(tmp_path, "m", {"model": "/x", "max_running_requests": "3"})
    config = text_format.Parse((target / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert config.name == "m" and config.model_transaction_policy.decoupled
    assert config.parameters["model"].string_value == "/x" and config.parameters["max_running_requests"].string_value == "3"
    assert (target / "1" / "model.py").read_text() == (REPO_ROOT / "model_repository/freetoken/1/model.py").read_text()
    # every engine option and backend option has a documented default in the template
    template = text_format.Parse((REPO_ROOT / "model_repository/freetoken/config.pbtxt").read_text(),
                                 model_config_pb2.ModelConfig())
    assert set(template.parameters) == set(to_parameters(EngineConfig()))
    defaults = {"parameters": {k: {"string_value": v.string_value} for k, v in template.parameters.items()}}
    assert options_from_model_config(defaults) == (EngineConfig(), BackendOptions())


def test_model_py_stays_thin():
    assert len((REPO_ROOT / "model_repository/freetoken/1/model.py").read_text().splitlines()) < 200


def test_perf_analyzer_configs_parse():
    configs = REPO_ROOT / "perf_analyzer_configs"
    template = (REPO_ROOT / "model_repository/freetoken/config.pbtxt").read_text()
    for data in configs.glob("*.json"):
        for request in loadgen.load_input_data(data):
            assert set(request) <= {"text_input", "input_ids", "stream", "sampling_parameters",
                                    "exclude_input_in_output"} and f'name: "{next(iter(request))}"' in template
            parse_request(inputs(**{k: v[0] if len(v) == 1 else v for k, v in request.items()}))
    scripts = list(configs.glob("*.sh"))
    assert scripts
    for script in scripts:
        words = shlex.split(script.read_text(), comments=True)
        for word in words:
            if word.startswith("perf_analyzer_configs/"):
                assert (REPO_ROOT / word).exists(), f"{script.name} names a missing file {word}"


def test_stub_python_of_another_interpreter(tmp_path):
    import sys
    import sysconfig

    wrapper = tmp_path / "python3"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    python = install.stub_python(str(wrapper))
    assert python.executable == wrapper
    assert python.version == f"{sys.version_info[0]}.{sys.version_info[1]}"
    assert python.libdir == sysconfig.get_config_var("LIBDIR")
    env = install.server_environment(install.TritonInstall(Path("/x"), None, [], "test"), python)
    assert env["PATH"].split(":")[0] == str(tmp_path) and env["LD_LIBRARY_PATH"].split(":")[0] == python.libdir
