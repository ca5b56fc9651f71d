"""Schedule tables against their closed forms and their invariants."""

import collections

import pytest

from petra_jax.benchmarks import simulate
from petra_jax.benchmarks.memory import model as memory_model
from petra_jax.engine import compiled
from petra_jax.engine import schedules as schedule
from petra_jax.engine.schedules import Schedule, TaskKind


def _when(table):
  """``{(stage, kind, micro_batch): tick}``; fails on a task that runs twice."""
  when = {}
  for t, tick in enumerate(table):
    for task in tick:
      assert task not in when, task
      when[task] = t
  return when


@pytest.mark.parametrize("J", [2, 3, 10])
@pytest.mark.parametrize("k", [1, 4])
def test_stream_table_is_the_closed_form(J, k):
  """Forward of m at stage j on tick m + j, backward on m + 2(J-1) - j."""
  M = 5 * k
  table = Schedule("stream", J, M, k)
  when = _when(table)
  assert len(when) == (2 * (J - 1) + 1) * M  # every (stage, micro-batch) once
  for m in range(M):
    for j in range(J - 1):
      assert when[(j, TaskKind.FORWARD, m)] == m + j
      assert when[(j, TaskKind.BACKWARD, m)] == m + 2 * (J - 1) - j
    assert when[(J - 1, TaskKind.LOSS, m)] == m + J - 1
  # Fill and drain: 2(J-1) ticks each; M + 2(J-1) ticks in all.
  assert len(table) == M + 2 * (J - 1)
  full = [t for t, tick in enumerate(table) if len(tick) == 2 * (J - 1) + 1]
  if M > 2 * (J - 1):
    assert full[0] == 2 * (J - 1) and full[-1] == M - 1
  assert table[len(table) - 1] == ((0, TaskKind.BACKWARD, M - 1),)


@pytest.mark.parametrize("J", [2, 3, 10])
def test_drained_table_is_one_micro_batch_at_a_time(J):
  table = Schedule("drained", J, 3)
  assert len(table) == 3 * (2 * J - 1)
  when = _when(table)
  for m in range(3):
    start = m * (2 * J - 1)
    for j in range(J - 1):
      assert when[(j, TaskKind.FORWARD, m)] - start == j
      assert when[(j, TaskKind.BACKWARD, m)] - start == 2 * (J - 1) - j


def _dependency(task, J):
  j, kind, m = task
  if kind == TaskKind.FORWARD:
    return (j - 1, TaskKind.FORWARD, m) if j else None
  if kind == TaskKind.LOSS:
    return (J - 2, TaskKind.FORWARD, m)
  return (J - 1, TaskKind.LOSS, m) if j == J - 2 else (j + 1, TaskKind.BACKWARD, m)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "stream", "drained"])
@pytest.mark.parametrize("J, k", [(2, 1), (3, 4), (4, 8), (10, 4)])
def test_every_task_consumes_a_message_from_an_earlier_tick(kind, J, k):
  table = Schedule(kind, J, 2 * k, k)
  when = _when(table)
  assert len(when) == (2 * (J - 1) + 1) * 2 * k
  for task, t in when.items():
    dep = _dependency(task, J)
    assert dep is None or when[dep] < t, (task, dep)


@pytest.mark.parametrize("J, k", [(3, 4), (4, 8), (10, 4), (5, 2)])
def test_flushed_schedules(J, k):
  """GPipe runs every forward of an update before any backward and holds k
  inputs per stage; 1F1B holds at most J - j; both finish an update before
  the next one starts and run one task per stage and tick."""
  for kind in ("gpipe", "1f1b"):
    table = Schedule(kind, J, 2 * k, k)
    for tick in table:
      stages = [task.stage for task in tick]
      assert len(stages) == len(set(stages)), (kind, tick)
    when = _when(table)
    first_update_end = max(t for (j, _, m), t in when.items() if m < k)
    assert all(t > first_update_end for (j, _, m), t in when.items() if m >= k)
    peak = memory_model.peak_held(table)
    if kind == "gpipe":
      assert peak[:-1] == [k] * (J - 1)
      last_f = max(t for (j, kd, m), t in when.items() if kd == TaskKind.FORWARD and m < k)
      first_b = min(t for (j, kd, m), t in when.items() if kd == TaskKind.BACKWARD and m < k)
      assert last_f < first_b
    else:
      assert peak[:-1] == [min(J - j, k) for j in range(J - 1)]
    assert peak[-1] == 0


