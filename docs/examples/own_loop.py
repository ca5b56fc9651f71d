"""``petra_jax.Pipeline`` driven from your own loop: build, init, tick, evaluate, read back.

PETRA on CIFAR-10 with plain optax SGD; prints the losses, the test accuracy of
one batch, and the trained parameters as Flax variables dicts::

  python docs/examples/own_loop.py --steps 20 [--data_dir TFDS_DIR]
"""

import argparse

import jax
import optax

import petra_jax
from petra_jax import data

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--steps", type=int, default=20)
p.add_argument("--data_dir", default=None)
args = p.parse_args()

info = data.get_dataset_info("cifar10")
train = data.open_split("cifar10", info.train_split, args.data_dir)
test = data.open_split("cifar10", info.test_split, args.data_dir)

stages = petra_jax.build_model("revnet18", width=8, num_classes=info.num_classes)
pipe = petra_jax.Pipeline(stages, optax.sgd(0.05, momentum=0.9), method="petra")
batch_fn = data.make_train_batch_fn(info, pipe.input_device)
rows = data.batch_indices(len(train), 32, seed=0, epoch=0, steps_per_epoch=args.steps)
state = pipe.init(seed=0, sample_input=batch_fn(train, rows[0], jax.random.key(0))[0])

# One micro-batch per update (k = 1); micro-batch m is fed when stage 0 takes it.
batches = lambda m: batch_fn(train, rows[m], jax.random.key(m))  # noqa: E731
for tick in pipe.schedule(len(rows)):
  state, outputs = pipe.run_tick(state, tick, batches)
  for out in outputs:
    print(f"micro-batch {out.micro_batch}: loss {float(out.loss):.4f}")

images, labels, valid = next(data.eval_batches(test, info, 500, pipe.input_device))
logits = pipe.predict(state, images)
print("test accuracy (500 images):", float((logits[:valid].argmax(-1) == labels).mean()))

variables = petra_jax.trained_variables(state)  # per stage {"params", "batch_stats"}
print("head:", jax.tree.map(lambda a: a.shape, variables[-1]["params"]))
x = images[:2]
for stage, v in zip(stages, variables):  # the composed model with plain Flax
  f = stage.module.apply(v, x[0] if stage.reversible else x, train=False)
  x = (x[1] + f, x[0]) if stage.reversible else f
print("same logits:", bool(abs(x - logits[:2]).max() < 1e-4))
