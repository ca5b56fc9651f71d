"""Named links between devices: a message of ``n`` bytes costs ``latency + n / bandwidth``.

Bandwidths are the links' nominal one-direction peaks; latencies are assumed
orders of magnitude (a few microseconds on a device link, tens between hosts),
named here so that a table says which it used.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Link(NamedTuple):
  """A link: ``bytes_per_s`` (B/s, one direction) and ``latency_ms`` per message (ms)."""
  bytes_per_s: float
  latency_ms: float


LINKS = {
    "nvlink4": Link(900e9, 0.002),        # NVLink 4 (H100/H200): 900 GB/s, ~2 us
    "pcie5_x16": Link(64e9, 0.005),       # PCIe 5.0 x16: 64 GB/s, ~5 us
    "ethernet_100g": Link(100e9 / 8, 0.015),  # 100 Gb/s between hosts: 12.5 GB/s, ~15 us
}


def message_ms(num_bytes: float, link: str | Link) -> float:
  """``latency_ms + 1e3 num_bytes / bytes_per_s``: ms to send one message of
  ``num_bytes`` (>= 0) over ``link`` (a name in :data:`LINKS` or a :class:`Link`).

  Raises:
    ValueError: an unknown link name, or ``num_bytes < 0``.
  """
  if num_bytes < 0:
    raise ValueError(f"num_bytes must be >= 0, got {num_bytes}.")
  if isinstance(link, str):
    if link not in LINKS:
      raise ValueError(f"Unknown link {link!r}; choose one of {tuple(LINKS)}.")
    link = LINKS[link]
  return link.latency_ms + 1e3 * num_bytes / link.bytes_per_s


def stage_send_ms(bytes_per_stage: Sequence[float], link: str | Link) -> list[float]:
  """Per stage, :func:`message_ms` of its message (0 ms for a stage sending 0 bytes:
  no message, e.g. stage 0 backward)."""
  return [message_ms(b, link) if b else 0.0 for b in bytes_per_stage]
