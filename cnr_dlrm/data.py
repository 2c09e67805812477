"""A synthetic, Criteo-shaped click stream with learnable labels, and a resumable reader for it.

Each sample has 13 dense features (log-transformed counts, as Criteo's are usually fed) and
26 categorical features, one id each, over tables whose sizes are the Criteo Kaggle
cardinalities times ``scale``. Ids follow a Zipf law over a fixed scramble of each table,
so the hot rows are spread over every row shard. Labels come from a hidden "teacher": a
fixed random embedding-plus-dense model with a logistic output, so a DLRM can learn the
task and logloss/AUC mean something.

Everything is counter-based: sample ``i`` of rank ``r`` in a split is drawn from a
generator seeded by ``(seed, split, rank, i // CHUNK)``, so it is the same whatever the
batch size, the worker count or the step a job restarted at.
"""

from __future__ import annotations

import copy
import logging
import math
import zlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torchdata.stateful_dataloader import StatefulDataLoader
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from cnr_torchrec.errors import CheckpointError, ConfigError

__all__ = [
    "CHUNK",
    "CRITEO_KAGGLE_CARDINALITIES",
    "ClickDataset",
    "DataConfig",
    "ResumableReader",
    "SyntheticCriteo",
    "make_loader",
]

log = logging.getLogger(__name__)

# Distinct values per categorical feature of the Criteo Kaggle (Display Advertising Challenge)
# training set, C1..C26, as the DLRM reference code counts them.
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)
NUM_DENSE = len(DEFAULT_INT_NAMES)  # 13
NUM_SPARSE = len(DEFAULT_CAT_NAMES)  # 26

# Samples per generator draw. Part of the stream's definition: changing it changes every sample.
CHUNK = 128
_TEACHER_DIM = 8
_SPLITS = ("train", "eval")
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class DataConfig:
    """The ``data:`` section of a job config.

    Attributes:
        scale: table sizes are the Criteo Kaggle cardinalities times this factor...
        min_rows: ...but at least this many rows.
        zipf: exponent of the id popularity law (rank k is drawn with probability ~ k^-zipf).
        batch_size: samples per rank and step (eval uses the same size).
        seed: seed of the sample streams (train and eval are separate streams of it).
        teacher_seed: seed of the task itself: id popularity, id scramble and the teacher model.
        ctr: the teacher's mean click rate; its bias is calibrated to it.
        signal: scale of the teacher's logits: larger is an easier, more deterministic task.
        num_workers: DataLoader worker processes per rank (0: batches are made in the training process).
    """

    scale: float = 0.01
    min_rows: int = 16
    zipf: float = 1.05
    batch_size: int = 512
    seed: int = 0
    teacher_seed: int = 0
    ctr: float = 0.25
    signal: float = 1.0
    num_workers: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ConfigError(f"scale: must be a positive number, got {self.scale}")
        if self.min_rows < 1:
            raise ConfigError(f"min_rows: must be at least 1, got {self.min_rows}")
        if not (math.isfinite(self.zipf) and self.zipf >= 0):
            raise ConfigError(f"zipf: must be a number >= 0 (0 is uniform), got {self.zipf}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size: must be at least 1, got {self.batch_size}")
        if not 0.0 < self.ctr < 1.0:
            raise ConfigError(f"ctr: must be in (0, 1), got {self.ctr}")
        if not (math.isfinite(self.signal) and self.signal >= 0):
            raise ConfigError(f"signal: must be a number >= 0, got {self.signal}")
        if self.num_workers < 0:
            raise ConfigError(f"num_workers: must be >= 0, got {self.num_workers}")

    def table_rows(self) -> list[int]:
        """Rows of each of the 26 tables."""
        return [max(self.min_rows, math.ceil(c * self.scale)) for c in CRITEO_KAGGLE_CARDINALITIES]


