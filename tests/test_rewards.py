"""GRPO's reward functions: the built-ins against hand-worked answers, TRL's own reward functions run
unchanged through --reward FILE.py:NAME, and every way a user's function can fail said in one line naming it.
"""

import math

import numpy as np
import pytest
import torch

from llm.base.errors import ConfigError
from llm.scores import rewards

trl = pytest.importorskip("trl")


def call(reward, completions, **columns):
    return reward(["q"] * len(completions), completions, [[1]] * len(completions), columns)


def test_gsm8k_compares_the_last_number_with_the_answer_after_its_marks():
    """The answer column as GSM8K ships it (a worked solution ending '#### 1234'), thousands separators, a
    trailing '.0', and the conversational form TRL passes for message prompts."""
    r = rewards.load("gsm8k")
    answers = ["She pays 1,000 + 234.\n#### 1234", "#### 12", "7", "#### 5"]
    got = call(r, ["So 3 then 1,234.", "It is 12.0 apples", "about 8", [{"role": "assistant", "content": "5"}]],
               answer=answers)
    assert got == [1.0, 1.0, 0.0, 1.0]


def test_a_regex_reward_finds_its_pattern_across_lines():
    r = rewards.load(r"regex:^<think>.*</think>\s*\d+$")
    assert call(r, ["<think>a\nb</think> 42", "42", "<think>x</think> no"]) == [1.0, 0.0, 0.0]


def test_trls_own_reward_functions_run_unchanged_from_a_users_file(tmp_path):
    """A reward written for TRL runs here as it is: TRL's think_format_reward and a length reward in the style
    of TRL's docs, called with conversational completions and extra columns they ignore through **kwargs."""
    from trl.rewards import think_format_reward
    f = tmp_path / "my_rewards.py"
    f.write_text("from trl.rewards import think_format_reward\n\n"
                 "def short(completions, **kwargs):\n"
                 "    return [-abs(20 - len(c[0]['content'])) for c in completions]\n")
    completions = [[{"role": "assistant", "content": "<think>\nhm\n</think>\nYes"}],
                   [{"role": "assistant", "content": "No thinking here at all"}]]
    theirs = think_format_reward(completions)
    assert theirs == [1.0, 0.0]
    assert call(rewards.load(f"{f}:think_format_reward"), completions, answer=["1", "2"]) == theirs
    assert call(rewards.load(f"{f}:short"), completions) == [-3.0, -3.0]  # 23 characters each


def test_numpy_and_tensor_values_are_rewards_and_none_is_not_judged():
    r = rewards.Reward("mixed", lambda completions, **_: [np.float32(0.5), torch.tensor(2.0), None, 3])
    got = call(r, ["a", "b", "c", "d"])
    assert got[:2] == [0.5, 2.0] and math.isnan(got[2]) and got[3] == 3.0


@pytest.mark.parametrize("returned, said", [
    (lambda completions, **_: [1.0], "returned 1 values for 2 completions"),
    (lambda completions, **_: [1.0, math.nan], "returned nan for completion 1"),
    (lambda completions, **_: [1.0, "high"], "returned 'high' for completion 1"),
    (lambda completions, **_: [True, 1.0], "returned True for completion 0"),
    (lambda completions, **_: 3.0, "not a list of 2 numbers"),
    (lambda completions, **_: 1 / 0, "raised ZeroDivisionError"),
])
def test_a_reward_that_fails_or_returns_no_reward_is_named_in_one_line(returned, said):
    with pytest.raises(rewards.RewardError, match="reward mine ") as e:
        call(rewards.Reward("mine", returned), ["a", "b"])
    assert said in str(e.value) and "\n" not in str(e.value)


def test_gsm8k_without_an_answer_column_names_the_column():
    with pytest.raises(rewards.RewardError, match="`answer` column"):
        call(rewards.load("gsm8k"), ["1"])


def test_bad_reward_flags_are_refused_naming_the_flag(tmp_path):
    """Exit 2 before any model is built: a file that is not there, a name it lacks, a file that fails to
    import, an unknown built-in, a bad pattern, and weights that do not match the rewards."""
    good = tmp_path / "r.py"
    good.write_text("def correct(completions, **kw):\n    return [1.0 for _ in completions]\n")
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    for spec, said in [(f"{tmp_path}/none.py:f", "is not a file"), (f"{good}:missing", "has no function missing"),
                       (f"{broken}:f", "raised ModuleNotFoundError"), ("gsm9k", "is not a reward"),
                       ("regex:(", "not a regular expression")]:
        with pytest.raises(ConfigError, match="--reward") as e:
            rewards.load(spec)
        assert said in str(e.value)
    with pytest.raises(ConfigError, match="2 weights for 1 rewards"):
        rewards.load_all([f"{good}:correct"], [1.0, 2.0])
    with pytest.raises(ConfigError, match="at least one --reward"):
        rewards.load_all([], [])
    loaded, weights = rewards.load_all([f"{good}:correct", "gsm8k"], [])
    assert [r.name for r in loaded] == [f"{good}:correct", "gsm8k"] and weights == [1.0, 1.0]
