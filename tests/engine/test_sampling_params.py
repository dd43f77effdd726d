"""SamplingParams: vLLM defaults, validation messages, normalisation, verify_vocab, sampling type."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kiln.engine.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p, params.top_k, params.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.logit_bias is None and params.seed is None and params.logprobs is None
    assert (params.max_tokens, params.min_tokens) == (16, 0)
    assert params.stop == [] and params.stop_token_ids == []
    assert not params.ignore_eos and params.skip_special_tokens and not params.include_stop_str_in_output
    assert not params.uses_penalties


# (field, bad value): the message must name the field and show the value.
BAD_VALUES = [
    ("n", 0),
    ("n", 129),
    ("n", True),
    ("n", 1.0),
    ("n", "2"),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", True),
    ("temperature", "1"),
    ("temperature", None),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_p", math.nan),
    ("top_p", False),
    ("top_k", -2),
    ("top_k", 1.0),
    ("top_k", True),
    ("top_k", None),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("min_p", math.nan),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.01),
    ("presence_penalty", math.inf),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -3),
    ("frequency_penalty", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {True: 1.0}),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: -101}),
    ("logit_bias", {5: math.nan}),
    ("logit_bias", {5: "1"}),
    ("logit_bias", [(5, 1.0)]),
    ("seed", 1.5),
    ("seed", True),
    ("seed", "7"),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", 1.0),
    ("max_tokens", True),
    ("min_tokens", -1),
    ("min_tokens", 2.0),
    ("min_tokens", None),
    ("stop", ""),
    ("stop", [""]),
    ("stop", ["ok", 1]),
    ("stop", ["s"] * 17),
    ("stop", 5),
    ("stop", {"a"}),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", [1.0]),
    ("stop_token_ids", [True]),
    ("stop_token_ids", 3),
    ("ignore_eos", 1),
    ("skip_special_tokens", "yes"),
    ("include_stop_str_in_output", None),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
    ("logprobs", 1.0),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=[f"{n}={v!r}" for n, v in BAD_VALUES])
def test_bad_value_raises_naming_parameter_and_value(name, value):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{name: value})
    message = str(excinfo.value)
    assert name in message
    # Numbers may be shown after float conversion (-3 as -3.0); a bad logit_bias entry by its value.
    shown = [repr(value)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        shown.append(repr(float(value)))
    if isinstance(value, dict):
        shown += [repr(v) for v in value.values()]
    assert any(s in message for s in shown), message


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens \(4\).*5"):
        SamplingParams(min_tokens=5, max_tokens=4)
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=1000, max_tokens=None).min_tokens == 1000


GOOD_EDGES = [
    {"temperature": 0},
    {"temperature": 0.0},
    {"temperature": 1e-9},
    {"temperature": 1000.0},
    {"top_p": 1.0},
    {"top_p": 1e-9},
    {"top_k": -1},
    {"top_k": 0},
    {"top_k": 1},
    {"top_k": 10**6},
    {"min_p": 0.0},
    {"min_p": 1.0},
    {"presence_penalty": -2},
    {"presence_penalty": 2.0},
    {"frequency_penalty": -2.0},
    {"frequency_penalty": 2},
    {"repetition_penalty": 1e-3},
    {"repetition_penalty": 50.0},
    {"n": 1},
    {"n": 128},
    {"logprobs": 0},
    {"logprobs": 20},
    {"max_tokens": None},
    {"max_tokens": 1},
    {"seed": 0},
    {"seed": -1},
    {"seed": 2**64 - 1},
    {"seed": -(2**63)},
    {"logit_bias": {}},
    {"logit_bias": {0: -100, 7: 100.0}},
    {"stop": ["s"] * 16},
    {"stop": ("a", "b")},
    {"stop_token_ids": (0, 5)},
    {"n": np.int64(3), "top_k": np.int32(5), "temperature": np.float32(0.5), "seed": np.uint64(3)},
]


@pytest.mark.parametrize("kwargs", GOOD_EDGES, ids=[repr(k) for k in GOOD_EDGES])
def test_good_edge_values_pass(kwargs):
    SamplingParams(**kwargs)


def test_normalisation_to_plain_python_types():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, np.int64(4))).stop_token_ids == [3, 4]
    params = SamplingParams(temperature=1, n=np.int64(2), logit_bias={np.int64(4): 1})
    assert type(params.temperature) is float and type(params.n) is int
    assert params.logit_bias == {4: 1.0} and type(next(iter(params.logit_bias))) is int
    bias = {1: 2.0}
    params = SamplingParams(logit_bias=bias)
    bias[2] = 3.0  # the params hold their own copy
    assert params.logit_bias == {1: 2.0}


def test_frozen_and_replace_revalidates():
    params = SamplingParams(stop="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    assert dataclasses.replace(params, temperature=0.5).stop == ["x"]
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(params, temperature=-1.0)


def test_verify_vocab():
    SamplingParams(logit_bias={0: 1.0, 99: -1.0}, stop_token_ids=[0, 99]).verify_vocab(100)
    with pytest.raises(ValueError, match=r"logit_bias.*\[0, 100\).*100"):
        SamplingParams(logit_bias={100: 1.0}).verify_vocab(100)
    with pytest.raises(ValueError, match=r"stop_token_ids.*\[0, 100\).*250"):
        SamplingParams(stop_token_ids=[5, 250]).verify_vocab(100)
    SamplingParams().verify_vocab(1)


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=9e-6, seed=3).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.0).is_greedy and not SamplingParams(temperature=1e-5).is_greedy
    assert SamplingParams(temperature=0.7).sampling_type is SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=0).sampling_type is SamplingType.RANDOM_SEED


def test_uses_penalties():
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(frequency_penalty=-0.5).uses_penalties
    assert SamplingParams(presence_penalty=0.1).uses_penalties
    assert not SamplingParams(logit_bias={1: 2.0}).uses_penalties
