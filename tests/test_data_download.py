"""Tests for preparing a missing data set with tfds' real builders.

Only the network is faked (requests' transport adapter, under tfds'
downloader): tfds' real builder of each data set runs, with its imports, its
download manager, extraction and example generation, so a module the builder
needs and ``pip install -e .`` does not install fails here.
"""

import socket

import numpy as np
import pytest

from petra_jax import data


class FakeNetwork:
  """Stands in for the network (name lookups and ``requests``' transport):
  serves ``payload`` for every URL; without one, fails the name lookup (no
  DNS) or, with ``dns=True``, the request (``requests``' own error). Records
  the hosts looked up and the URLs requested."""

  def __init__(self, payload=None, dns=False):
    self.payload, self.dns, self.urls, self.hosts = payload, dns, [], []

  def getaddrinfo(self, host, *args, **kwargs):
    self.hosts.append(host)
    if self.payload is None and not self.dns:
      raise socket.gaierror(-2, "Name or service not known")
    return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", 443))]

  def send(self, adapter, request, **kwargs):
    import io

    import requests

    self.urls.append(request.url)
    if self.payload is None:
      raise requests.exceptions.ConnectionError(
          f"HTTPSConnectionPool(host={request.url.split('/')[2]!r}, port=443): Max "
          "retries exceeded (Caused by NameResolutionError: Failed to resolve)")
    response = requests.Response()
    response.status_code, response.url, response.request = 200, request.url, request
    response.raw = io.BytesIO(self.payload)
    return response


def fake_network(monkeypatch, payload=None, dns=False):
  """Installs a ``FakeNetwork``. With a payload, tfds' check of the archive's
  registered sha256 is skipped (a fake archive cannot match it)."""
  import requests
  from tensorflow_datasets.core.download import download_manager

  net = FakeNetwork(payload, dns)
  monkeypatch.setattr(requests.adapters.HTTPAdapter, "send",
                      lambda adapter, request, **kw: net.send(adapter, request, **kw))
  monkeypatch.setattr(socket, "getaddrinfo", net.getaddrinfo)
  if payload is not None:
    def record_only(self, url, url_info, path):
      self._recorded_url_infos[url] = url_info
    monkeypatch.setattr(download_manager.DownloadManager,
                        "_register_or_validate_checksums", record_only)
  return net


def _tar(files, mode="w:gz"):
  import io
  import tarfile

  buf = io.BytesIO()
  with tarfile.open(fileobj=buf, mode=mode) as tar:
    for name, content in files.items():
      member = tarfile.TarInfo(name)
      member.size = len(content)
      tar.addfile(member, io.BytesIO(content))
  return buf.getvalue()


def _cifar_archive(name, rng):
  """A CIFAR binary archive (the layout tfds' builder reads) of 2 examples per
  file, and its examples as sorted ``(split, label, HWC image bytes)``."""
  if name == "cifar10":
    prefix, files = "cifar-10-batches-bin/", [f"data_batch_{i}.bin" for i in range(1, 6)]
    files, labels = files + ["test_batch.bin"], {"batches.meta.txt": 10}
  else:
    prefix, files = "cifar-100-binary/", ["train.bin", "test.bin"]
    labels = {"coarse_label_names.txt": 20, "fine_label_names.txt": 100}
  content = {prefix + f: "\n".join(f"class{i}" for i in range(n)).encode()
             for f, n in labels.items()}
  examples = []
  for f in files:
    chw = rng.integers(0, 256, (2, 3, 32, 32), np.uint8)
    fine = rng.integers(0, 10, 2)
    heads = [bytes([7, int(y)]) if name == "cifar100" else bytes([int(y)]) for y in fine]
    content[prefix + f] = b"".join(h + x.tobytes() for h, x in zip(heads, chw))
    split = "test" if "test" in f else "train"
    examples += [(split, int(y), x.transpose(1, 2, 0).tobytes()) for y, x in zip(fine, chw)]
  return _tar(content), sorted(examples)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_is_downloaded_and_prepared_on_first_use(name, tmp_path, monkeypatch, capsys):
  payload, want = _cifar_archive(name, np.random.default_rng(0))
  net = fake_network(monkeypatch, payload)
  fresh = str(tmp_path / "fresh")
  info = data.get_dataset_info(name)
  train = data.open_split(name, "train", data_dir=fresh)  # download=None: auto
  assert len(net.urls) == 1 and "cs.toronto.edu" in net.urls[0]
  line, = [l for l in capsys.readouterr().out.splitlines() if "tfds downloads it" in l]
  assert repr(fresh) in line and repr(f"{fresh}/downloads") in line
  test = data.open_split(name, "test", data_dir=fresh)
  got = sorted((s, int(y), x.tobytes()) for s, split in (("train", train), ("test", test))
               for y, x in zip(split.labels, split.images))
  assert got == want and train.images.shape == (10 if name == "cifar10" else 2,) + info.image_shape
  # Prepared now: opened again without the network.
  assert data.ensure_prepared(name, fresh) == fresh and len(net.urls) == 1


