"""The weight average a run ends on (llm/averaging.py): its definition against a float64 loop, its restore, and
the trainer's last checkpoint holding the average of the weights its steps made."""

import copy

import pytest
import torch
from torch import nn

import gpu_training_optimized as trainer
from llm import checkpoint as ckpt_io
from llm.averaging import START, WeightAverage
from llm.errors import CheckpointError
from modern_llm import Transformer


def stepped_model():
    """A small model whose weight a 'step' overwrites; its bias is frozen, as a LoRA base is."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    return model


def take_steps(model, average, steps: int, first: int = 0, total: int = 10) -> list[torch.Tensor]:
    """Steps first..steps-1 of a run of `total`: new weights, then the average's update; the weights the second
    half made, in float64."""
    made = []
    for step in range(first, steps):
        with torch.no_grad():
            model.weight.copy_(torch.randn(2, 3, generator=torch.Generator().manual_seed(step)))
        average.update((step + 1) / total)
        if (step + 1) / total >= START:
            made.append(model.weight.detach().double().clone())
    return made


def test_the_run_ends_on_an_exponential_average_of_its_second_half():
    model, beta = stepped_model(), 0.8
    average = WeightAverage(model, beta)
    made = take_steps(model, average, 10)
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
    whole = WeightAverage(model, 0.7)
    take_steps(model, whole, 10)
    whole.swap_in()
    interrupted = stepped_model()
    before = WeightAverage(interrupted, 0.7)
    take_steps(interrupted, before, 7)
    resumed = copy.deepcopy(interrupted)  # a new process: its own weights, and the average its checkpoint held
    after = WeightAverage(resumed, 0.7)
    after.load_state_dict(before.state_dict())
    take_steps(resumed, after, 10, first=7)
    after.swap_in()
    assert torch.equal(resumed.weight, model.weight)


def test_off_or_before_the_second_half_the_run_ends_on_its_own_weights():
    for beta, steps in ((0.0, 10), (0.9, 4)):
        model = stepped_model()
        average = WeightAverage(model, beta)
        take_steps(model, average, steps)
        last = model.weight.detach().clone()
        average.swap_in()
        assert torch.equal(model.weight, last)
    off = WeightAverage(stepped_model(), 0.0)
    off.load_state_dict([torch.zeros(2, 3)])  # a checkpoint's average, resumed with averaging off: not used
    assert off.average is None


@pytest.mark.parametrize("saved", [[torch.zeros(3, 3)], [torch.zeros(2, 3), torch.zeros(2)], ["weights"], {"a": 1}])
def test_an_average_of_other_weights_is_refused_in_one_line(saved):
    with pytest.raises(CheckpointError, match="does not match this model's trained weights"):
        WeightAverage(stepped_model(), 0.9).load_state_dict(saved)


def test_the_last_checkpoint_holds_the_average_of_the_weights_the_steps_made(corpus, tmp_path, argv_for,
                                                                             monkeypatch):
    """The trainer folds in each step's weights and ends on their average: the last checkpoint (and so every
    export) equals a float64 average of the weights recorded after each step of the run's second half."""
    made, update = [], WeightAverage.update

    def recording(self, progress):
        if progress >= START:
            made.append({n: p.detach().double().clone() for n, p in trainer_model[0].named_parameters()})
        return update(self, progress)

    trainer_model = []
    build = trainer.build

    def keeping(*args, **kwargs):
        b = build(*args, **kwargs)
        trainer_model.append(b.raw_model)
        return b

    monkeypatch.setattr(WeightAverage, "update", recording)
    monkeypatch.setattr(trainer, "build", keeping)
    run, beta = tmp_path / "run", 0.6
    assert trainer.main(argv_for(corpus, run, "--max_steps", 8, "--weight_average", beta)) == 0
    assert len(made) == 5  # the weights after steps 4 to 8 of 8: the second half
    ckpt = ckpt_io.latest_checkpoint(str(run))
    model = Transformer(ckpt_io.load_model_config(ckpt))
    ckpt_io.load_weights(ckpt, model)
    for name, p in model.named_parameters():
        expected = made[0][name]
        for weights in made[1:]:
            expected = beta * expected + (1 - beta) * weights[name]
        assert torch.allclose(p.double(), expected, atol=1e-6), name
    assert not torch.allclose(model.embed_tokens.weight.double(), made[-1]["embed_tokens.weight"], atol=1e-6)
