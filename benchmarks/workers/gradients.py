"""Gradient lists shaped like three reference networks (Keras layouts, forward order), and a tiny one.

The shapes follow the networks as published, so the tensor counts match the
usual parameter lists (ResNet-50: 161 tensors, 25,557,032 elements; AlexNet:
16 tensors, 61,100,840; ResNet-20 for CIFAR with parameter-free shortcuts:
59 tensors, 269,722). Convolution kernels are (kh, kw, in, out) as in Keras;
batch norm contributes gamma and beta; convolutions followed by batch norm
have no bias. "tiny" (3 tensors, 996 elements, about 4 kB in float32: a
3x3 convolution of 8 to 12 channels, its bias and a 12 x 10 dense kernel) is a
purely latency-bound all-reduce.
"""

import math
from typing import Dict, List, Tuple

Shape = Tuple[int, ...]


def _conv_bn(shapes: List[Shape], k: int, cin: int, cout: int) -> None:
    shapes += [(k, k, cin, cout), (cout,), (cout,)]


def resnet50_shapes() -> List[Shape]:
    shapes: List[Shape] = []
    _conv_bn(shapes, 7, 3, 64)
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            _conv_bn(shapes, 1, cin, width)
            _conv_bn(shapes, 3, width, width)
            _conv_bn(shapes, 1, width, 4 * width)
            if b == 0:
                _conv_bn(shapes, 1, cin, 4 * width)   # projection shortcut
            cin = 4 * width
    shapes += [(2048, 1000), (1000,)]
    return shapes


def alexnet_shapes() -> List[Shape]:
    shapes: List[Shape] = []
    for k, cin, cout in ((11, 3, 64), (5, 64, 192), (3, 192, 384), (3, 384, 256), (3, 256, 256)):
        shapes += [(k, k, cin, cout), (cout,)]
    for cin, cout in ((256 * 6 * 6, 4096), (4096, 4096), (4096, 1000)):
        shapes += [(cin, cout), (cout,)]
    return shapes


def resnet20_shapes() -> List[Shape]:
    shapes: List[Shape] = []
    _conv_bn(shapes, 3, 3, 16)
    cin = 16
    for width in (16, 32, 64):
        for _ in range(3):
            _conv_bn(shapes, 3, cin, width)
            _conv_bn(shapes, 3, width, width)
            cin = width
    shapes += [(64, 10), (10,)]
    return shapes


TINY_SHAPES: List[Shape] = [(3, 3, 8, 12), (12,), (12, 10)]

GRADIENT_SETS: Dict[str, List[Shape]] = {
    "tiny": TINY_SHAPES,
    "resnet20": resnet20_shapes(),
    "resnet50": resnet50_shapes(),
    "alexnet": alexnet_shapes(),
}


def num_elements(shapes: List[Shape]) -> int:
    return sum(math.prod(s) for s in shapes)