def test_imagenet32_downloads_when_asked_only(tmp_path, monkeypatch):
  import io
  import zipfile

  rng = np.random.default_rng(1)
  flat = rng.integers(0, 256, (3, 3 * 32 * 32), np.uint8)
  npz, archive = io.BytesIO(), io.BytesIO()
  np.savez(npz, data=flat, labels=np.array([1, 5, 1000]))  # 1-based labels
  with zipfile.ZipFile(archive, "w") as z:
    z.writestr("val_data.npz", npz.getvalue())
  net = fake_network(monkeypatch, archive.getvalue())
  fresh = str(tmp_path / "fresh")
  with pytest.raises(data.DataError) as e:
    data.open_split("imagenet32", "validation", data_dir=fresh)  # auto: not this one
  for part in ("'imagenet32'", repr(fresh), "--config.data_dir", "TFDS_DATA_DIR",
               "--config.download=True", "GB"):
    assert part in str(e.value), (part, str(e.value))
  assert net.urls == [] and net.hosts == []
  val = data.open_split("imagenet32", "validation", data_dir=fresh, download=True)
  assert len(net.urls) == 2 and all("image-net.org" in u for u in net.urls)
  want = sorted(zip([0, 4, 999], (x.reshape(3, 32, 32).transpose(1, 2, 0).tobytes()
                                  for x in flat)))
  assert sorted(zip(val.labels.tolist(), (x.tobytes() for x in val.images))) == want


@pytest.mark.parametrize("name, dns", [("cifar10", False), ("cifar100", False),
                                       ("imagenet32", False), ("cifar10", True)])
def test_download_without_network_names_both_fixes(name, dns, tmp_path, monkeypatch):
  net = fake_network(monkeypatch, dns=dns)
  fresh = str(tmp_path / "fresh")
  info = data.get_dataset_info(name)
  for open_fn in (data.open_split, data.open_labels):
    with pytest.raises(data.DataError) as e:
      open_fn(name, info.train_split, data_dir=fresh, download=True)
    msg = str(e.value)
    assert "\n" not in msg
    for part in (repr(name), repr(fresh), "no network access", "ConnectionError",
                 "--config.data_dir", "TFDS_DATA_DIR", "connect to the network",
                 "Failed to resolve" if dns else "cannot resolve 'www."):
      assert part in msg, (part, msg)
  assert net.hosts and bool(net.urls) == dns  # no DNS: fails before any request


def _imagenet_manual_archives(manual_dir, rng):
  """ImageNet's two archives in tfds' layout (a tar of per-class tars; a tar of
  validation JPEGs), one 40 x 50 image each; returns their labels."""
  import io

  from PIL import Image

  def jpeg():
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (40, 50, 3), np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()

  manual_dir.mkdir(parents=True)
  train = _tar({"n01443537.tar": _tar({"n01443537_1.JPEG": jpeg()}, "w")}, "w")
  (manual_dir / "ILSVRC2012_img_train.tar").write_bytes(train)
  (manual_dir / "ILSVRC2012_img_val.tar").write_bytes(
      _tar({"ILSVRC2012_val_00000001.JPEG": jpeg()}, "w"))
  return 1, 65  # n01443537 is class 1; the first validation image is class 65


def test_imagenet_never_downloads(tmp_path, monkeypatch):
  net = fake_network(monkeypatch)
  fresh = tmp_path / "fresh"
  manual = fresh / "downloads" / "manual"
  for download in (None, True, False):
    with pytest.raises(data.DataError) as e:
      data.open_split("imagenet", "train", data_dir=str(fresh), download=download)
    msg = str(e.value)
    for part in ("'imagenet'", repr(str(fresh)), "--config.data_dir", "TFDS_DATA_DIR"):
      assert part in msg, (part, msg)
    if download is not False:
      for part in ("ILSVRC2012_img_train.tar", "ILSVRC2012_img_val.tar", repr(str(manual)),
                   "--config.download=True"):
        assert part in msg, (part, msg)
  # Its archives put there by hand: download=True prepares them (tfds' builder).
  train_label, val_label = _imagenet_manual_archives(manual, np.random.default_rng(2))
  train = data.open_split("imagenet", "train", data_dir=str(fresh), download=True)
  val = data.open_split("imagenet", "validation", data_dir=str(fresh))
  assert isinstance(train, data.LazySplit) and len(train) == len(val) == 1
  assert data.read_labels(train, [0]).tolist() == [train_label]
  assert data.read_labels(val, [0]).tolist() == [val_label]
  assert net.urls == [] and net.hosts == []


def test_no_download_when_told_not_to(cifar10_dir, tmp_path, monkeypatch):
  net = fake_network(monkeypatch)
  fresh = str(tmp_path / "fresh")
  for open_fn in (data.open_split, data.open_labels, data.load_split):
    with pytest.raises(data.DataError) as e:
      open_fn("cifar10", "test", data_dir=fresh, download=False)
    for part in ("'cifar10'", repr(fresh), "--config.data_dir", "TFDS_DATA_DIR",
                 "--config.download=True"):
      assert part in str(e.value), (part, str(e.value))
  with pytest.raises(data.DataError, match="True, False or None"):
    data.ensure_prepared("cifar10", fresh, download="yes")
  # A prepared data set is used as it is, whatever download says.
  for download in (None, True, False):
    assert data.ensure_prepared("cifar10", cifar10_dir, download=download) == cifar10_dir
  labels = data.open_labels("cifar10", "test", data_dir=cifar10_dir, limit=10, download=True)
  assert len(labels) == 10
  assert net.urls == [] and net.hosts == []
