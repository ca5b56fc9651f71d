"""The PETRA engine: a host-side tick loop over stages on their own devices.

Each stage ``j`` lives on one device (``jax.device_put``) and owns a carried
:class:`StageState` (parameters, BatchNorm statistics, optimizer state with the
gradient accumulator, update counter). On every tick (paper Alg. 1, Eq. 5):

* every stage runs a forward on the micro-batch it received on the previous
  tick and sends the output to stage ``j+1``;
* every stage runs a reverse-backward on the ``(x~_j, delta_{j+1})`` it
  received from stage ``j+1`` on the previous tick -- a reversible stage
  rebuilds its input from its output with its *current* weights, a
  non-reversible one pops its input buffer and recomputes -- updates its
  parameters with optax, and sends ``(x~_{j-1}, delta_j)`` to stage ``j-1``;
* the last stage runs forward, loss and backward at once.

Forward and backward of a tick both use ``theta_j^t``; the update follows them.
Micro-batch ``m``'s backward at stage ``j`` runs ``tau_j = 2(J-1-j)`` ticks
after its forward there (:mod:`petra_jax.schedule`). The jitted steps are
compiled once per stage and donate the carried state; the loop never waits for
the devices (losses are returned as device arrays).

``revprop`` (synchronous reversible backprop) is this same engine drained after
every micro-batch: the delays are 0 and the gradients exact up to the
reconstruction's round-off. ``backprop`` is ``jax.grad`` of the composed model
(:meth:`Pipeline.backprop_step`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

from petra_jax import diagnostics
from petra_jax import schedule
from petra_jax import transport
from petra_jax.stage import (Stage, cross_entropy, forward, loss_vjp, recompute_vjp,
                             reverse_vjp, reverse_vjp_stashed)

PyTree = Any
BN_POLICIES = ("backward", "forward")
_LOSS_SPEC = jax.ShapeDtypeStruct((), jnp.float32)

# Asynchronous methods of paper Table 4: what each stage keeps between a
# micro-batch's forward and its backward (the last stage keeps nothing).
#   method              inputs stashed          weights stashed  reversible stages
#   petra               non-reversible only     no               reconstruct, current weights
#   approximate_input   non-reversible only     yes              reconstruct (current), vjp (stashed)
#   dsp                 all stages              no               no reconstruction (Xu et al.)
#   delayed             all stages              yes              no reconstruction (PipeDream)
PIPELINE_METHODS = ("petra", "approximate_input", "dsp", "delayed")


class StageState(train_state.TrainState):
  """Carried state of one stage.

  ``params`` and ``opt_state`` as in Flax's ``TrainState`` (the optax state
  holds momentum and, for ``k > 1``, the ``MultiSteps`` accumulator and
  counter); ``batch_stats`` the BatchNorm running statistics; ``step`` counts
  backward passes (micro-batches) at this stage.
  """
  batch_stats: PyTree = None


class Message(NamedTuple):
  """An activation (or ``(x~, delta)`` pair) tagged with its micro-batch."""
  micro_batch: int
  payload: PyTree


@dataclasses.dataclass
class PipelineState:
  """Everything the next tick depends on.

  Attributes:
    stages: per-stage carried state, each on its stage's device.
    tick: ticks run so far.
    next_micro_batch: index the next fed micro-batch gets.
    fwd_inbox: ``fwd_inbox[j]``: the input stage ``j`` runs forward next tick.
    bwd_inbox: ``bwd_inbox[j]``: ``(x~_j or None, delta_{j+1})`` stage ``j``
      runs backward next tick (``x~`` is only sent to reversible stages).
    buffers: FIFO of the inputs each stage stashed (non-reversible stages,
      or every stage for ``dsp``/``delayed``).
    weight_stash: FIFO of the parameters each stage's forward used
      (``delayed``/``approximate_input`` only).
    labels: FIFO of labels in flight to the last stage (on its device).
    probes: copies of the inputs of reversible stages for the micro-batches
      whose reconstruction error is measured (``Pipeline(probe_every=...)``);
      a diagnostic, not saved in checkpoints.
    reconstruction_errors: ``(micro_batch, stage, error)`` measured since the
      caller last emptied the list; ``error`` is a float32 device scalar.
    grad_probes: ``{micro_batch: diagnostics.GradProbe}`` of the micro-batches
      whose gradient quality is measured (``Pipeline(grad_probe_every=...)``),
      kept until their backward reaches stage 0; a diagnostic, not saved in
      checkpoints.
    grad_quality: ``(micro_batch, {name: float32[J]})`` per finished probe
      since the caller last emptied the list: the per-stage cosine
      similarities and norm ratios of ``diagnostics.METRICS`` (device arrays).
  """
  stages: list
  tick: int = 0
  next_micro_batch: int = 0
  fwd_inbox: list = dataclasses.field(default_factory=list)
  bwd_inbox: list = dataclasses.field(default_factory=list)
  buffers: list = dataclasses.field(default_factory=list)
  weight_stash: list = dataclasses.field(default_factory=list)
  labels: collections.deque = dataclasses.field(default_factory=collections.deque)
  probes: dict = dataclasses.field(default_factory=dict)
  reconstruction_errors: list = dataclasses.field(default_factory=list)
  grad_probes: dict = dataclasses.field(default_factory=dict)
  grad_quality: list = dataclasses.field(default_factory=list)

  def in_flight(self) -> int:
    """Micro-batches fed whose backward has not reached stage 0 yet."""
    waiting = {m.micro_batch for m in self.fwd_inbox + self.bwd_inbox if m is not None}
    for buf in self.buffers:
      waiting |= {m.micro_batch for m in buf}
    return len(waiting)

  def stored_bytes(self) -> list[int]:
    """Bytes each stage holds between forwards and backwards (input buffers
    and weight stashes; in-flight messages excluded)."""
    def nbytes(msgs):
      return sum(x.nbytes for m in msgs for x in jax.tree.leaves(m.payload))
    stash = self.weight_stash or [()] * len(self.buffers)
    return [nbytes(b) + nbytes(w) for b, w in zip(self.buffers, stash)]


class TickOutput(NamedTuple):
  """What the last stage produced on a tick: the loss of one micro-batch."""
  micro_batch: int
  loss: jax.Array  # float32 scalar, still on the device


# ----------------------------------------------------------------------------
# Jitted per-stage steps (module-level pure functions; one jit per stage).
# ----------------------------------------------------------------------------

def _update(state: StageState, grads, new_stats, take_stats: bool) -> StageState:
  return state.apply_gradients(
      grads=grads, batch_stats=new_stats if take_stats else state.batch_stats)


def forward_step(stage: Stage, state: StageState, x):
  """``(y, batch_stats)``: the stage forward with ``theta_j^t`` (Eq. 5, row 1)."""
  return forward(stage, state.params, state.batch_stats, x)


def reverse_backward_step(stage: Stage, take_stats: bool, state: StageState, y, dy,
                          vjp_params=None, *, return_grads: bool = False):
  """Reversible stage: reconstruct, vjp and update (Eq. 5, rows 2-5).

  With ``vjp_params`` (stashed forward weights), the vjp is taken with them
  (Table 4's "approximate input"). Returns ``(new_state, x_tilde, dx)``, and
  the applied gradient as a fourth element with ``return_grads`` (a separate
  jit, used for the micro-batches ``grad_probe_every`` picks).
  """
  if vjp_params is None:
    x, dx, grads, stats = reverse_vjp(stage, state.params, state.batch_stats, y, dy)
  else:
    x, dx, grads, stats = reverse_vjp_stashed(stage, state.params, vjp_params,
                                              state.batch_stats, y, dy)
  out = (_update(state, grads, stats, take_stats), x, dx)
  return out + (grads,) if return_grads else out


def recompute_backward_step(stage: Stage, take_stats: bool, input_grad: bool,
                            state: StageState, x, dy, vjp_params=None, *,
                            return_grads: bool = False):
  """Recompute from the buffered input, vjp and update.

  The vjp uses ``vjp_params`` (stashed forward weights: ``delayed``) when
  given, else the current weights. Returns ``(new_state, dx)`` (``dx`` is
  None without ``input_grad``), plus the applied gradient with
  ``return_grads``.
  """
  params = state.params if vjp_params is None else vjp_params
  dx, grads, stats = recompute_vjp(stage, params, state.batch_stats, x, dy,
                                   input_grad=input_grad)
  out = (_update(state, grads, stats, take_stats), dx)
  return out + (grads,) if return_grads else out


def loss_step(stage: Stage, state: StageState, x, labels, *, return_grads: bool = False):
  """Last stage: forward, loss, backward and update. ``(new_state, dx, loss)``,
  plus the applied gradient with ``return_grads``."""
  loss, dx, grads, stats = loss_vjp(stage, state.params, state.batch_stats, x, labels)
  out = (_update(state, grads, stats, True), dx, loss)
  return out + (grads,) if return_grads else out


def relative_error(x_tilde, x) -> jax.Array:
  """``||x~ - x|| / ||x||`` over all leaves (float32 scalar)."""
  num = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(x_tilde), jax.tree.leaves(x)))
  den = sum(jnp.sum(b ** 2) for b in jax.tree.leaves(x))
  return jnp.sqrt(num / den)


def eval_step(stage: Stage, state: StageState, x):
  """Stage forward with the running BatchNorm statistics (evaluation)."""
  return forward(stage, state.params, state.batch_stats, x, train=False)[0]


def backprop_step(stages: Sequence[Stage], states: Sequence[StageState], images, labels):
  """Exact synchronous backprop: ``jax.grad`` of the composed model.

  Running statistics are updated by the (only) forward pass.
  Returns ``(new_states, loss)``.
  """
  def loss_fn(params):
    x, new_stats = images, []
    for stage, state, p in zip(stages, states, params):
      x, stats = forward(stage, p, state.batch_stats, x)
      new_stats.append(stats)
    return cross_entropy(x, labels), new_stats

  (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      [s.params for s in states])
  return [_update(s, g, n, True) for s, g, n in zip(states, grads, new_stats)], loss


# ----------------------------------------------------------------------------
# The engine.
# ----------------------------------------------------------------------------

def assign_devices(num_stages: int, devices: Sequence[jax.Device]) -> list:
  """Contiguous blocks of stages per device: stage ``j`` -> ``devices[j*n//J]``."""
  n = len(devices)
  return [devices[j * n // num_stages] for j in range(num_stages)]


class Pipeline:
  """PETRA over ``J`` stages placed on devices.

  Args:
    stages: the model's stages (at least 2; the last one computes the loss).
    tx: the optax optimizer of every stage (its state is per stage).
    method: one of ``PIPELINE_METHODS`` (see the table above); ``"petra"``
      is paper Eq. 5.
    devices: devices to spread the stages over in contiguous blocks (default:
      all local devices). Fewer devices than stages is fine.
    bn_stats: ``"backward"`` (paper, Sec. 4: running statistics updated by the
      backward recomputation/reconstruction, never by the forward) or
      ``"forward"`` (the authors' code: updated by the forward).
    record_timeline: keep ``(tick, stage, "F"|"B", micro_batch)`` events in
      ``self.timeline`` (paper Fig. 1).
    probe_every: if > 0, every micro-batch whose index is a multiple of it
      has the reconstruction error ``||x~ - x|| / ||x||`` of each reversible
      stage measured (its true input is copied at the forward) and appended to
      ``state.reconstruction_errors``. Costs one copy of the input and one
      small reduction per probed micro-batch and stage; nothing when 0.
    grad_probe_every: if > 0, every micro-batch whose index is a multiple of
      it has its gradient quality measured (paper App. B, Figs. 5 and 6; see
      :mod:`petra_jax.diagnostics`): each stage copies the weights its
      forward used and those it holds at its backward, and its backward runs
      a second jitted variant that also returns the applied gradient; when the
      backward reaches stage 0, the delayed and end-to-end gradients (two
      ``jax.grad`` of the composed model on stage 0's device) are compared
      with it and ``(micro_batch, {name: float32[J]})`` is appended to
      ``state.grad_quality``. Cost per probed micro-batch: two forward and
      backward passes of the whole model, about two ticks of a full pipeline
      (measured: 1.8 s, 2.2 ticks of 0.83 s, RevNet18 width 8, micro-batch
      128 of 32x32, all stages on one 2-core CPU); one more compilation per
      stage and one of the comparison at the first probe; and, while the
      micro-batch is in flight (``2(J-1)`` ticks), three copies of the
      parameters (forward weights, backward weights, gradients: 3 x 0.7 MB
      for that model, 3 x 4 bytes per parameter in general) plus the
      micro-batch. When 0, nothing is compiled, copied or run. Needs every
      stage's device in this process.

  Raises:
    ValueError: fewer than 2 stages, a reversible first or last stage, an
      unknown ``bn_stats`` policy or method, or a reconstructing method on a
      model without reversible stages.
  """

  def __init__(self, stages: Sequence[Stage], tx: optax.GradientTransformation,
               devices: Optional[Sequence[jax.Device]] = None, *,
               method: str = "petra", bn_stats: str = "backward", record_timeline: bool = False,
               probe_every: int = 0, grad_probe_every: int = 0):
    if len(stages) < 2:
      raise ValueError(f"PETRA needs at least 2 stages, got {len(stages)}.")
    if stages[0].reversible or stages[-1].reversible:
      raise ValueError("the first stage (input) and the last (loss) cannot be reversible.")
    if bn_stats not in BN_POLICIES:
      raise ValueError(f"Unknown bn_stats policy {bn_stats!r}; choose one of {BN_POLICIES}.")
    if method not in PIPELINE_METHODS:
      raise ValueError(f"Unknown pipeline method {method!r}; choose one of {PIPELINE_METHODS}.")
    if method in ("petra", "approximate_input") and not any(
        b.reversible for s in stages for b in (s.blocks or (s,))):
      raise ValueError(f"method {method!r} reconstructs inputs and needs reversible stages; "
                       "this model has none: use 'dsp' or 'delayed'.")
    self.method = method
    self.stash_inputs = method in ("dsp", "delayed")
    self.stash_params = method in ("delayed", "approximate_input")
    self.stages = list(stages)
    self.num_stages = len(stages)
    self.tx = tx
    self.devices = assign_devices(self.num_stages, devices or jax.local_devices())
    # Multi-process (jax.distributed): this process runs only the stages on
    # its own devices; messages to or from the others go through transport.
    self.local = [transport.is_local(d) for d in self.devices]
    self.multiprocess = not all(self.local)
    self._spec_cache: dict = {}
    self._specs = [None] * (self.num_stages + 1)  # message shapes; set by init()
    self.stats_in_forward = bn_stats == "forward"
    # Stage j rebuilds its input from its output (otherwise it pops a buffer).
    self.reconstructs = [s.reversible and not self.stash_inputs for s in stages]
    self.record_timeline = record_timeline
    self.probe_every = probe_every
    self._relative_error = jax.jit(relative_error)
    self._copy = jax.jit(lambda x: jax.tree.map(jnp.copy, x))
    self.timeline: list[tuple[int, int, str, int]] = []

    take = not self.stats_in_forward
    self._forward = [jax.jit(functools.partial(forward_step, s)) for s in stages]
    self._eval = [jax.jit(functools.partial(eval_step, s)) for s in stages]
    self._backward, self._backward_probed = [], []
    for j, s in enumerate(stages):
      if j == self.num_stages - 1:
        step, donate = functools.partial(loss_step, s), 0
      elif self.reconstructs[j]:
        step, donate = functools.partial(reverse_backward_step, s, take), (0, 1, 2)
      else:
        step, donate = functools.partial(recompute_backward_step, s, take, j > 0), 0
      self._backward.append(jax.jit(step, donate_argnums=donate))
      if grad_probe_every:  # the same step, also returning the applied gradient
        self._backward_probed.append(
            jax.jit(functools.partial(step, return_grads=True), donate_argnums=donate))
    self._backprop = jax.jit(functools.partial(backprop_step, self.stages), donate_argnums=0)
    self.grad_probe_every = grad_probe_every
    if grad_probe_every:
      if any(d.process_index != jax.process_index() for d in self.devices):
        raise ValueError("grad_probe_every needs every stage's device in this process "
                         "(it composes all stages on one device).")
      self._grad_quality = jax.jit(functools.partial(diagnostics.grad_quality, self.stages))

  # -- set-up ----------------------------------------------------------------

  def init(self, seed: int, sample_input: jax.Array) -> PipelineState:
    """Initialises every stage on its device.

    All stages are initialised by one jitted function, with the ``"rbg"``
    PRNG: on CPU its compilation takes about 4 s for RevNet18 against 12 s
    with threefry (and 20 s for one jit per stage). In a multi-process run
    only this process's stages are initialised (the same values as in one
    process); the others' entries of ``PipelineState.stages`` are None.

    Args:
      seed: integer seed; stage ``j`` draws from ``fold_in(key(seed), j)``.
      sample_input: a model input ``float32[B, H, W, C]`` (only its shape and
        dtype matter).
    """
    def init_all(key):
      states = []
      # Parameters do not depend on the batch: initialise on one example.
      x = jax.ShapeDtypeStruct((1,) + sample_input.shape[1:], sample_input.dtype)
      for j, stage in enumerate(self.stages):
        zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), x)
        if not self.local[j]:  # another process's stage: its shapes only
          variables = jax.eval_shape(stage.init, jax.random.fold_in(key, j), zeros)
          states.append(None)
        else:
          variables = stage.init(jax.random.fold_in(key, j), zeros)
          states.append(StageState.create(apply_fn=None, params=variables["params"], tx=self.tx,
                                          batch_stats=variables["batch_stats"]))
        x = jax.eval_shape(functools.partial(forward, stage), variables["params"],
                           variables["batch_stats"], x)[0]
      return states

    states = jax.jit(init_all)(jax.random.key(seed, impl="rbg"))
    states = [transport.send(s, d) if s is not None else None
              for s, d in zip(states, self.devices)]
    if self.multiprocess:
      self._specs = self._specs_for(sample_input)
    J = self.num_stages
    return PipelineState(stages=states, fwd_inbox=[None] * J, bwd_inbox=[None] * J,
                         buffers=[collections.deque() for _ in range(J)],
                         weight_stash=[collections.deque() for _ in range(J)])

  # -- PETRA -----------------------------------------------------------------

  def tick(self, state: PipelineState, images: Optional[jax.Array] = None,
           labels: Optional[jax.Array] = None) -> tuple[PipelineState, Optional[TickOutput]]:
    """Runs one tick of every stage (paper Alg. 1, Eq. 5).

    Args:
      state: the pipeline state; updated in place and returned.
      images: a new micro-batch ``float32[B, H, W, C]`` for stage 0, or None
        to feed nothing (pipeline drain). Multi-process: None on processes
        that do not own stage 0 (they pass ``labels`` to feed).
      labels: its labels ``int32[B]`` (sent straight to the last stage);
        only read by the process owning the last stage.

    Returns:
      ``(state, output)``: ``output`` is the loss of the micro-batch that
      reached the last stage on this tick, or None during the fill.
      Multi-process: the loss is on stage 0's device, on process 0 only;
      ``output.loss`` is None on the other processes.
    """
    J = self.num_stages
    if images is not None or (self.multiprocess and labels is not None):
      m = state.next_micro_batch
      # Every process keeps every message (the schedule); only the stage's
      # owner holds its payload.
      state.fwd_inbox[0] = Message(
          m, transport.send(images, self.devices[0]) if self.local[0] else None)
      if self.local[-1]:
        state.labels.append(Message(m, transport.send(labels, self.devices[-1])))
      state.next_micro_batch += 1
      if self.grad_probe_every and m % self.grad_probe_every == 0:
        state.grad_probes[m] = diagnostics.GradProbe(
            state.fwd_inbox[0].payload, state.labels[-1].payload, [None] * J, [None] * J,
            [None] * J)
    fwd_next, bwd_next = [None] * J, [None] * J
    output = None
    for j, stage in enumerate(self.stages):
      st = state.stages[j]
      fin, bin_ = state.fwd_inbox[j], state.bwd_inbox[j]
      if not self.local[j]:  # another process runs it: only relay its messages
        out = self._remote_stage(j, fin, bin_, fwd_next, bwd_next)
        output = out or output
        continue
      if j == J - 1:
        if fin is not None:
          lab = state.labels.popleft()
          assert lab.micro_batch == fin.micro_batch, (lab.micro_batch, fin.micro_batch)
          st, dx, loss = self._run_backward(state, j, fin.micro_batch, st, fin.payload,
                                            lab.payload)
          bwd_next[j - 1] = self._send_back(j, fin.micro_batch, fin.payload, dx)
          if self.multiprocess:  # metrics are written by process 0
            loss = self._move(loss, J - 1, 0, _LOSS_SPEC)
          output = TickOutput(fin.micro_batch, loss)
          self._record(state.tick, j, "F", fin.micro_batch)
          self._record(state.tick, j, "B", fin.micro_batch)
        state.stages[j] = st
        continue
      if fin is not None:  # forward with theta^t
        y, stats = self._forward[j](st, fin.payload)
        if self.stats_in_forward:
          st = st.replace(batch_stats=stats)
        if self.stash_params:  # copied: the backward donates the live ones
          state.weight_stash[j].append(Message(fin.micro_batch, self._copy(st.params)))
        if not self.reconstructs[j]:
          state.buffers[j].append(fin)
        elif self.probe_every and fin.micro_batch % self.probe_every == 0:
          state.probes[(j, fin.micro_batch)] = self._copy(fin.payload)  # later donated
        if fin.micro_batch in state.grad_probes:  # the weights this forward used
          state.grad_probes[fin.micro_batch].forward_params[j] = self._copy(st.params)
        fwd_next[j + 1] = Message(fin.micro_batch, self._move(y, j, j + 1, self._specs[j + 1]))
        self._record(state.tick, j, "F", fin.micro_batch)
      if bin_ is not None:  # reverse-backward with theta^t, then the update
        y, dy = bin_.payload
        stashed = None
        if self.stash_params:
          msg = state.weight_stash[j].popleft()
          assert msg.micro_batch == bin_.micro_batch, (msg.micro_batch, bin_.micro_batch)
          stashed = msg.payload
        if self.reconstructs[j]:
          st, x, dx = self._run_backward(state, j, bin_.micro_batch, st, y, dy, stashed)
          probe = state.probes.pop((j, bin_.micro_batch), None)
          if probe is not None:
            state.reconstruction_errors.append(
                (bin_.micro_batch, j, self._relative_error(x, probe)))
        else:
          buffered = state.buffers[j].popleft()
          assert buffered.micro_batch == bin_.micro_batch, (buffered.micro_batch, bin_.micro_batch)
          x = buffered.payload
          st, dx = self._run_backward(state, j, bin_.micro_batch, st, x, dy, stashed)
        if j > 0:
          bwd_next[j - 1] = self._send_back(j, bin_.micro_batch, x, dx)
        self._record(state.tick, j, "B", bin_.micro_batch)
      state.stages[j] = st
    state.fwd_inbox, state.bwd_inbox = fwd_next, bwd_next
    state.tick += 1
    return state, output

  def drain(self, state: PipelineState) -> tuple[PipelineState, list[TickOutput]]:
    """Runs ticks without new input until no micro-batch is in flight."""
    outputs = []
    for _ in range(schedule.drain_ticks(self.num_stages)):
      if not state.in_flight():
        break
      state, out = self.tick(state)
      if out is not None:
        outputs.append(out)
    return state, outputs

  def revprop_step(self, state: PipelineState, images, labels):
    """One micro-batch with every delay forced to 0.

    The same stage steps as :meth:`tick`, with the pipeline drained after the
    micro-batch: for ``method="petra"`` this is synchronous reversible
    backprop (``revprop``); for every method the gradients are exact.
    Returns ``(state, loss)``.

    Raises:
      RuntimeError: if micro-batches are already in flight.
    """
    if state.in_flight():
      raise RuntimeError("revprop_step needs an empty pipeline; call drain() first.")
    state, out = self.tick(state, images, labels)
    state, outs = self.drain(state)
    return state, (out or outs[0]).loss

  def backprop_step(self, state: PipelineState, images, labels):
    """Exact backprop of one micro-batch; needs every stage on one device.

    Returns ``(state, loss)``.

    Raises:
      ValueError: if the stages are on more than one device.
    """
    if len(set(self.devices)) > 1:
      raise ValueError("backprop runs on one device: build the Pipeline with devices=[d].")
    images = transport.send(images, self.devices[0])
    labels = transport.send(labels, self.devices[0])
    state.stages, loss = self._backprop(state.stages, images, labels)
    return state, loss

  # -- evaluation ------------------------------------------------------------

  def predict(self, state: PipelineState, images) -> Optional[jax.Array]:
    """Logits ``float32[B, K]`` with the current weights and running statistics.

    Args:
      images: ``float32[B, H, W, C]``. Multi-process: on processes that do
        not own stage 0, anything with its shape and dtype (e.g. a
        ``jax.ShapeDtypeStruct``); every process must call ``predict``.

    Returns:
      The logits on the last stage's device; None on processes that do not
      own the last stage.
    """
    J = self.num_stages
    specs = self._specs_for(images) if self.multiprocess else [None] * (J + 1)
    x = transport.send(images, self.devices[0]) if self.local[0] else None
    for j in range(J):
      if j > 0:
        x = self._move(x, j - 1, j, specs[j])
      if self.local[j]:
        x = self._eval[j](state.stages[j], x)
    return x if self.local[-1] else None

  # -- helpers ---------------------------------------------------------------

  def _send_back(self, j: int, micro_batch: int, x, dx) -> Message:
    """``(x~_{j-1}, delta_j)`` to stage ``j-1``; ``x~`` only if it is reversible."""
    x = x if self.reconstructs[j - 1] else None
    spec = (self._specs[j] if self.reconstructs[j - 1] else None, self._specs[j])
    return Message(micro_batch, self._move((x, dx), j, j - 1, spec))

  def _move(self, x, src: int, dst: int, spec):
    """Payload ``x`` from stage ``src``'s device to stage ``dst``'s.

    Within this process ``transport.send``; across processes
    ``transport.transfer`` (``spec``: ``x``'s shapes, for the receiver).
    Returns the payload on ``dst``'s device, or None if ``dst`` is another
    process's (or neither stage is this process's: nothing is run).
    """
    if self.local[src] and self.local[dst]:
      return transport.send(x, self.devices[dst])
    if not (self.local[src] or self.local[dst]):
      return None
    x = transport.transfer(x, self.devices[src], self.devices[dst], spec)
    return x if self.local[dst] else None

  def _remote_stage(self, j: int, fin, bin_, fwd_next: list, bwd_next: list):
    """Stage ``j`` of another process on this tick: receives what it sends
    to this process's stages; placeholders (payload None) for the rest, so
    that every process follows the same schedule. Returns the last stage's
    ``TickOutput`` (its loss received on process 0, else None) or None."""
    J = self.num_stages
    if fin is not None and j < J - 1:
      fwd_next[j + 1] = Message(fin.micro_batch,
                                self._move(None, j, j + 1, self._specs[j + 1]))
    back = fin if j == J - 1 else bin_
    if back is not None and j > 0:
      bwd_next[j - 1] = self._send_back(j, back.micro_batch, None, None)
    if j == J - 1 and fin is not None:
      return TickOutput(fin.micro_batch, self._move(None, J - 1, 0, _LOSS_SPEC))
    return None

  def _specs_for(self, x) -> list:
    """Shapes of the messages for a stage-0 input shaped like ``x``.

    Returns ``J + 1`` pytrees of ``jax.ShapeDtypeStruct``: the input of each
    stage (also the shape of its input cotangent), then the logits.
    """
    key = (tuple(x.shape), jnp.dtype(x.dtype))
    if key not in self._spec_cache:
      spec = jax.ShapeDtypeStruct(x.shape, x.dtype)
      specs, rng = [spec], jax.random.key(0, impl="rbg")
      for stage in self.stages:
        variables = jax.eval_shape(stage.init, rng, spec)
        spec = jax.eval_shape(functools.partial(forward, stage), variables["params"],
                              variables["batch_stats"], spec)[0]
        specs.append(spec)
      self._spec_cache[key] = specs
    return self._spec_cache[key]

  def _run_backward(self, state: PipelineState, j: int, micro_batch: int, st, *args):
    """``self._backward[j](st, *args)``; for a micro-batch under a gradient
    probe, the variant that also returns the applied gradient, kept with a
    copy of the weights it was taken with (the live ones are donated)."""
    probe = state.grad_probes.get(micro_batch)
    if probe is None:
      return self._backward[j](st, *args)
    probe.backward_params[j] = self._copy(st.params)
    if j == self.num_stages - 1:  # its forward is this same step
      probe.forward_params[j] = probe.backward_params[j]
    *out, probe.grads[j] = self._backward_probed[j](st, *args)
    if j == 0:  # every stage is done: compare (paper App. B)
      del state.grad_probes[micro_batch]
      stats = [out[0].batch_stats] + [s.batch_stats for s in state.stages[1:]]
      args = transport.send((probe.grads, probe.forward_params, probe.backward_params, stats,
                             probe.images, probe.labels), self.devices[0])
      state.grad_quality.append((micro_batch, self._grad_quality(*args)))
    return tuple(out)

  def _record(self, tick: int, j: int, kind: str, micro_batch: int):
    if self.record_timeline:
      self.timeline.append((tick, j, kind, micro_batch))
