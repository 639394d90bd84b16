"""SamplingParams validation, logits processing and the exponential-race sampler."""

from __future__ import annotations

import math

import pytest
import torch

from specstream.sampling import SamplingTensors, logits_to_probs, make_generator, sample
from specstream.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.1}, "temperature .* -0.1"),
        ({"temperature": math.nan}, "temperature .* nan"),
        ({"top_p": 0.0}, "top_p .* 0.0"),
        ({"top_p": 1.5}, "top_p .* 1.5"),
        ({"top_k": -2}, "top_k .* -2"),
        ({"max_tokens": 0}, "max_tokens .* 0"),
        ({"n": 0}, "n must .* 0"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens .* -1"),
        ({"num_speculative_tokens": 17}, "num_speculative_tokens .* 17"),
        ({"stop": ["ok", ""]}, "stop .* ''"),
    ],
)
def test_params_validation_names_field_and_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_normalise_and_greedy() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams().stop == ()
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(top_k=-1).greedy
    assert SamplingParams(num_speculative_tokens=0).num_speculative_tokens == 0
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 0.5  # type: ignore[misc]


def test_temperature_scales_softmax_and_greedy_is_one_hot() -> None:
    logits = torch.randn(3, 10, dtype=torch.bfloat16)
    probs = logits_to_probs(logits, [0.5, 1.0, 0.0], [0, -1, 0], [1.0, 1.0, 1.0])
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs[0], (logits[0].float() / 0.5).softmax(-1))
    torch.testing.assert_close(probs[1], logits[1].float().softmax(-1))
    assert probs[2].tolist() == torch.nn.functional.one_hot(logits[2].argmax(), 10).float().tolist()


def test_top_k_and_top_p() -> None:
    # Probabilities 0.5, 0.25, 0.15, 0.1 (token ids in a shuffled order).
    base = torch.tensor([0.1, 0.5, 0.15, 0.25]).log()
    logits = base.expand(5, 4)
    probs = logits_to_probs(
        logits,
        torch.ones(5),
        torch.tensor([2, 0, 0, 3, 1]),
        torch.tensor([1.0, 0.7, 0.8, 0.5, 1.0]),
    )
    torch.testing.assert_close(probs[0], torch.tensor([0, 2 / 3, 0, 1 / 3]))  # top-2
    # top_p 0.7: 0.5 < 0.7, 0.75 >= 0.7 -> smallest set is {1, 3}.
    torch.testing.assert_close(probs[1], torch.tensor([0, 2 / 3, 0, 1 / 3]))
    # top_p 0.8: needs 0.5 + 0.25 + 0.15.
    torch.testing.assert_close(probs[2], torch.tensor([0, 0.5, 0.15, 0.25]) / 0.9)
    # top-3 then top_p 0.5 over the renormalised mass: the top token alone (0.5/0.9 >= 0.5).
    torch.testing.assert_close(probs[3], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[4], torch.tensor([0.0, 1.0, 0.0, 0.0]))  # top-1
    # A tiny top_p still keeps the most likely token; scalars broadcast over rows.
    tiny = logits_to_probs(logits, 1.0, 0, 1e-6)
    assert (tiny.argmax(-1) == 1).all() and (tiny.max(-1).values == 1).all()


def test_params_tensors_match_lists() -> None:
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9), SamplingParams(temperature=0)]
    st = SamplingTensors.from_params(params)
    assert st.greedy.tolist() == [False, True]
    logits = torch.randn(2, 20)
    torch.testing.assert_close(
        logits_to_probs(logits, st.temperature, st.top_k, st.top_p),
        logits_to_probs(logits, [0.7, 0.0], [5, 0], [0.9, 1.0]),
    )
    assert st.repeat_interleave(3).top_k.tolist() == [5, 5, 5, 0, 0, 0]


def test_sample_matches_probs_and_never_picks_zero_mass() -> None:
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0]).expand(40_000, 5)
    tokens = sample(probs)
    freq = torch.bincount(tokens, minlength=5).float() / tokens.numel()
    assert freq[1] == 0 and freq[4] == 0
    torch.testing.assert_close(freq, probs[0], atol=0.01, rtol=0)
    one_hot = torch.zeros(100, 5)
    one_hot[:, 3] = 1
    assert (sample(one_hot) == 3).all()


def test_sample_with_seeded_generators_is_reproducible() -> None:
    probs = torch.softmax(torch.randn(4, 50), -1)
    params = [SamplingParams(seed=s) for s in (1, 2, None, 1)]

    def draw() -> list[int]:
        gens = [make_generator(p) for p in params]
        return [sample(probs, gens).tolist() for _ in range(5)]

    first, second = draw(), draw()
    assert [r[i] for r in first for i in (0, 1, 3)] == [r[i] for r in second for i in (0, 1, 3)]
    # Same seed and same distribution -> same token, whatever the other rows do.
    probs[3] = probs[0]
    same = sample(probs, [make_generator(params[0]), None, None, make_generator(params[3])])
    assert same[0] == same[3]
    assert make_generator(SamplingParams()) is None
    with pytest.raises(ValueError, match="generators"):
        sample(probs, [None])
