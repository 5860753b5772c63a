"""The weight average a run ends on (llm/base/averaging.py): its definition against a float64 loop, its
restore, and the trainer's last checkpoint holding the average of the weights its steps made."""

import copy
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import gpu_training_optimized as trainer
from llm.base.errors import CheckpointError
from llm.formats import checkpoint as ckpt_io
from llm.base import averaging
from llm.train import runner as step_runner
from llm.base.averaging import HORIZON, START, WeightAverage
from modern_llm import is_stored


def stepped_model():
    """A small model whose weight a 'step' overwrites; its bias is frozen, as a LoRA base is."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    return model


def take_steps(model, average, steps: int, first: int = 0, total: int = 100) -> list[torch.Tensor]:
    """Steps first..steps-1 of a run of `total`: new weights, then the average's update; the weights the
    second half made, in float64."""
    made = []
    for step in range(first, steps):
        with torch.no_grad():
            model.weight.copy_(torch.randn(2, 3, generator=torch.Generator().manual_seed(step)))
        average.update(step, (step + 1) / total)
        if (step + 1) / total >= START:
            made.append(model.weight.detach().double().clone())
    return made


def test_the_run_ends_on_an_exponential_average_of_its_second_half():
    model, beta = stepped_model(), 0.8
    average = WeightAverage(model, beta)
    made = take_steps(model, average, 100)
    expected = made[0]  # a float64 loop of the definition: the first weight, then each later one weighted 1 - beta
    for w in made[1:]:
        expected = beta * expected + (1 - beta) * w
    last, bias = model.weight.detach().clone(), model.bias.detach().clone()
    average.swap_in()
    assert torch.allclose(model.weight.double(), expected, atol=1e-6)
    assert not torch.allclose(model.weight, last)
    assert torch.equal(model.bias, bias)  # frozen weights are not averaged


def test_a_restored_average_goes_on_as_the_uninterrupted_one():
    model = stepped_model()
    whole = WeightAverage(model, 0.995)  # shortened on this 100-step run: the resumed one must shorten it alike
    take_steps(model, whole, 100)
    whole.swap_in()
    interrupted = stepped_model()
    before = WeightAverage(interrupted, 0.995)
    take_steps(interrupted, before, 70)
    resumed = copy.deepcopy(interrupted)  # a new process: its own weights, and the average its checkpoint held
    after = WeightAverage(resumed, 0.995)
    after.load_state_dict(before.state_dict())
    take_steps(resumed, after, 100, first=70)
    after.swap_in()
    assert torch.equal(resumed.weight, model.weight)


def test_off_or_before_the_second_half_the_run_ends_on_its_own_weights():
    for beta, steps in ((0.0, 100), (0.9, 40)):
        model = stepped_model()
        average = WeightAverage(model, beta)
        take_steps(model, average, steps)
        last = model.weight.detach().clone()
        average.swap_in()
        assert torch.equal(model.weight, last)
    off = WeightAverage(stepped_model(), 0.0)
    off.load_state_dict([torch.zeros(2, 3)])  # a checkpoint's average, resumed with averaging off: not used
    assert off.average is None


@pytest.mark.parametrize("saved", [[torch.zeros(3, 3)], [torch.zeros(2, 3), torch.zeros(2)], ["weights"], {"a": 1},
                                   {"average": [torch.zeros(2, 3)], "beta": "0.9"}])
def test_an_average_of_other_weights_is_refused_in_one_line(saved):
    with pytest.raises(CheckpointError, match="does not match this model's trained weights"):
        WeightAverage(stepped_model(), 0.9).load_state_dict(saved)


def step_weights(total: int, beta: float) -> torch.Tensor:
    """What share of the final average each step's weights hold, over a run of `total` steps: step k's weights
    are the unit vector e_k, so the average's coordinates are the shares."""
    model = nn.Linear(total, 1, bias=False)
    average = WeightAverage(model, beta)
    for step in range(total):
        with torch.no_grad():
            model.weight.zero_()
            model.weight[0, step] = 1.0
        average.update(step, (step + 1) / total)
    average.swap_in()
    return model.weight.detach().double()[0]


def test_a_short_run_averages_over_its_last_steps_and_a_long_one_over_beta():
    """0.995 spans 200 steps: a 600-step run's average reached back to its 300th step's weights. It now spans
    at most HORIZON of a run; from a run of 1 / (1 - beta) / HORIZON steps on, beta itself."""
    short = step_weights(600, 0.995)
    assert abs(short.sum().item() - 1) < 1e-4
    reach = 3 * HORIZON * 600  # three horizons back: e^-3 of the weight at most
    assert short[:600 - int(reach)].sum() < 0.06
    long_run = step_weights(2400, 0.995)
    last = long_run[-200:-1]
    assert torch.allclose(last[:-1] / last[1:], torch.full_like(last[1:], 0.995), atol=1e-4)