def test_held_is_tau_at_steady_state():
  J = 5
  table = Schedule("stream", J, 40)
  assert memory_model.held(table)[20] == [schedule.delay(j, J) for j in range(J)]


def test_simulated_time_by_hand():
  """J = 2, costs F0 = 1, B0 = 2, loss L1 = 3; stage 0 sends forward in 0.5,
  stage 1 back in 0.5, busy while sending.

  One micro-batch: F0 [0, 1] + send to 1.5, L1 [1.5, 4.5] + send to 5,
  B0 [5, 7]: 7 ms. Two: F0(0) [0, 1.5], F0(1) [1.5, 3], L1(0) [1.5, 5],
  L1(1) [5, 8.5], B0(0) [5, 7], B0(1) [8.5, 10.5]; compute 6 + 6.
  """
  one = simulate.simulate(Schedule("stream", 2, 1), [1, 0], [2, 3], [0.5, 0], [0, 0.5])
  assert one["makespan_ms"] == 7.0 and one["busy_ms"] == [3.0, 3.0]
  two = simulate.simulate(Schedule("stream", 2, 2), [1, 0], [2, 3], [0.5, 0], [0, 0.5])
  assert two["makespan_ms"] == 10.5 and two["busy_ms"] == [6.0, 6.0]


def test_stream_steady_state_is_the_slowest_stage_with_its_sends():
  """PETRA's tick on one device per stage: max_j (F_j + B_j + T_j)."""
  F, B = [1.0, 2.0, 1.0, 0.0], [1.0, 3.0, 2.0, 4.0]
  fs, bs = [0.5, 0.25, 0.1, 0.0], [0.0, 0.5, 0.3, 0.2]
  r = simulate.ms_per_update("stream", 4, 1, F, B, fs, bs)
  assert r["simulated_ms_per_update"] == pytest.approx(2 + 3 + 0.25 + 0.5)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("J, k, ms", [(2, 2, 6.0), (3, 1, 6.0)])
def test_bubble_of_flushed_schedules_by_hand(kind, J, k, ms):
  """F = B = 1 per stage, the last stage's loss task F + B = 2.

  J = 2, k = 2: F0(0) [0,1], F0(1) [1,2], L(0) [1,3], B0(0) [3,4], L(1)
  [3,5], B0(1) [5,6]. J = 3, k = 1: F0 [0,1], F1 [1,2], L [2,4], B1 [4,5],
  B0 [5,6]. Both 6 ms per update; stage 0 ends last, so updates do not
  overlap; the bubble is the textbook (J-1)/(k+J-1) (Huang et al., 2019).
  """
  r = simulate.ms_per_update(kind, J, k, [1.0] * J, [1.0] * (J - 1) + [2.0])
  assert r["simulated_ms_per_update"] == pytest.approx(ms)
  assert r["bubble_fraction"] == pytest.approx((J - 1) / (k + J - 1))


def test_stream_has_no_bubble_with_equal_costs():
  J, k = 4, 8
  stream = simulate.ms_per_update("stream", J, k, [1.0] * J, [1.0] * (J - 1) + [2.0])
  assert stream["bubble_fraction"] < 1e-9  # every stage busy all the time
  assert stream["simulated_ms_per_update"] == pytest.approx(2.0 * k)


