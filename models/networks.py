"""Reference Keras 3 models. Each function returns an uncompiled `keras.Model`
mapping float32 images (batch, height, width, channels), or sequences
(batch, length, channels) for the 1-D models, to logits (batch, num_classes);
softmax is left to the loss (`from_logits=True`).
"""

import keras
from keras import layers


def digits_cnn(input_shape=(8, 8, 1), num_classes=10) -> keras.Model:
    """A small CNN for 8x8 (scikit-learn digits) or 28x28 (MNIST) digits.

    Two 3x3 conv blocks (32, 64 filters, batch norm, ReLU), 2x2 max pooling
    after each when the input is at least 16 pixels wide, a 128-unit dense
    layer, dropout 0.2. 0.54M parameters at 8x8, 0.42M at 28x28.
    """
    pool = min(input_shape[0], input_shape[1]) >= 16
    x = inputs = keras.Input(input_shape)
    for filters in (32, 64):
        x = layers.Conv2D(filters, 3, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
        if pool:
            x = layers.MaxPooling2D(2)(x)
    x = layers.Flatten()(x)
    x = layers.Dense(128, activation="relu")(x)
    x = layers.Dropout(0.2)(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="digits_cnn")


def mnist1d_cnn(input_shape=(40, 1), num_classes=10) -> keras.Model:
    """The 1-D CNN of the MNIST-1D paper (Greydanus 2020, arXiv 2011.14439), with batch norm.

    Three convolutions of 25 filters, width 5, stride 2, "same" padding, each
    followed by batch norm and ReLU; flattened into a dense classifier. The
    authors report about 94% test accuracy for their CNN. 7,785 trainable
    parameters at length 40 (5 x 25 values after the convolutions, flattened).
    """
    x = inputs = keras.Input(input_shape)
    for _ in range(3):
        x = layers.Conv1D(25, 5, strides=2, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        x = layers.ReLU()(x)
    x = layers.Flatten()(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="mnist1d_cnn")


def wide_mlp(input_shape=(40, 1), num_classes=10, width=1024) -> keras.Model:
    """An MLP with two wide hidden layers: flatten, Dense(width) ReLU twice, a dense classifier.

    Nearly all its weights are in one large dense matrix (width x width), the
    case where sparse and low-rank gradient reducers differ most from FP16.
    1.10M parameters at width 1024 on (40, 1) inputs (1.05M of them in the
    width x width layer). The MNIST-1D authors report about 68% for their MLP.
    """
    x = inputs = keras.Input(input_shape)
    x = layers.Flatten()(x)
    for _ in range(2):
        x = layers.Dense(width, activation="relu")(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="wide_mlp")


def topic_attention(input_shape=(32, 1), num_classes=10, vocab=8000, dim=64) -> keras.Model:
    """A text classifier: an embedding table, one self-attention block, a dense head.

    Token ids (float32 (length, 1), cast to int by the embedding) -> Embedding(vocab, dim),
    initialised N(0, 1) (Keras' uniform +-0.05 leaves plain SGD stuck at chance) ->
    MultiHeadAttention(2 heads of 32) with a residual connection and layer norm -> mean over
    the sequence -> Dense(64) ReLU -> logits. 0.55M parameters at the defaults, 0.51M of them
    in the embedding table, whose gradient is a `tf.IndexedSlices` (the rows of the batch's
    tokens): it travels through TensorFlow's own gather, as 16-bit rows under a GradientFlow
    16-bit wire or compression="auto" (`gf_tf.slices`).
    """
    x = inputs = keras.Input(input_shape)
    x = layers.Reshape(input_shape[:1])(x)
    x = layers.Embedding(vocab, dim,
                         embeddings_initializer=keras.initializers.RandomNormal(stddev=1.0))(x)
    attended = layers.MultiHeadAttention(num_heads=2, key_dim=dim // 2)(x, x)
    x = layers.LayerNormalization()(x + attended)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dense(64, activation="relu")(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="topic_attention")


@keras.saving.register_keras_serializable(package="gf_tf_models")
class PadChannels(layers.Layer):
    """Zero-pads the last (channel) axis to `channels`, half before and half after."""

    def __init__(self, channels, **kwargs):
        super().__init__(**kwargs)
        self.channels = channels

    def call(self, x):
        extra = self.channels - x.shape[-1]
        return keras.ops.pad(x, [[0, 0]] * (len(x.shape) - 1) + [[extra // 2, extra - extra // 2]])

    def compute_output_shape(self, input_shape):
        return tuple(input_shape[:-1]) + (self.channels,)

    def get_config(self):
        return {**super().get_config(), "channels": self.channels}


def _residual_block(x, filters, stride, weight_decay):
    """He et al. 2016 basic block; option A shortcut (strided identity, zero-padded channels)."""
    reg = keras.regularizers.l2(weight_decay) if weight_decay else None
    y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False,
                      kernel_initializer="he_normal", kernel_regularizer=reg)(x)
    y = layers.BatchNormalization()(y)
    y = layers.ReLU()(y)
    y = layers.Conv2D(filters, 3, padding="same", use_bias=False,
                      kernel_initializer="he_normal", kernel_regularizer=reg)(y)
    y = layers.BatchNormalization()(y)
    shortcut = x
    if stride != 1 or x.shape[-1] != filters:
        shortcut = layers.MaxPooling2D(1, strides=stride)(x)  # subsample: every stride-th pixel
        shortcut = PadChannels(filters)(shortcut)
    return layers.ReLU()(layers.Add()([y, shortcut]))


def resnet_cifar(depth, input_shape=(32, 32, 3), num_classes=10, weight_decay=1e-4) -> keras.Model:
    """ResNet-`depth` for 32x32 images, the CIFAR-10 variant of He et al. 2016 (arXiv 1512.03385, sec. 4.2).

    depth = 6n + 2 (20, 32, 44, 56, 110): a 3x3 conv with 16 filters, three
    stages of n basic blocks with 16, 32, 64 filters (stride 2 at the start of
    stages 2 and 3), global average pooling, a dense classifier. Shortcuts are
    option A (parameter-free), as in the paper. ResNet-20 has 0.27M parameters.
    Raises ValueError if depth is not 6n + 2.
    """
    if depth < 8 or (depth - 2) % 6:
        raise ValueError(f"ResNet CIFAR depth must be 6n+2 (20, 32, 44, 56, 110), got {depth}")
    blocks = (depth - 2) // 6
    reg = keras.regularizers.l2(weight_decay) if weight_decay else None
    x = inputs = keras.Input(input_shape)
    x = layers.Conv2D(16, 3, padding="same", use_bias=False, kernel_initializer="he_normal",
                      kernel_regularizer=reg)(x)
    x = layers.BatchNormalization()(x)
    x = layers.ReLU()(x)
    for stage, filters in enumerate((16, 32, 64)):
        for block in range(blocks):
            x = _residual_block(x, filters, 2 if stage > 0 and block == 0 else 1, weight_decay)
    x = layers.GlobalAveragePooling2D()(x)
    outputs = layers.Dense(num_classes, kernel_regularizer=reg)(x)
    return keras.Model(inputs, outputs, name=f"resnet{depth}")


def resnet50(input_shape=(224, 224, 3), num_classes=1000) -> keras.Model:
    """ResNet-50 v1 (He et al. 2016) from `keras.applications`, random weights, logits output.

    25.6M parameters at 1000 classes. Any input of at least 32x32 works.
    """
    return keras.applications.ResNet50(weights=None, input_shape=input_shape,
                                       classes=num_classes, classifier_activation=None)


def alexnet(input_shape=(224, 224, 3), num_classes=1000) -> keras.Model:
    """AlexNet, the single-tower variant of Krizhevsky 2014 (arXiv 1404.5997), without LRN.

    Convs 11x11/4 (64), 5x5 (192), 3x3 (384, 256, 256) with 3x3/2 max pooling
    after conv 1, 2 and 5; two 4096-unit dense layers with dropout 0.5. At
    224x224 the last feature map is 6x6x256 and the model has 61M parameters.
    Works for inputs of at least 63x63 (smaller feature maps, fewer dense weights).
    """
    x = inputs = keras.Input(input_shape)
    x = layers.ZeroPadding2D(2)(x)
    x = layers.Conv2D(64, 11, strides=4, activation="relu")(x)
    x = layers.MaxPooling2D(3, strides=2)(x)
    x = layers.Conv2D(192, 5, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D(3, strides=2)(x)
    x = layers.Conv2D(384, 3, padding="same", activation="relu")(x)
    x = layers.Conv2D(256, 3, padding="same", activation="relu")(x)
    x = layers.Conv2D(256, 3, padding="same", activation="relu")(x)
    x = layers.MaxPooling2D(3, strides=2)(x)
    x = layers.Flatten()(x)
    x = layers.Dropout(0.5)(x)
    x = layers.Dense(4096, activation="relu")(x)
    x = layers.Dropout(0.5)(x)
    x = layers.Dense(4096, activation="relu")(x)
    outputs = layers.Dense(num_classes)(x)
    return keras.Model(inputs, outputs, name="alexnet")