def test_the_run_ends_on_the_better_of_the_average_and_its_last_weights():
    """The weights with the lower loss stay, whichever they are, and the line says which."""
    for kept in ("weight average", "last step's weights"):
        model = stepped_model()
        average = WeightAverage(model, 0.8)
        take_steps(model, average, 100)
        target = (average.average[0] if kept == "weight average" else model.weight).detach().clone()

        def distance():  # a loss lowest at the weights that should stay
            return (model.weight - target).square().sum().item()
        loss, line = average.end_on_better(distance)
        assert kept in line
        assert loss == distance() == 0
        assert torch.equal(model.weight, target)
    assert WeightAverage(stepped_model(), 0.0).end_on_better(lambda: 0.0) is None


def float64_average(made: list[dict], beta: float) -> dict:
    """The exponential average of the recorded weights, by its definition, in float64: the first, then each
    later one weighted 1 - beta."""
    average = dict(made[0])
    for weights in made[1:]:
        average = {name: beta * average[name] + (1 - beta) * w for name, w in weights.items()}
    return average


@pytest.mark.parametrize("better", ["weight average", "last step's weights"])
def test_the_last_checkpoint_holds_the_better_of_the_average_and_the_last_weights(better, corpus, tmp_path, argv_for,
                                                                                  monkeypatch, capsys):
    """The trainer folds in each step's weights and ends on their average or its last step's weights,
    whichever evaluates better, saying which. Here the validation loss is a judge that knows the answer: it
    scores the weights equal to a float64 average of those recorded after each step of the run's second half
    as `better` wants, anything else in between. The line must name that ending, and the last checkpoint's
    model.safetensors (and so every export) must hold exactly those weights: the average, or the last step's
    weights."""
    made, update = [], WeightAverage.update

    def recording(self, step, progress):
        if progress >= START:
            made.append({n: p.detach().double().clone() for n, p in trainer_model[0].named_parameters()})
        return update(self, step, progress)

    trainer_model = []
    build = step_runner.build

    def keeping(*args, **kwargs):
        b = build(*args, **kwargs)
        trainer_model.append(b.raw_model)
        return b

    beta, judged = 0.6, []

    def judge(*args, **kwargs):  # in place of the validation loss: 1 for the weights `better` names, 3 for the other
        params = dict(trainer_model[0].named_parameters())
        average = float64_average(made, beta) if made else None
        is_average = average is not None and all(torch.allclose(p.double(), average[n], atol=1e-6)
                                                 for n, p in params.items())
        judged.append(is_average)
        loss = (1.0 if better == "weight average" else 3.0) if is_average else 2.0
        return loss, args[3], None  # and the batches read: all asked for

    monkeypatch.setattr(WeightAverage, "update", recording)
    monkeypatch.setattr(step_runner, "build", keeping)
    monkeypatch.setattr(step_runner, "validation_loss", judge)
    monkeypatch.setattr(averaging, "HORIZON", 1.0)  # an 8-step run keeps the beta asked for
    run = tmp_path / "run"
    assert trainer.main(argv_for(corpus, run, "--max_steps", 8, "--weight_average", beta)) == 0
    assert len(made) == 5  # the weights after steps 4 to 8 of 8: the second half
    assert judged[-2:] == [False, True]  # the last evaluation judged the last weights, then the true average
    out = capsys.readouterr()
    said = [line for line in (out.out + out.err).splitlines() if "the run ends on its" in line]
    ending = "the run ends on its weight average" if better == "weight average" else \
        "the run ends on its last step's weights"
    assert len(said) == 1 and said[0].startswith(ending), said
    expected = float64_average(made, beta) if better == "weight average" else made[-1]
    ckpt = ckpt_io.latest_checkpoint(str(run))
    assert ckpt.endswith("step_000008")
    saved = load_file(os.path.join(ckpt, ckpt_io.WEIGHTS))
    stored = {name for name in expected if is_stored(name, ckpt_io.load_model_config(ckpt))}
    assert set(saved) == stored  # every trained weight, the tied head once
    for name in stored:
        assert torch.allclose(saved[name].double(), expected[name], atol=1e-6), name
    other = made[-1] if better == "weight average" else float64_average(made, beta)
    assert not torch.allclose(other["embed_tokens.weight"], expected["embed_tokens.weight"], atol=1e-4)
