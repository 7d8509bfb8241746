"""A training process's GPU: the agent's index, chosen inside TensorFlow with every GPU of the
node left visible (elastic_allreduce.bootstrap.gpu; issue #20, item 3). No GPU here: the pure index
logic,
TensorFlow's calls against a stand-in of tf.config, and a real no-op on this GPU-less machine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import tensorflow as tf

from elastic_allreduce import env
from elastic_allreduce.bootstrap import gpu
from elastic_allreduce.errors import ConfigError

DEVICE = tf.config.PhysicalDevice


def test_the_index_comes_from_the_agents_variable() -> None:
    assert gpu.device_index({env.GPU_INDEX: "3"}) == 3
    assert gpu.device_index({env.GPU_INDEX: " 0 "}) == 0
    assert gpu.device_index({}) is None  # outside elastic-run
    assert gpu.device_index({env.GPU_INDEX: ""}) is None  # the node was given no GPU
    for bad in ("-1", "one", "1,2"):
        with pytest.raises(ConfigError, match="is not a GPU index"):
            gpu.device_index({env.GPU_INDEX: bad})


def test_the_slots_gpu_is_kept_and_no_gpu_or_no_index_changes_nothing() -> None:
    assert gpu.choose(1, 4) == 1
    assert gpu.choose(0, 1) == 0
    assert gpu.choose(None, 4) is None
    assert gpu.choose(2, 0) is None  # a CPU node: TensorFlow sees no GPU
    with pytest.raises(ConfigError, match=r"should use GPU 2 .* sees 2 GPU\(s\)"):
        gpu.choose(2, 2)


@dataclass
class FakeConfig:
    """tf.config as select() uses it, with ``count`` GPUs; records what was set."""

    count: int
    initialized: bool = False
    visible: list[Any] = field(default_factory=list)
    growth: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.visible = self.list_physical_devices("GPU")
        self.experimental = self

    def list_physical_devices(self, kind: str) -> list[Any]:
        assert kind == "GPU"
        return [DEVICE(f"/physical_device:GPU:{i}", "GPU") for i in range(self.count)]

    def get_visible_devices(self, kind: str) -> list[Any]:
        return list(self.visible)

    def set_visible_devices(self, device: Any, kind: str) -> None:
        if self.initialized:
            raise RuntimeError("Visible devices cannot be modified after being initialized")
        self.visible = [device]

    def set_memory_growth(self, device: Any, enable: bool) -> None:
        assert enable
        self.growth.append(device)


def test_select_limits_tensorflow_to_the_slots_gpu_with_memory_growth(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeConfig(count=4)
    monkeypatch.setattr(tf, "config", fake)
    assert gpu.select({env.GPU_INDEX: "2", env.SLOT: "n0.2"}) == 2
    assert [d.name for d in fake.visible] == ["/physical_device:GPU:2"]
    assert [d.name for d in fake.growth] == ["/physical_device:GPU:2"]
    # A second call (install() is idempotent) finds it done and changes nothing.
    fake.initialized = True
    assert gpu.select({env.GPU_INDEX: "2"}) == 2


def test_select_after_tensorflow_started_warns_and_keeps_going(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeConfig(count=2, initialized=True)
    monkeypatch.setattr(tf, "config", fake)
    assert gpu.select({env.GPU_INDEX: "1", env.SLOT: "n0.1"}) is None
    assert "could not limit TensorFlow to GPU 1" in caplog.text
    assert fake.visible == fake.list_physical_devices("GPU")


def test_on_this_machine_without_a_gpu_select_is_a_harmless_no_op() -> None:
    assert tf.config.list_physical_devices("GPU") == []
    before = tf.config.get_visible_devices()
    assert gpu.select({env.GPU_INDEX: "0"}) is None
    assert gpu.select({}) is None
    assert tf.config.get_visible_devices() == before
