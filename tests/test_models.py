"""Tests for fedfuse.models: shapes, gradients, declared structure, parameter counts, registry."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedfuse.models import (
    MODELS,
    FedModel,
    build_model,
    count_parameters,
    default_model,
    layer_index,
    model_options,
)

IMAGE_MODELS = [
    "mlp",
    "simple-mlp",
    "cnn",
    "cnn-cifar",
    "cnn-femnist",
    "resnet9",
    "resnet18",
    "resnet20",
    "vgg16",
    "vgg16-bn",
]
SEQ_MODELS = ["transformer", "lstm", "gru"]
# keep the big networks narrow so the whole file stays fast
SMALL = {"resnet18": {"width_mult": 0.125}, "vgg16": {"width_mult": 0.125}, "vgg16-bn": {"width_mult": 0.125}}
IMAGE_SHAPES = {"digits": (1, 8, 8), "mnist": (1, 28, 28), "cifar": (3, 32, 32)}
VOCAB, SEQ_LEN = 100, 35

IMAGE_CASES = [(m, s) for m in IMAGE_MODELS for s in IMAGE_SHAPES]
SEQ_CASES = [(m, t) for m in SEQ_MODELS for t in ("lm", "classification")]
SEQ_SMALL = {
    "transformer": {"d_model": 32, "n_heads": 4, "d_ff": 64},
    "lstm": {"hidden": 32},
    "gru": {"hidden": 32},
}


def test_registry_lists_every_model() -> None:
    assert set(MODELS) == set(IMAGE_MODELS) | set(SEQ_MODELS)
    for name, info in MODELS.items():
        assert info.name == name and info.description and "\n" not in info.description
        assert info.tasks and set(info.tasks) <= {"classification", "lm"}


def _image_model(name: str, shape: tuple[int, ...], classes: int = 10) -> tuple[FedModel, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(name, shape, classes, **SMALL.get(name, {}))
    return model, torch.randn(3, *shape)


def _seq_model(name: str, task: str) -> tuple[FedModel, torch.Tensor]:
    torch.manual_seed(0)
    model = build_model(name, (SEQ_LEN,), VOCAB, task=task, **SEQ_SMALL[name])
    return model, torch.randint(0, VOCAB, (2, SEQ_LEN))


def _check_structure(model: FedModel) -> None:
    state = model.state_dict()
    layers = model.layers()
    keys = [k for layer in layers for k in layer.keys]
    assert len(keys) == len(set(keys)), "a key appears in two layers"
    assert set(keys) == set(state), "layers() must cover exactly the state-dict keys"
    assert [layer.name for layer in layers] == list(dict.fromkeys(layer.name for layer in layers))
    modules = dict(model.named_modules())
    for layer in layers:
        assert layer.keys and layer.kind
        if layer.kind == "bn":
            assert isinstance(modules[layer.name], nn.BatchNorm2d)
            suffixes = {k.rpartition(".")[2] for k in layer.keys}
            expected = {"weight", "bias"}
            if modules[layer.name].track_running_stats:
                expected |= {"running_mean", "running_var", "num_batches_tracked"}
            assert suffixes == expected
    # every buffer sits with its module's parameters
    index = layer_index(model)
    for key in state:
        if key.endswith(("running_mean", "running_var", "num_batches_tracked")):
            assert index[key] == index[key.rpartition(".")[0] + ".weight"]
    head = model.head_keys()
    assert head and set(head) <= set(state)
    assert {k.rpartition(".")[2] for k in head} == {"weight", "bias"}


def _check_forward_backward(model: FedModel, x: torch.Tensor, out_shape: tuple[int, ...]) -> None:
    model.train()
    out = model(x)
    assert out.shape == out_shape and out.dtype == torch.float32
    out.float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    model.eval()
    with torch.no_grad():
        z, logits = model.features_and_logits(x)
        assert torch.allclose(logits, model(x), atol=1e-5)
    assert z.shape[:-1] == out_shape[:-1]
    assert z.shape[-1] == model.head.in_features


@pytest.mark.parametrize(("name", "dataset"), IMAGE_CASES)
def test_image_models(name: str, dataset: str) -> None:
    model, x = _image_model(name, IMAGE_SHAPES[dataset])
    assert model.task == "classification" and model.name == name
    _check_forward_backward(model, x, (3, 10))
    _check_structure(model)


@pytest.mark.parametrize(("name", "task"), SEQ_CASES)
def test_sequence_models(name: str, task: str) -> None:
    model, x = _seq_model(name, task)
    assert model.task == task
    _check_forward_backward(model, x, (2, SEQ_LEN, VOCAB) if task == "lm" else (2, VOCAB))
    _check_structure(model)
    if task == "lm":
        assert model.features(x).shape[:2] == (2, SEQ_LEN)


def test_flat_inputs() -> None:
    torch.manual_seed(0)
    mlp = build_model("mlp", (64,), 10)
    assert mlp(torch.randn(4, 64)).shape == (4, 10)
    cnn = build_model("cnn", (784,), 62)  # LEAF FEMNIST rows are flat 784-vectors
    assert cnn(torch.randn(2, 784)).shape == (2, 62)
    assert cnn(torch.randn(2, 1, 28, 28)).shape == (2, 62)


def test_layer_order_input_to_output() -> None:
    model = build_model("cnn-cifar", (3, 32, 32), 10)
    assert [layer.name for layer in model.layers()] == ["conv1", "conv2", "fc1", "fc2", "fc"]
    assert [layer.kind for layer in model.layers()] == ["conv", "conv", "linear", "linear", "linear"]
    resnet = build_model("resnet9", (3, 32, 32), 10)
    names = [layer.name for layer in resnet.layers()]
    assert names[:4] == ["conv1", "bn1", "layer1.0.conv1", "layer1.0.bn1"] and names[-1] == "fc"
    assert list(resnet.layers()[-1].keys) == resnet.head_keys()
    tr = build_model("transformer", (SEQ_LEN,), VOCAB, n_layers=1)
    names = [layer.name for layer in tr.layers()]
    assert names == [
        "embed",
        *(f"blocks.0.{m}" for m in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "norm1")),
        "blocks.0.fc1",
        "blocks.0.fc2",
        "blocks.0.norm2",
        "decoder",
    ]
    kinds = {layer.name: layer.kind for layer in tr.layers()}
    assert kinds["embed"] == "embedding" and kinds["blocks.0.norm1"] == "ln"
    pre = build_model("transformer", (SEQ_LEN,), VOCAB, n_layers=1, norm_first=True)
    names = [layer.name for layer in pre.layers()]
    assert names[1] == "blocks.0.norm1" and names[-2:] == ["final_norm", "decoder"]
    lstm = build_model("lstm", (80,), 80)
    assert [(layer.name, layer.kind) for layer in lstm.layers()] == [
        ("embed", "embedding"),
        ("rnn.0", "rnn"),
        ("rnn.1", "rnn"),
        ("fc", "linear"),
    ]


@pytest.mark.parametrize(
    ("name", "shape", "classes", "options", "expected"),
    [
        ("mlp", (1, 28, 28), 10, {}, 199_210),  # 784-200-200-10
        ("simple-mlp", (1, 28, 28), 10, {}, 40_934),  # FedMA's 784-20-100-120-84-10
        ("cnn", (1, 28, 28), 10, {}, 1_663_370),  # McMahan et al. 2017 with 'same' padding
        ("cnn-cifar", (3, 32, 32), 10, {}, 62_006),
        ("cnn-femnist", (1, 28, 28), 62, {}, 160_510),
        ("resnet9", (3, 32, 32), 10, {}, 78_002),
        ("resnet20", (3, 32, 32), 10, {}, 272_474),  # 269,722 + 1x1 conv/BN projections
        ("resnet18", (3, 32, 32), 10, {}, 11_173_962),
        ("vgg16-bn", (3, 32, 32), 10, {}, 14_728_266),
        ("lstm", (80,), 80, {}, 819_920),  # LEAF Shakespeare
        ("transformer", (35,), 100, {}, 290_660),
    ],
)
def test_parameter_counts(
    name: str, shape: tuple[int, ...], classes: int, options: dict, expected: int
) -> None:
    assert count_parameters(build_model(name, shape, classes, **options)) == expected


def test_count_parameters_trainable_only() -> None:
    model = build_model("mlp", (4,), 2, widths=(3,))
    model.hidden[0].weight.requires_grad_(False)
    assert count_parameters(model) == 4 * 3 + 3 + 3 * 2 + 2
    assert count_parameters(model, trainable_only=True) == 3 + 3 * 2 + 2


def test_init_is_deterministic() -> None:
    def state(seed: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(seed)
        return build_model("resnet9", (3, 32, 32), 10).state_dict()

    a, b, c = state(1), state(1), state(2)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_state_dict_round_trip() -> None:
    torch.manual_seed(0)
    a = build_model("transformer", (SEQ_LEN,), VOCAB, d_model=16, n_heads=2, d_ff=32).eval()
    b = build_model("transformer", (SEQ_LEN,), VOCAB, d_model=16, n_heads=2, d_ff=32).eval()
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, VOCAB, (2, SEQ_LEN))
    assert torch.allclose(a(x), b(x))


def test_width_mult_and_norm_options() -> None:
    m = build_model("resnet18", (3, 32, 32), 10, width_mult=0.25)
    assert m.conv1.out_channels == 16 and m.fc.in_features == 128
    assert build_model("resnet20", (3, 32, 32), 10, width_mult=0.5).fc.in_features == 32
    no_bn = build_model("resnet9", (3, 32, 32), 10, norm="none")
    assert all(layer.kind == "conv" for layer in no_bn.layers()[:-1])
    _check_structure(no_bn)
    static = build_model("resnet9", (3, 32, 32), 10, norm="bn-static")
    assert not any("running" in k for k in static.state_dict())
    _check_structure(static)
    vgg = build_model("vgg16", (3, 32, 32), 10, width_mult=0.125, fc_hidden=(16, 16))
    assert [k for k in vgg.state_dict() if k.startswith("classifier")] == [
        "classifier.0.weight",
        "classifier.0.bias",
        "classifier.3.weight",
        "classifier.3.bias",
    ]
    assert vgg.head_keys() == ["fc.weight", "fc.bias"] and vgg.fc.in_features == 16
    with pytest.raises(ValueError, match="norm"):
        build_model("resnet9", (3, 32, 32), 10, norm="batch")
    with pytest.raises(ValueError, match="width_mult"):
        build_model("resnet9", (3, 32, 32), 10, width_mult=0)


def test_tied_weights_travel_together() -> None:
    model = build_model("transformer", (SEQ_LEN,), VOCAB, d_model=16, n_heads=2, d_ff=32, tie_weights=True)
    assert model.decoder.weight is model.embed.weight
    _check_structure(model)
    index = layer_index(model)
    assert index["decoder.weight"] == index["embed.weight"] == 0
    assert model.layers()[-1].keys == ("decoder.bias",)
    untied = build_model("transformer", (SEQ_LEN,), VOCAB, d_model=16, n_heads=2, d_ff=32)
    assert count_parameters(untied) - count_parameters(model) == VOCAB * 16
    with pytest.raises(ValueError, match="tie_weights"):
        build_model("transformer", (SEQ_LEN,), VOCAB, task="classification", vocab_size=50, tie_weights=True)


def test_positional_encoding_buffer() -> None:
    model = build_model("transformer", (SEQ_LEN,), VOCAB, d_model=16, n_heads=2, d_ff=32, max_len=8)
    assert not any("pos_encoding" in k for k in model.state_dict())  # not communicated
    assert model.pos_encoding.pe.shape == (SEQ_LEN, 16)  # table covers the declared input length
    model.eval()
    assert model(torch.randint(0, VOCAB, (1, 3 * SEQ_LEN))).shape == (1, 3 * SEQ_LEN, VOCAB)
    persistent = build_model(
        "transformer", (SEQ_LEN,), VOCAB, d_model=16, n_heads=2, d_ff=32, persistent_pe=True
    )
    assert "pos_encoding.pe" in persistent.state_dict()
    assert {layer.name: layer.kind for layer in persistent.layers()}["pos_encoding"] == "posenc"
    _check_structure(persistent)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_is_causal(norm_first: bool) -> None:
    torch.manual_seed(0)
    model = build_model("transformer", (12,), VOCAB, d_model=16, n_heads=4, d_ff=32, norm_first=norm_first)
    model.eval()
    x = torch.randint(0, VOCAB, (1, 12))
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :8], b[:, :8], atol=1e-5)
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_sequence_classification_uses_last_position() -> None:
    torch.manual_seed(0)
    lm = build_model("lstm", (20,), 30, task="lm", hidden=16).eval()
    cls = build_model("lstm", (20,), 30, task="classification", hidden=16).eval()
    cls.load_state_dict(lm.state_dict())
    x = torch.randint(0, 30, (2, 20))
    with torch.no_grad():
        assert torch.allclose(cls(x), lm(x)[:, -1], atol=1e-6)
    small_vocab = build_model("gru", (20,), 5, task="classification", vocab_size=30, hidden=8)
    assert small_vocab.embed.num_embeddings == 30 and small_vocab(x).shape == (2, 5)


def test_default_task() -> None:
    assert build_model("transformer", (SEQ_LEN,), VOCAB, d_model=16, n_heads=2).task == "lm"
    assert build_model("lstm", (80,), 80, hidden=8).task == "classification"
    assert build_model("cnn", (1, 8, 8), 10).task == "classification"


def test_unknown_names_options_and_tasks() -> None:
    with pytest.raises(ValueError, match="resnet18"):
        build_model("resnet-1000", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="widths"):
        build_model("mlp", (4,), 2, depth=3)
    with pytest.raises(ValueError, match="classification"):
        build_model("cnn", (1, 28, 28), 10, task="lm")
    with pytest.raises(ValueError, match="mlp"):
        model_options("nope")
    with pytest.raises(ValueError):
        build_model("cnn", (1, 2, 2), 10)  # too small even with padding
    with pytest.raises(ValueError, match="divisible"):
        build_model("transformer", (SEQ_LEN,), VOCAB, d_model=30, n_heads=4)


def test_model_options() -> None:
    assert model_options("mlp") == {"widths": (200, 200)}
    assert model_options("simple-mlp") == {"widths": (20, 100, 120, 84)}
    assert model_options("resnet18") == {"width_mult": 1.0, "norm": "bn"}
    tr = model_options("transformer")
    assert {k: tr[k] for k in ("d_model", "n_heads", "n_layers", "d_ff", "dropout", "tie_weights")} == {
        "d_model": 128,
        "n_heads": 4,
        "n_layers": 2,
        "d_ff": 256,
        "dropout": 0.2,
        "tie_weights": False,
    }
    assert model_options("lstm") == {
        "embed_dim": 8,
        "hidden": 256,
        "num_layers": 2,
        "dropout": 0.0,
        "vocab_size": 0,
    }
    for name in MODELS:
        assert isinstance(model_options(name), dict)
    m = build_model("mlp", (4,), 2, widths=[8, 8])  # lists (from YAML) are accepted
    assert m.options == {"widths": (8, 8)} and len(m.hidden) == 2


def test_default_model() -> None:
    expected = {
        "digits": "mlp",
        "mnist": "cnn",
        "fashion-mnist": "cnn",
        "femnist": "cnn",
        "cifar10": "cnn-cifar",
        "cifar100": "cnn-cifar",
        "shakespeare": "lstm",
        "ptb": "transformer",
        "wikitext2": "transformer",
        "tiny-shakespeare": "transformer",
    }
    for dataset, model in expected.items():
        assert default_model(dataset) == model
        assert model in MODELS
    assert default_model("Fashion_MNIST") == "cnn"
    with pytest.raises(ValueError, match="mnist"):
        default_model("imagenet")
