"""The synthetic regression data of ea_data.py, made once for the script and for the tests'
single-process replay of what it trained (numpy only: importable without TensorFlow)."""

import numpy as np


def regression_data(samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(features, labels): float32, ``samples`` x 5 and ``samples`` x 1, the same every time."""
    rng = np.random.default_rng(3)
    features = rng.normal(size=(samples, 5)).astype("float32")
    noise = 0.1 * rng.normal(size=(samples, 1))
    labels = (features @ rng.normal(size=(5, 1)) + noise).astype("float32")
    return features, labels
