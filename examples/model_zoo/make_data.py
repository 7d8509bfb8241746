"""Write the model zoo's offline data sets as TFRecord shards (nothing is downloaded).

    python examples/model_zoo/make_data.py digits   --out data/digits
    python examples/model_zoo/make_data.py chars    --out data/chars    [--max-chars N]
    python examples/model_zoo/make_data.py packages --out data/packages [--per-class N]

Each writes OUT/train-KKKKK-of-NNNNN.tfrecord (--shards of them), OUT/valid-00000-of-00001.tfrecord
and OUT/info.json (record counts and the baseline the model should beat):

- ``digits``: the 8x8 handwritten digits that ship with scikit-learn, split 80/20 as
  examples/cnn_digits.py splits them; features ``image`` (64 floats, 0-16) and ``label``.
  Baseline: the majority class's accuracy.
- ``chars``: the ``.py`` files of this Python's standard library (sorted; every tenth file held
  out for validation), as bytes, cut into windows of --window + 1 bytes (the input and the next
  byte at every position); feature ``window`` (bytes). Baseline: the unigram perplexity of the
  training bytes on the validation bytes.
- ``packages``: which of eight standard-library packages (asyncio, email, xml, ...) a window of
  --window bytes of source comes from; every fourth file of a package is held out, so a
  validation window never comes from a file seen in training; at most --per-class training
  windows per package; features ``text`` (bytes) and ``label``. Baselines: the majority class,
  and a logistic regression on byte counts.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np

#: The first eight of these that this Python has (http and idlelib come last: they read much
#: like email and tkinter).
PACKAGES = (
    "asyncio",
    "email",
    "xml",
    "multiprocessing",
    "unittest",
    "tkinter",
    "distutils",
    "lib2to3",
    "importlib",
    "http",
    "idlelib",
)
CLASSES = 8


def _feature(value: object):
    import tensorflow as tf

    if isinstance(value, bytes):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
    array = np.asarray(value)
    if array.dtype.kind in "iu":
        return tf.train.Feature(int64_list=tf.train.Int64List(value=array.ravel().tolist()))
    return tf.train.Feature(float_list=tf.train.FloatList(value=array.ravel().tolist()))


def write_shards(out: Path, name: str, records: list[dict[str, object]], shards: int) -> list[str]:
    """``records`` (feature dicts) as ``shards`` contiguous TFRecord files."""
    import tensorflow as tf

    files = []
    for number, block in enumerate(np.array_split(np.arange(len(records)), shards)):
        path = out / f"{name}-{number:05d}-of-{shards:05d}.tfrecord"
        with tf.io.TFRecordWriter(str(path)) as writer:
            for index in block:
                feature = {k: _feature(v) for k, v in records[index].items()}
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())
        files.append(path.name)
    return files


def digits() -> tuple[list[dict[str, object]], list[dict[str, object]], dict[str, object]]:
    from sklearn.datasets import load_digits

    data = load_digits()
    order = np.random.default_rng(42).permutation(len(data.images))
    images, labels = data.images[order], data.target[order]
    split = int(0.8 * len(images))

    def rows(lo: int, hi: int) -> list[dict[str, object]]:
        return [
            {"image": images[i].astype("float32").ravel(), "label": np.int64(labels[i])}
            for i in range(lo, hi)
        ]

    majority = float(np.bincount(labels[split:]).max() / (len(labels) - split))
    return rows(0, split), rows(split, len(images)), {"majority_class_accuracy": majority}


def _stdlib_files(root: Path) -> list[Path]:
    files = sorted(root.rglob("*.py"))
    return [p for p in files if not {"site-packages", "test", "tests"} & set(p.parts)]


def chars(
    max_chars: int, window: int
) -> tuple[list[dict[str, object]], list[dict[str, object]], dict[str, object]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    train, valid, total = [], [], 0
    for number, path in enumerate(_stdlib_files(root)):
        try:
            text = path.read_bytes()
            text.decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (valid if number % 10 == 9 else train).append(text)
        total += len(text)
        if total >= max_chars:
            break
    train_bytes, valid_bytes = b"\n".join(train), b"\n".join(valid)

    def windows(data: bytes) -> list[dict[str, object]]:
        count = (len(data) - 1) // window
        return [{"window": data[k * window : (k + 1) * window + 1]} for k in range(count)]

    counts = np.bincount(np.frombuffer(train_bytes, np.uint8), minlength=256) + 1.0
    probabilities = counts / counts.sum()
    targets = np.frombuffer(valid_bytes, np.uint8)[1:]
    unigram = float(np.exp(-np.mean(np.log(probabilities[targets]))))
    info = {"train_bytes": len(train_bytes), "valid_bytes": len(valid_bytes)}
    return windows(train_bytes), windows(valid_bytes), {**info, "unigram_perplexity": unigram}


def packages(
    per_class: int, window: int, seed: int = 0
) -> tuple[list[dict[str, object]], list[dict[str, object]], dict[str, object]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen = [
        name
        for name in PACKAGES
        if (root / name).is_dir() and sum(p.stat().st_size for p in (root / name).rglob("*.py"))
    ][:CLASSES]
    rng = np.random.default_rng(seed)
    train: list[dict[str, object]] = []
    valid: list[dict[str, object]] = []
    for label, name in enumerate(chosen):
        parts: tuple[list[bytes], list[bytes]] = ([], [])
        for number, path in enumerate(_stdlib_files(root / name)):
            data = path.read_bytes()
            held_out = number % 4 == 3
            parts[held_out].extend(
                data[k : k + window] for k in range(0, len(data) - window + 1, window)
            )
        for held_out, rows in ((False, train), (True, valid)):
            found = parts[held_out]
            limit = per_class if not held_out else max(1, per_class // 4)
            picked = rng.permutation(len(found))[:limit]
            rows.extend({"text": found[i], "label": np.int64(label)} for i in sorted(picked))
    train = [train[i] for i in rng.permutation(len(train))]
    labels = np.array([int(r["label"]) for r in valid])
    majority = float(np.bincount(labels).max() / len(labels))
    info: dict[str, object] = {"classes": chosen, "majority_class_accuracy": majority}
    info["bag_of_bytes_accuracy"] = _bag_of_bytes(train, valid)
    return train, valid, info


def _bag_of_bytes(train: list[dict[str, object]], valid: list[dict[str, object]]) -> float:
    """Accuracy of a logistic regression on byte counts: what needs no model of order."""
    from sklearn.linear_model import LogisticRegression

    def counts(rows: Iterable[dict[str, object]]) -> np.ndarray:
        return np.stack(
            [np.bincount(np.frombuffer(r["text"], np.uint8), minlength=256) for r in rows]
        ).astype("float32")

    x, y = counts(train), np.array([int(r["label"]) for r in train])
    classifier = LogisticRegression(max_iter=2000).fit(np.log1p(x), y)
    labels = np.array([int(r["label"]) for r in valid])
    return float(np.mean(classifier.predict(np.log1p(counts(valid))) == labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset", choices=("digits", "chars", "packages"))
    parser.add_argument("--out", required=True, help="the folder to write (created)")
    parser.add_argument("--shards", type=int, default=4, help="training shards (default 4)")
    parser.add_argument("--max-chars", type=int, default=1_500_000, help="chars: text to read")
    parser.add_argument("--window", type=int, help="bytes per sample (chars 64, packages 128)")
    parser.add_argument("--per-class", type=int, default=2000, help="packages: training windows")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.dataset == "digits":
        train, valid, info = digits()
    elif args.dataset == "chars":
        train, valid, info = chars(args.max_chars, args.window or 64)
    else:
        train, valid, info = packages(args.per_class, args.window or 128)
    info = {
        "dataset": args.dataset,
        "train_records": len(train),
        "valid_records": len(valid),
        "train_files": write_shards(out, "train", train, args.shards),
        "valid_files": write_shards(out, "valid", valid, 1),
        **info,
    }
    (out / "info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