def _mix(*parts: int | str) -> int:
    """A 63-bit seed from several integers or strings (splitmix64 steps), stable across runs and platforms."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        v = zlib.crc32(p.encode()) if isinstance(p, str) else int(p)
        h = (h ^ (v & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF
        h = (h + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & _MASK63


def _coprime_multiplier(n: int, salt: int) -> int:
    """A multiplier coprime with ``n``: ``k -> (k * m + c) % n`` is then a permutation of range(n)."""
    m = (_mix(salt, n) % max(n, 2)) | 1
    while math.gcd(m, n) != 1:
        m += 2
    return m % n if n > 1 else 0


class SyntheticCriteo:
    """The task: table sizes, id distributions and the teacher. Samples come from :meth:`generate`.

    Memory: 40 bytes per table row, per process: the id CDF (float64) and the teacher embedding (8 x float32).

    Args:
        config: the ``data:`` section.
    """

    def __init__(self, config: DataConfig) -> None:
        self.config = config
        self.table_rows = config.table_rows()
        self.keys = list(DEFAULT_CAT_NAMES)
        g = torch.Generator().manual_seed(_mix(config.teacher_seed, "task"))
        self._cdfs: list[torch.Tensor] = []
        self._scramble: list[tuple[int, int]] = []
        for t, n in enumerate(self.table_rows):
            p = torch.arange(1, n + 1, dtype=torch.float64).pow(-config.zipf)
            cdf = p.cumsum(0) / p.sum()
            cdf[-1] = 1.0
            self._cdfs.append(cdf)
            self._scramble.append((_coprime_multiplier(n, _mix(config.teacher_seed, t)), _mix(t, n) % n))
        # Dense features: log1p of counts exp(N(mu, s^2)), floored; the teacher sees them standardized.
        self._mu = torch.rand(NUM_DENSE, generator=g, dtype=torch.float64) * 4.0
        self._sd = 0.5 + torch.rand(NUM_DENSE, generator=g, dtype=torch.float64)
        # Teacher: logit = bias + v . tanh(W x_dense + sum_t E_t[id_t]).
        self._offsets = torch.tensor([0] + self.table_rows[:-1], dtype=torch.int64).cumsum(0)
        # float32 storage (the rest of the teacher is float64): 32 bytes per row instead of 64.
        emb = torch.randn(sum(self.table_rows), _TEACHER_DIM, generator=g, dtype=torch.float64)
        self._emb = (emb * (1.5 / math.sqrt(NUM_SPARSE))).to(torch.float32)
        self._w_dense = torch.randn(NUM_DENSE, _TEACHER_DIM, generator=g, dtype=torch.float64) / math.sqrt(NUM_DENSE)
        self._v = torch.randn(_TEACHER_DIM, generator=g, dtype=torch.float64) * (2.5 / math.sqrt(_TEACHER_DIM))
        self._bias = 0.0
        self._bias = self._calibrate_bias(config.ctr)

    # ------------------------------------------------------------------ samples

    def generate(self, rank: int, start: int, stop: int, split: str = "train") -> tuple[Batch, torch.Tensor]:
        """Samples ``[start, stop)`` of ``rank``'s stream of ``split``, and the teacher's logits for them.

        Raises:
            ValueError: an unknown split, a negative rank or an empty/negative range.
        """
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        if rank < 0 or start < 0 or stop <= start:
            raise ValueError(f"need rank >= 0 and 0 <= start < stop, got rank {rank}, [{start}, {stop})")
        u = self._uniforms(_mix(self.config.seed, split, rank), start, stop)
        ids = self._ids(u[:, :NUM_SPARSE])
        dense = self._dense(u[:, NUM_SPARSE : NUM_SPARSE + NUM_DENSE])
        logits = self.teacher_logits(dense, ids)
        labels = (u[:, -1] < torch.sigmoid(logits)).to(torch.float32)
        n = stop - start
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.keys,
            values=ids.t().contiguous().view(-1),  # feature-major: all of feature 0, then feature 1...
            lengths=torch.ones(NUM_SPARSE * n, dtype=torch.int32),
        )
        return Batch(dense_features=dense.to(torch.float32), sparse_features=kjt, labels=labels), logits

    def batch(self, rank: int, start: int, stop: int, split: str = "train") -> Batch:
        """Samples ``[start, stop)`` of ``rank``'s stream of ``split`` as a torchrec Batch."""
        return self.generate(rank, start, stop, split)[0]

    def teacher_logits(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The hidden model's logits (float64) for dense features [N, 13] and ids [N, 26]."""
        x = (dense.to(torch.float64) - self._mu) / self._sd
        h = x @ self._w_dense + self._emb[ids + self._offsets].to(torch.float64).sum(1)
        return self._bias + self.config.signal * (torch.tanh(h) @ self._v)

    def label_entropy(self) -> float:
        """Logloss (nats) of always predicting the mean click rate: the baseline a model must beat."""
        p = self.config.ctr
        return -(p * math.log(p) + (1 - p) * math.log(1 - p))

    # ------------------------------------------------------------------ internals

    def _uniforms(self, stream: int, start: int, stop: int) -> torch.Tensor:
        width = NUM_SPARSE + NUM_DENSE + 1
        first, last = start // CHUNK, (stop - 1) // CHUNK
        chunks = [
            torch.rand(CHUNK, width, generator=torch.Generator().manual_seed(_mix(stream, c)), dtype=torch.float64)
            for c in range(first, last + 1)
        ]
        u = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
        return u[start - first * CHUNK : stop - first * CHUNK]

    def _ids(self, u: torch.Tensor) -> torch.Tensor:
        cols = []
        for t, (cdf, (mult, add)) in enumerate(zip(self._cdfs, self._scramble)):
            n = cdf.numel()
            rank = torch.searchsorted(cdf, u[:, t].contiguous(), right=True).clamp_(max=n - 1)
            cols.append((rank * mult + add) % n)
        return torch.stack(cols, dim=1)

    def _dense(self, u: torch.Tensor) -> torch.Tensor:
        z = math.sqrt(2.0) * torch.erfinv(2.0 * u.clamp(1e-12, 1 - 1e-12) - 1.0)
        counts = torch.floor(torch.exp((self._mu + self._sd * z).clamp(max=20.0)))
        return torch.log1p(counts)

    def _calibrate_bias(self, ctr: float) -> float:
        """The bias whose mean click probability, over a fixed calibration sample, is ``ctr`` (bisection)."""
        u = self._uniforms(_mix(self.config.teacher_seed, "calibration"), 0, 16 * CHUNK)
        raw = self.teacher_logits(self._dense(u[:, NUM_SPARSE : NUM_SPARSE + NUM_DENSE]), self._ids(u[:, :NUM_SPARSE]))
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if torch.sigmoid(raw + mid).mean().item() < ctr:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2


class ClickDataset(torch.utils.data.Dataset):
    """Map-style dataset whose item ``i`` is batch ``i`` of one rank's stream: samples ``[i·B, (i+1)·B)``.

    Args:
        stream: the task.
        rank: whose stream.
        batch_size: samples per item.
        num_batches: the dataset's length.
        split: ``"train"`` or ``"eval"`` (a separate stream of the same seed).
    """

    def __init__(self, stream: SyntheticCriteo, rank: int, batch_size: int, num_batches: int,
                 split: str = "train") -> None:
        if split not in _SPLITS:
            raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
        self.stream = stream
        self.rank = rank
        self.batch_size = batch_size
        self.num_batches = num_batches
        self.split = split

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, i: int) -> Batch:
        if not 0 <= i < self.num_batches:
            raise IndexError(f"batch {i} out of range [0, {self.num_batches})")
        return self.stream.batch(self.rank, i * self.batch_size, (i + 1) * self.batch_size, self.split)


