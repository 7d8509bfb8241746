"""Train a model without writing a training loop: the model-zoo interface.

A *model definition* is a Python file (or importable module) that defines a few functions
(:mod:`elastic_allreduce.zoo.contract` lists them); ``elastic-run train --model-def M`` runs the
built-in elastic loop of :mod:`elastic_allreduce.zoo.run` on it, with exactly-once samples from
TFRecord shards, distributed evaluation and an exported model (docs/model-zoo.md).

- :mod:`~elastic_allreduce.zoo.contract` -- the names and signatures a definition must have
  (pure);
- :mod:`~elastic_allreduce.zoo.options` -- the training flags, defined once for ``elastic-run
  train`` and the runner (pure);
- :mod:`~elastic_allreduce.zoo.loader` -- imports a definition, expands data paths, checks the
  output folder;
- :mod:`~elastic_allreduce.zoo.pipeline` -- the definition's pieces made and checked with
  TensorFlow: records to ``(features, labels)``, the model built, the loss, the metrics;
- :mod:`~elastic_allreduce.zoo.run` -- ``python -m elastic_allreduce.zoo.run check|train``;
- :mod:`~elastic_allreduce.zoo.export` and :mod:`~elastic_allreduce.zoo.predict` -- the exported
  model, and batch prediction with it.
"""
