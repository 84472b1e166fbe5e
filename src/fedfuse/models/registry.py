"""Model registry: names -> builders, option validation, per-dataset defaults."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fedfuse.errors import UnsupportedModel, UserError
from fedfuse.models.base import FedModel, check_task, image_shape, scaled
from fedfuse.models.cnn import CNN, CifarCNN, FemnistCNN
from fedfuse.models.mlp import MLP
from fedfuse.models.resnet import ResNet
from fedfuse.models.rnn import CharRNN
from fedfuse.models.transformer import TransformerModel
from fedfuse.models.vgg import VGG, VGG16_CFG

Shape = tuple[int, ...]
CLS = ("classification",)


@dataclass(frozen=True)
class ModelInfo:
    """A registered model: ``builder(input_shape, num_classes, task, **options)``, default task first.

    ``widths(sizes)``: the model's declared ``model_options`` for other hidden widths (one per permutation group;
    None when the model has no per-layer width options or ``sizes`` do not fit it)."""

    name: str
    description: str
    builder: Callable[..., FedModel]
    tasks: tuple[str, ...]
    widths: Callable[[Sequence[int]], dict | None] | None = None


def _flat(input_shape: Shape) -> int:
    n = 1
    for s in input_shape:
        n *= int(s)
    return n


def _vocab(input_shape: Shape, num_classes: int, vocab_size: int) -> int:
    if len(input_shape) != 1:
        raise UserError(f"sequence models need input_shape (L,), got {input_shape}")
    return vocab_size or num_classes


# --- builders: (input_shape, num_classes, task, *, options with defaults) ---


def _mlp(input_shape: Shape, num_classes: int, task: str, *, widths: Sequence[int] = (200, 200)) -> FedModel:
    check_task(task, CLS, "mlp")
    return MLP(_flat(input_shape), num_classes, tuple(widths))


def _simple_mlp(
    input_shape: Shape, num_classes: int, task: str, *, widths: Sequence[int] = (20, 100, 120, 84)
) -> FedModel:
    check_task(task, CLS, "simple-mlp")
    return MLP(_flat(input_shape), num_classes, tuple(widths))


def _cnn(
    input_shape: Shape,
    num_classes: int,
    task: str,
    *,
    channels: Sequence[int] = (32, 64),
    hidden: int = 512,
    kernel_size: int = 5,
) -> FedModel:
    check_task(task, CLS, "cnn")
    return CNN(image_shape(input_shape), num_classes, tuple(channels), hidden, kernel_size)


def _cnn_cifar(
    input_shape: Shape,
    num_classes: int,
    task: str,
    *,
    channels: Sequence[int] = (6, 16),
    hidden: Sequence[int] = (120, 84),
    padding: int | None = None,
) -> FedModel:
    check_task(task, CLS, "cnn-cifar")
    return CifarCNN(image_shape(input_shape), num_classes, tuple(channels), tuple(hidden), padding)


def _cnn_femnist(
    input_shape: Shape,
    num_classes: int,
    task: str,
    *,
    channels: Sequence[int] = (16, 32),
    hidden: int = 256,
    padding: int | None = None,
) -> FedModel:
    check_task(task, CLS, "cnn-femnist")
    return FemnistCNN(image_shape(input_shape), num_classes, tuple(channels), hidden, padding)


def _resnet(name: str, stem: int, widths: Sequence[int], blocks: Sequence[int], strides: Sequence[int]):
    def build(
        input_shape: Shape, num_classes: int, task: str, *, width_mult: float = 1.0, norm: str = "bn"
    ) -> FedModel:
        check_task(task, CLS, name)
        return ResNet(
            image_shape(input_shape),
            num_classes,
            stem=scaled(stem, width_mult),
            widths=[scaled(w, width_mult) for w in widths],
            blocks=blocks,
            strides=strides,
            norm=norm,
        )

    return build


def _vgg16(
    input_shape: Shape,
    num_classes: int,
    task: str,
    *,
    width_mult: float = 1.0,
    fc_hidden: Sequence[int] = (),
    dropout: float = 0.5,
) -> FedModel:
    check_task(task, CLS, "vgg16")
    image = image_shape(input_shape)
    return VGG(image, num_classes, VGG16_CFG, "none", width_mult, tuple(fc_hidden), dropout)


def _vgg16_bn(
    input_shape: Shape,
    num_classes: int,
    task: str,
    *,
    width_mult: float = 1.0,
    fc_hidden: Sequence[int] = (),
    dropout: float = 0.5,
    norm: str = "bn",
) -> FedModel:
    check_task(task, CLS, "vgg16-bn")
    if norm not in ("bn", "bn-static"):
        raise UserError(f"vgg16-bn norm must be 'bn' or 'bn-static', got {norm!r} (use vgg16 for no BN)")
    image = image_shape(input_shape)
    return VGG(image, num_classes, VGG16_CFG, norm, width_mult, tuple(fc_hidden), dropout)


def _transformer(
    input_shape: Shape,
    num_classes: int,
    task: str,
    *,
    d_model: int = 128,
    n_heads: int = 4,
    n_layers: int = 2,
    d_ff: int = 256,
    dropout: float = 0.2,
    tie_weights: bool = False,
    norm_first: bool = False,
    vocab_size: int = 0,
    max_len: int = 512,
    persistent_pe: bool = False,
) -> FedModel:
    check_task(task, ("lm", "classification"), "transformer")
    return TransformerModel(
        _vocab(input_shape, num_classes, vocab_size),
        num_classes,
        task,
        d_model=d_model,
        n_heads=n_heads,
        n_layers=n_layers,
        d_ff=d_ff,
        dropout=dropout,
        tie_weights=tie_weights,
        norm_first=norm_first,
        max_len=max(max_len, int(input_shape[0])),
        persistent_pe=persistent_pe,
    )


def _rnn(cell: str):
    def build(
        input_shape: Shape,
        num_classes: int,
        task: str,
        *,
        embed_dim: int = 8,
        hidden: int = 256,
        num_layers: int = 2,
        dropout: float = 0.0,
        vocab_size: int = 0,
    ) -> FedModel:
        check_task(task, ("classification", "lm"), cell)
        vocab = _vocab(input_shape, num_classes, vocab_size)
        return CharRNN(vocab, num_classes, task, cell, embed_dim, hidden, num_layers, dropout)

    return build


MODELS: dict[str, ModelInfo] = {
    info.name: info
    for info in (
        ModelInfo("mlp", "MLP: flatten, ReLU hidden layers `widths` (default 200-200), linear", _mlp, CLS,
                  MLP.width_options),
        ModelInfo("simple-mlp", "FedMA's SimpleMLP: MLP with widths 20-100-120-84", _simple_mlp, CLS,
                  MLP.width_options),
        ModelInfo("cnn", "McMahan et al. 2017 CNN: conv5x5 32, conv5x5 64 ('same'), fc 512, fc", _cnn, CLS,
                  CNN.width_options),
        ModelInfo("cnn-cifar", "FedMR's CIFAR CNN: conv 6, conv 16, fc 120, fc 84, fc", _cnn_cifar, CLS,
                  CifarCNN.width_options),
        ModelInfo("cnn-femnist", "FedMR authors' FEMNIST/Fashion-MNIST CNN: conv 16, conv 32, fc 256, fc",
                  _cnn_femnist, CLS),
        ModelInfo(
            "resnet9",
            "FedMerge's narrow ResNet-9: widths 8/16/32/64, one BasicBlock per stage",
            _resnet("resnet9", 8, (8, 16, 32, 64), (1, 1, 1, 1), (1, 2, 2, 2)),
            CLS,
        ),
        ModelInfo(
            "resnet18",
            "CIFAR ResNet-18: widths 64/128/256/512, two BasicBlocks per stage (width-sliceable)",
            _resnet("resnet18", 64, (64, 128, 256, 512), (2, 2, 2, 2), (1, 2, 2, 2)),
            CLS,
        ),
        ModelInfo(
            "resnet20",
            "CIFAR ResNet-20: widths 16/32/64, three BasicBlocks per stage, 1x1 conv+BN projections",
            _resnet("resnet20", 16, (16, 32, 64), (3, 3, 3), (1, 2, 2)),
            CLS,
        ),
        ModelInfo("vgg16", "CIFAR VGG-16 without BatchNorm, global avg-pool, linear head", _vgg16, CLS),
        ModelInfo("vgg16-bn", "CIFAR VGG-16 with BatchNorm, global avg-pool, linear head", _vgg16_bn, CLS),
        ModelInfo(
            "transformer",
            "Causal Transformer (sinusoidal positions, separate Q/K/V projections) for LM or classification",
            _transformer,
            ("lm", "classification"),
        ),
        ModelInfo(
            "lstm",
            "Char-level LSTM (LEAF Shakespeare: embedding 8, 2x256 LSTM)",
            _rnn("lstm"),
            ("classification", "lm"),
        ),
        ModelInfo("gru", "Char-level GRU (embedding 8, 2x256 GRU)", _rnn("gru"), ("classification", "lm")),
    )
}


def _info(name: str) -> ModelInfo:
    key = name.strip().lower().replace("_", "-")
    if key not in MODELS:
        from fedfuse.names import unknown

        raise UserError(unknown("model", name, list(MODELS), listing="fedfuse list models"))
    return MODELS[key]


#: type and one help line of every model option (``fedfuse show MODEL``), by option name
OPTION_HELP: dict[str, tuple[str, str]] = {
    "widths": ("list[int]", "hidden layer widths, input to output"),
    "channels": ("list[int]", "output channels of the convolution layers"),
    "hidden": ("int | list[int]", "width of the fully connected hidden layer(s)"),
    "kernel_size": ("int", "convolution kernel size"),
    "padding": ("int | none", "convolution padding; none = 0 when the input is large enough, else 2 ('same')"),
    "width_mult": ("float", "multiplies every layer's width (0.25 = a quarter-width network)"),
    "norm": ("str", "normalisation layers: bn, bn-static (no running statistics) or none"),
    "fc_hidden": ("list[int]", "hidden widths of the classifier head; [] = one linear layer"),
    "dropout": ("float", "dropout probability"),
    "d_model": ("int", "embedding and hidden size"),
    "n_heads": ("int", "attention heads per layer"),
    "n_layers": ("int", "transformer layers"),
    "d_ff": ("int", "feed-forward hidden size"),
    "tie_weights": ("bool", "share the input embedding and output projection"),
    "norm_first": ("bool", "layer norm before attention/feed-forward (pre-LN) instead of after"),
    "vocab_size": ("int", "vocabulary size; 0 = the dataset's"),
    "max_len": ("int", "longest sequence the positional encoding covers"),
    "persistent_pe": ("bool", "store the positional encoding in the state dict"),
    "embed_dim": ("int", "token embedding size"),
    "num_layers": ("int", "recurrent layers"),
}


def model_options(name: str) -> dict[str, object]:
    """Option name -> default for model ``name`` (from its builder's keyword-only parameters)."""
    params = inspect.signature(_info(name).builder).parameters.values()
    return {p.name: p.default for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def build_model(
    name: str, input_shape: Sequence[int], num_classes: int, task: str | None = None, **options: object
) -> FedModel:
    """Build model ``name`` for inputs of ``input_shape`` ((C,H,W) images, (F,) features, (L,) tokens).

    ``num_classes`` is the number of outputs (the vocabulary size for token models).  ``task`` is
    "classification" or "lm"; ``None`` takes the model's default (``MODELS[name].tasks[0]``: "lm" for the
    transformer, "classification" for everything else) -- pass the federation's task to be explicit.
    Raises ``ValueError`` for an unknown model, task or option.
    """
    info = _info(name)
    task = task or info.tasks[0]
    check_task(task, info.tasks, info.name)
    valid = model_options(info.name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise UserError(
            f"unknown option(s) {unknown} for model {info.name!r}; "
            f"valid options: {', '.join(valid) or 'none'}"
        )
    if num_classes < 1:
        raise UserError(f"num_classes must be >= 1, got {num_classes}")
    shape = tuple(int(s) for s in input_shape)
    opts = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}
    model = info.builder(shape, int(num_classes), task, **opts)
    model.name = info.name
    model.options = {**valid, **opts}
    model.input_shape = shape
    model.num_classes = int(num_classes)
    return model


def width_options(name: str, sizes: Sequence[int]) -> dict:
    """``model_options`` that build model ``name`` with the hidden widths ``sizes`` (one per
    :func:`~fedfuse.fusion.permute.chain_spec` group), as the model class declares (``width_options``)."""
    info = _info(name)
    opts = info.widths(sizes) if info.widths is not None else None
    if opts is None:
        raise UnsupportedModel(f"model {name!r} has no per-layer width options; FedMA supports mlp, simple-mlp, "
                               "cnn and cnn-cifar")
    return opts


DEFAULT_MODELS: dict[str, str] = {
    "digits": "mlp",
    "mnist": "cnn",
    "fashionmnist": "cnn",
    "femnist": "cnn",
    "cifar10": "cnn-cifar",
    "cifar100": "cnn-cifar",
    "shakespeare": "lstm",
    "ptb": "transformer",
    "wikitext2": "transformer",
    "tinyshakespeare": "transformer",
}


def default_model(dataset: str) -> str:
    """A sensible default model for a dataset name (case, '-' and '_' ignored)."""
    if dataset.startswith("hf:"):  # a local Hugging Face dataset of any input shape: the MLP takes them all
        return "mlp"
    key = dataset.lower().replace("-", "").replace("_", "")
    if key not in DEFAULT_MODELS:
        raise UserError(f"no default model for dataset {dataset!r}; known: {', '.join(DEFAULT_MODELS)}")
    return DEFAULT_MODELS[key]
