import pytest
import torch

from flowers.alexnet import AlexNet
from tests.helpers.tutorial_alexnet import AlexNet as TutorialAlexNet


def test_output_shape_and_parameter_count():
    net = AlexNet(num_classes=5).eval()
    assert net(torch.randn(2, 3, 224, 224)).shape == (2, 5)
    n_params = sum(p.numel() for p in net.parameters())
    assert 14.5e6 < n_params < 14.7e6  # the tutorial's "about 14.6 M"


def test_feature_map_shapes_follow_the_tutorial_table():
    shapes = []
    x = torch.randn(1, 3, 224, 224)
    for layer in AlexNet().features:
        x = layer(x)
        if isinstance(layer, torch.nn.MaxPool2d):
            shapes.append(tuple(x.shape[1:]))
    assert shapes == [(48, 27, 27), (128, 13, 13), (128, 6, 6)]


def test_state_dict_round_trips_with_the_tutorial_class_strictly():
    ours, tutorial = AlexNet(num_classes=5), TutorialAlexNet(num_classes=5)
    assert list(ours.state_dict()) == list(tutorial.state_dict())
    tutorial.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(3, 3, 224, 224)
    torch.testing.assert_close(tutorial.eval()(x), ours.eval()(x))
    ours.load_state_dict(TutorialAlexNet(num_classes=5).state_dict(), strict=True)


@pytest.mark.parametrize("size", [64, 96, 160, 256])
def test_other_image_sizes_reach_the_classifier(size):
    assert AlexNet(num_classes=3).eval()(torch.randn(1, 3, size, size)).shape == (1, 3)


def test_tutorial_init_zeroes_biases_and_keeps_linear_std_small():
    net = AlexNet()
    biases = [m.bias.detach() for m in net.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    assert len(biases) == 8 and all(float(b.abs().max()) == 0 for b in biases)
    assert abs(float(net.classifier[1].weight.detach().std()) - 0.01) < 1e-3


def _avgpool_calls(net: AlexNet, size: int) -> int:
    calls = []
    handle = net.avgpool.register_forward_hook(lambda *args: calls.append(1))
    net.eval()(torch.randn(1, 3, size, size))
    handle.remove()
    return len(calls)


def test_the_adaptive_pool_runs_only_where_the_features_are_not_already_6x6():
    # CUDA has no deterministic backward for the pool: at the tutorial's 224 px it must not run at all.
    net = AlexNet()
    assert _avgpool_calls(net, 224) == 0
    assert _avgpool_calls(net, 192) == 1


@pytest.mark.parametrize("side", [1, 3, 5, 6, 8, 13])
def test_the_matmul_pool_matches_adaptive_average_pooling_and_its_gradient(side):
    from flowers.alexnet import adaptive_avg_pool_by_matmul

    x = torch.randn(2, 4, side, side + 2, dtype=torch.float64, requires_grad=True)
    ours = adaptive_avg_pool_by_matmul(x, (6, 6))
    reference = torch.nn.functional.adaptive_avg_pool2d(x, (6, 6))
    torch.testing.assert_close(ours, reference)
    weights = torch.randn_like(reference)
    (grad_ours,) = torch.autograd.grad((ours * weights).sum(), x)
    (grad_reference,) = torch.autograd.grad((reference * weights).sum(), x)
    torch.testing.assert_close(grad_ours, grad_reference)
