"""A character-level LSTM language model on the Python standard library's own source, elastic.

Runs alone (`python examples/nlp_text.py`) or under `elastic-run` with any number of ranks;
workers may join, leave or die while it trains. The text is every `.py` file of this Python's
standard library, in sorted order (no download); the files are split into training and
validation text (every tenth file is held out), cut into windows of --window characters, and
each window is used exactly once per epoch (ea.ElasticData, fixed global batch).

It reports the validation loss in nats per character and the perplexity, next to the unigram
baseline (the character frequencies of the training text). The last line it prints is
`final validation perplexity: <p> (unigram baseline <u>)`.

Your own text: --text DIR (every *.txt and *.py file under it) or --text FILE.
"""

import argparse
import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import tensorflow as tf

import elastic_allreduce as ea

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--max-chars", type=int, default=1_500_000, help="text to read, at most")
parser.add_argument("--window", type=int, default=64, help="characters per training sample")
parser.add_argument("--global-batch", type=int, default=64)
parser.add_argument("--learning-rate", type=float, default=0.005)
parser.add_argument("--units", type=int, default=192, help="LSTM units")
parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
parser.add_argument("--commit-every", type=int, default=10, help="steps between commits")
parser.add_argument("--text", help="a text file, or a directory of *.txt / *.py files")
parser.add_argument("--seed", type=int, default=0)
args = parser.parse_args()


def read_corpus() -> tuple[str, str]:
    """Training and validation text (every tenth file is validation)."""
    root = Path(args.text) if args.text else Path(sysconfig.get_paths()["stdlib"])
    if root.is_file():
        text = root.read_text(errors="replace")
        split = int(0.9 * len(text))
        return text[:split], text[split:]
    files = sorted(p for pattern in ("*.py", "*.txt") for p in root.rglob(pattern))
    files = [p for p in files if "site-packages" not in p.parts and "test" not in p.parts]
    if not files:
        raise SystemExit(f"nlp_text: no *.py or *.txt files under {root}")
    train, valid, total = [], [], 0
    for number, path in enumerate(files):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (valid if number % 10 == 9 else train).append(text)
        total += len(text)
        if total >= args.max_chars:
            break
    return "\n".join(train), "\n".join(valid)


def windows(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping windows: inputs and the next character at every position."""
    count = (len(codes) - 1) // args.window
    x = codes[: count * args.window].reshape(count, args.window)
    y = codes[1 : count * args.window + 1].reshape(count, args.window)
    return x, y


ea.init()
tf.keras.utils.set_random_seed(args.seed)
train_text, valid_text = read_corpus()
alphabet = sorted(set(train_text))
lookup = {c: i + 1 for i, c in enumerate(alphabet)}  # 0: a character unseen in training
vocab = len(alphabet) + 1


def encode(text: str) -> np.ndarray:
    return np.fromiter((lookup.get(c, 0) for c in text), dtype=np.int32, count=len(text))


train_codes, valid_codes = encode(train_text), encode(valid_text)
x_train, y_train = windows(train_codes)
x_valid, y_valid = windows(valid_codes)
counts = np.bincount(train_codes, minlength=vocab).astype("float64") + 1.0  # add-one smoothing
unigram_nats = float(-np.mean(np.log(counts / counts.sum())[y_valid.ravel()]))

model = tf.keras.Sequential(
    [
        tf.keras.layers.Embedding(vocab, 48),
        tf.keras.layers.LSTM(args.units, return_sequences=True),
        tf.keras.layers.Dense(vocab),
    ]
)
model.build((None, args.window))
optimizer = tf.keras.optimizers.Adam(args.learning_rate, clipnorm=1.0)
optimizer.build(model.trainable_variables)
data = ea.ElasticData(x_train, y_train, global_batch=args.global_batch, seed=args.seed)
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


@tf.function
def train_step(x, y, loss_scale):
    with tf.GradientTape() as tape:
        per_window = tf.reduce_mean(loss_fn(y, model(x, training=True)), axis=1)
        loss = tf.reduce_sum(per_window) * loss_scale
    gradients = ea.DistributedGradientTape(tape).gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))


def validation_nats() -> float:
    logits = model.predict(x_valid, batch_size=256, verbose=0)
    return float(np.mean(loss_fn(y_valid, logits).numpy()))


def finished(state) -> bool:
    return state.epoch >= args.epochs or (args.steps is not None and state.step >= args.steps)


def report(state) -> None:
    nats = validation_nats()
    record = {"epoch": state.epoch, "step": state.step, "ranks": ea.size()}
    record.update(val_loss=round(nats, 4), val_perplexity=round(math.exp(nats), 3))
    record["unigram_perplexity"] = round(math.exp(unigram_nats), 3)
    print(json.dumps(record), flush=True)


state = ea.State(model, optimizer, epoch=0, position=0, step=0)


@ea.run
def train(state):
    while not finished(state):
        for batch in data.batches(state):
            train_step(batch.features, batch.labels, tf.constant(batch.loss_scale, tf.float32))
            data.advance(state, batch)
            if state.step % args.commit_every == 0 or finished(state):
                state.commit()
            if finished(state):
                break
        else:
            data.next_epoch(state)
            state.commit()
        if ea.rank() == 0:
            report(state)


if ea.rank() == 0:
    print(
        json.dumps(
            {
                "train_chars": len(train_text),
                "valid_chars": len(valid_text),
                "vocab": vocab,
                "windows": len(x_train),
            }
        ),
        flush=True,
    )
train(state)
perplexity, baseline = math.exp(validation_nats()), math.exp(unigram_nats)
print(
    f"final validation perplexity: {perplexity:.3f} (unigram baseline {baseline:.3f})", flush=True
)
