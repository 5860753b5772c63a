"""A model made ready to generate: read by its kind's reader (loading.read_model), its weights in the
inference dtype, optionally int8, and on a CPU whose decode step compiles, linear layers that read each weight
in one pass.

The model and the engine stay plain: what changes for inference is swapped in here, where the model is
prepared, as gpt-fast's quantize step swaps its layers. text_generator.py, serve.py and the tools load through
load_for_inference()."""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from config import LoadConfig, ModelConfig, default_run_dir
from llm.base.device import inference_dtype, pick_device
from llm.base.errors import CheckpointError, ConfigError
from llm.formats.loading import read_model
from llm.generate.decode_compile import use_compile
from llm.tokens.tokenizer import load_tokenizer
from modern_llm import Transformer


class Loaded(NamedTuple):
    """A model ready to generate, whatever kind it was read from; unpacks as (model, tokenizer, config, path).
    """
    model: Transformer
    # transformers' PreTrainedTokenizerFast (load_tokenizer), imported only where it is built
    tokenizer: object
    config: ModelConfig
    path: str  # the checkpoint or Hugging Face folder, or the GGUF file, read


class RowProductLinear(nn.Linear):
    """A linear layer that, compiled on a CPU, multiplies and sums for a few rows (decoding) instead of
    calling a matmul kernel: Inductor makes that one pass over the weight at memory speed, where BLAS for one
    row reaches a third of it and torchao's compiled int8 path (dequantise, then BLAS) a sixth. Otherwise, and
    under autocast, it is F.linear."""
    REDUCE_ROWS = 16  # measured on a 2-core CPU: faster than BLAS through 16 rows, slower at 32

    @classmethod
    def holding(cls, linear: nn.Linear) -> "RowProductLinear":
        """A RowProductLinear with linear's own parameters (int8 or not; a tied head stays tied)."""
        with torch.device("meta"):  # allocates nothing: the parameters are linear's
            row = cls(linear.in_features, linear.out_features, bias=linear.bias is not None)
        row.weight, row.bias = linear.weight, linear.bias
        return row

    def forward(self, x):
        w = self.weight
        if not (torch.compiler.is_compiling() and x.device.type == "cpu"
                and not torch.is_autocast_enabled("cpu")
                and x.numel() <= self.REDUCE_ROWS * x.shape[-1] and self.bias is None):
            return F.linear(x, w, self.bias)
        if type(w) in (torch.Tensor, nn.Parameter):
            return (x.unsqueeze(-2) * w).sum(-1)
        # torchao's, a scale per row
        if type(w).__name__ == "Int8Tensor" and w.scale.shape == (w.shape[0], 1):
            ints = w.qdata.to(x.dtype) - w.zero_point.to(x.dtype)
            return (x.unsqueeze(-2) * ints).sum(-1) * w.scale.to(x.dtype).squeeze(-1)
        return F.linear(x, w)


def use_row_products(model: nn.Module) -> nn.Module:
    """Replace each plain nn.Linear of model by a RowProductLinear holding the same parameters. In place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, RowProductLinear.holding(child))
    return model


def quantize_int8(model: nn.Module) -> nn.Module:
    """Weight-only int8 (torchao): every linear layer, the output head included, keeps int8 weights with
    per-channel scales, so a decode step reads about half the bytes of bf16. In place."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
    except ImportError:
        raise ConfigError("quantize=int8 needs torchao, pip install torchao") from None
    quantize_(model, Int8WeightOnlyConfig())
    return model


def for_inference(model: Transformer, device: torch.device, quantize: str = "none",
                  compile: str = "auto") -> Transformer:
    """The model in eval mode without gradients, its parameters in the inference dtype (bf16 on GPUs that
    compute it natively, else fp32), q/k/v and gate/up stacked, int8 when quantize says so, its generation set
    to compile or not (LoadConfig.compile, decode_compile.use_compile), and with the few-row linear layers
    where its decode step compiles on a CPU. In place."""
    for p in model.parameters():  # parameters only: the RoPE tables stay fp32, as in training
        p.data = p.data.to(inference_dtype(device))
    model.eval().requires_grad_(False)
    # a decode step's matmuls: 4 a block, not 7 (kernels, not FLOPs, bound it on a GPU)
    model.fuse_projections()
    if quantize == "int8":
        quantize_int8(model)
    if use_compile(model, compile) and device.type == "cpu":
        use_row_products(model)
    return model


def load_for_inference(load: LoadConfig | str = "", device=None, **options) -> Loaded:
    """The model a checkpoint, run, LoRA run, Hugging Face folder, hf:ORG/NAME or GGUF file holds, ready to
    generate.

    load: a LoadConfig, or its checkpoint with its other fields as keywords; device, when given (a name or a
    torch.device), replaces its device. A checkpoint "" means the default run folder, whose newest checkpoint
    (best: its best) loads; device "auto" picks CUDA, MPS or CPU; max_seq_len, when given, replaces the saved
    context length; base is the model a LoRA run's adapters join; quantize and compile as for_inference's.
    Raises CheckpointError."""
    load = load if isinstance(load, LoadConfig) else LoadConfig(checkpoint=load, **options)
    found = read_model(load.checkpoint or default_run_dir(), load.max_seq_len, load.best, load.base)
    device = device if isinstance(device, torch.device) else pick_device(device or load.device)
    if found.tokenizer_path is None:
        raise CheckpointError(f"{found.path} has no tokenizer.json, copy the model's tokenizer.json into it")
    tokenizer, cfg = load_tokenizer(found.tokenizer_path), found.config
    ids = max(tokenizer.get_vocab().values(), default=-1) + 1  # not len(): a tokenizer's ids may leave gaps
    if ids > cfg.vocab_size:  # checked before a model is built for it
        raise CheckpointError(f"{found.path}: the tokenizer's ids reach {ids - 1} ({ids} rows needed) but "
                              f"the model's embedding has {cfg.vocab_size} rows, the tokenizer belongs to "
                              "another model; put the tokenizer.json the model was trained with beside it")
    # no random weights drawn only to be overwritten: they come from the checkpoint
    with torch.device("meta"):
        model = Transformer(cfg)
    model.materialize(device).load_stored(found.state)  # read_model checked every tensor
    return Loaded(for_inference(model, device, load.quantize, load.compile), tokenizer, cfg, found.path)
