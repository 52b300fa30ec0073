"""gf_tf: GradientFlow gradient communication for TensorFlow / Keras."""