def test_bad_schedules_raise():
  with pytest.raises(ValueError, match="Unknown schedule"):
    Schedule("zigzag", 3, 4)
  with pytest.raises(ValueError, match="at least 2 stages"):
    Schedule("stream", 1, 4)
  with pytest.raises(ValueError, match="do not split into updates of k=4"):
    Schedule("gpipe", 3, 6, 4)
  assert collections.Counter(len(t) for t in Schedule("sequential", 1, 3)) == {1: 3}


def test_chained_schedules_drain_between_parts():
  # One part at offset 0 is the schedule itself; two parts run the second
  # part's micro-batches (shifted) only after the first part has drained.
  one = schedule.Schedule("stream", 4, 6, 2)
  assert list(schedule.Chained((one,), (0,))) == list(one)
  two = schedule.Chained((one, schedule.Schedule("stream", 4, 4, 2)), (0, 6))
  assert len(two) == len(one) + 4 + schedule.drain_ticks(4) == two.ends()[-1]
  first = [t.micro_batch for tick in list(two)[:two.ends()[0]] for t in tick]
  rest = [t.micro_batch for tick in list(two)[two.ends()[0]:] for t in tick]
  assert set(first) == set(range(6)) and set(rest) == set(range(6, 10))
  assert schedule.fed(two[two.ends()[0]]) == 6


def test_task_kinds_are_an_enum_equal_to_their_old_strings():
  assert schedule.TaskKind.FORWARD == "forward" and schedule.Task(0, "loss", 1).kind is schedule.TaskKind.LOSS
  assert {schedule.TaskKind.BACKWARD: 1}["backward"] == 1
  with pytest.raises(ValueError, match="forwrd"):
    schedule.Task(0, "forwrd", 0)


def _unit(name, J, k):
  """The repeating ticks read off the table itself: a round's ticks (the table over one
  round's micro-batches), or a stream's tick 2(J-1) of a table just long enough to hold it."""
  size = schedule.family(name).round_size(k)
  if size:
    return list(Schedule(name, J, size, k))
  t0 = schedule.drain_ticks(J)
  return [Schedule(name, J, t0 + 1, k)[t0]]


def _matches(tick, unit):
  """Every ``(u, s)`` with ``tick`` equal to ``unit[u]`` with its micro-batches shifted by s."""
  found = set()
  for u, ref in enumerate(unit):
    if tick and len(tick) == len(ref):
      s = tick[0].micro_batch - ref[0].micro_batch
      if tick == tuple(task._replace(micro_batch=task.micro_batch + s) for task in ref):
        found.add((u, s))
  return found


@pytest.mark.parametrize("name", sorted(schedule.TICK_TABLES))
@pytest.mark.parametrize("J, k", [(2, 1), (3, 2), (4, 3)])
def test_steady_says_what_comparing_the_ticks_finds(name, J, k):
  """``steady(t)`` (arithmetic, reads no tick) against a literal comparison of every tick with
  the repeating unit: it is one of the matches, and None exactly where nothing matches."""
  unit = _unit(name, J, k)
  # the unit the compiled executor compares with (what steady's (u, s) refers to)
  assert [tuple(tick) for tick in compiled.period_of(schedule.family(name), J, k).ticks] == unit
  for M in (k, 3 * k, 4 * k + schedule.drain_ticks(J)):
    table = Schedule(name, J, M, k)
    for t in range(len(table) + 2):
      found = table.steady(t)
      matches = _matches(table[t], unit) if t < len(table) else set()
      assert (found in matches) if found is not None else not matches, (M, t, found, matches)
  chained = schedule.Chained((Schedule(name, J, 3 * k, k), Schedule(name, J, 2 * k, k)),
                             (0, 3 * k))
  assert chained.family is schedule.family(name)
  for t in range(len(chained)):
    found = chained.steady(t)
    assert (found in _matches(chained[t], unit)) if found else not _matches(chained[t], unit)