def _as_is(item: Any) -> Any:
    """Collate function for items that are whole batches already (module level, so workers can pickle it)."""
    return item


def make_loader(dataset: ClickDataset, num_workers: int = 0) -> StatefulDataLoader:
    """A StatefulDataLoader over ``dataset`` in order; its state_dict says how far it has read."""
    return StatefulDataLoader(dataset, batch_size=None, shuffle=False, num_workers=num_workers, collate_fn=_as_is)


class ResumableReader:
    """The iterator a training pipeline reads, whose state is that of the first batch not yet trained.

    ``TrainPipelineSparseDist`` reads up to two batches ahead of the one it trains, so the
    loader's own state at a checkpoint would skip them on resume. This wrapper records the
    loader's state before each batch it hands out, and :meth:`state_dict` returns the one
    taken before the oldest batch that :meth:`step_done` has not yet acknowledged.

    Args:
        loader: the StatefulDataLoader.
    """

    def __init__(self, loader: StatefulDataLoader) -> None:
        self.loader = loader
        self.trained = 0
        self._it: Iterator[Any] | None = None
        self._pending: deque[dict[str, Any]] = deque()

    def __iter__(self) -> ResumableReader:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._it = iter(self.loader)
        before = copy.deepcopy(self.loader.state_dict())
        item = next(self._it)
        self._pending.append(before)
        return item

    def step_done(self) -> None:
        """Records that the oldest batch handed out has been trained."""
        if not self._pending:
            raise RuntimeError("step_done() without a batch in flight")
        self._pending.popleft()
        self.trained += 1

    def state_dict(self) -> dict[str, Any]:
        loader_state = self._pending[0] if self._pending else self.loader.state_dict()
        return {"loader": copy.deepcopy(loader_state), "trained": self.trained}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            loader_state, trained = state["loader"], int(state["trained"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"reader state has keys {sorted(state) if isinstance(state, dict) else type(state).__name__}, "
                "expected 'loader' and 'trained'; the checkpoint is of another job"
            ) from None
        if isinstance(loader_state, dict) and loader_state.get("_iterator_finished"):
            # The saving run had read its whole dataset (it ended at its train.steps). Loaded as
            # is, a StatefulDataLoader would start that "finished" epoch over from batch 0; a run
            # resumed with more steps reads on from where the saving run stopped.
            loader_state = {**loader_state, "_iterator_finished": False}
        self.loader.load_state_dict(loader_state)
        self.trained = trained
        self._it = None
        self._pending.clear()
