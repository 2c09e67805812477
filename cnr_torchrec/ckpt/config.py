"""Checkpoint configuration: frozen dataclasses, each checking its values, and :func:`load_config`.

The dataclasses say what a :class:`~cnr_torchrec.ckpt.Checkpointer` may be asked for, and
each refuses out-of-range values and inconsistent combinations when it is built, naming the
key. :func:`load_config` builds them from YAML or a mapping with the strict, typed loader of
:mod:`cnr_torchrec.ckpt.config_loading`, which names unknown keys, missing keys and wrong types.
"""

from __future__ import annotations

import math
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from cnr_torchrec.ckpt.config_loading import dataclass_with_overrides, read_mapping
from cnr_torchrec.ckpt.format.bytes.chunks import DEFAULT_CHUNK_BYTES
from cnr_torchrec.errors import ConfigError

__all__ = [
    "POLICIES",
    "BudgetConfig",
    "CheckpointConfig",
    "CompactionConfig",
    "DEFAULT_BITS",
    "DEFAULT_BITS_TABLE",
    "DEFAULT_COMPACTION",
    "DEFAULT_IMAGE_MAX_AGE_S",
    "FailureConfig",
    "IntegrityConfig",
    "KeepConfig",
    "MemoryTierConfig",
    "QuantizationConfig",
    "RESIDUAL_BITS_TABLE",
    "load_config",
    "measured_bits_table",
]

Policy = Literal["full", "one_shot", "consecutive", "intermittent"]
POLICIES: tuple[str, ...] = typing.get_args(Policy)
_MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week; also keeps timedelta() from overflowing
DEFAULT_BITS = 4
"""The bits of a quantizing method whose config leaves them out."""


@dataclass(frozen=True)
class QuantizationConfig:
    """How embedding weight rows are encoded (see :func:`cnr_torchrec.quant.get_codec`).

    Attributes:
        method: ``none``, ``fp16``, ``bf16``, ``uniform_sym``, ``uniform_asym``, ``kmeans`` or ``adaptive``.
        bits: 2, 3, 4 or 8 for the quantizing methods, or ``auto`` (from the failures expected); None for the
            others. Left out (None) on a quantizing method, the Checkpointer runs it at :data:`DEFAULT_BITS`.
        params: extra codec parameters, e.g. ``{"num_bins": 25, "ratio": 0.6}`` for adaptive,
            or ``{"bias_dtype": "float16"}`` to store the row bias in 2 bytes instead of 4.
        state_dtype: how the fused optimizer's per-row state (momentum, row-wise Adagrad's
            sum of squares) is stored: ``float32`` (exact, the default), ``bfloat16`` (same
            range, 2 bytes, relative error below 0.4%) or ``float16``.
        residual: code each row a delta writes as its difference from what the chain already
            restores for it (closed loop), so that restores do not compound the codec's error
            (docs/accuracy.md). Costs a float32 copy of this rank's shards in host memory.
            ``true`` needs policy ``consecutive``, a quantizing method and row-wise (or no)
            optimizer state, and refuses anything else. ``auto`` (the default) is on where
            those hold and the hosts have the memory, and plain coding elsewhere: the
            Checkpointer decides it once, from the config and the job
            (:func:`~cnr_torchrec.ckpt.config_resolve.resolve`). The config keeps ``auto``.
    """

    method: str = "adaptive"
    bits: int | Literal["auto"] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    state_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    residual: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        from cnr_torchrec.quant import UnknownCodecError, available_codecs, check_codec

        bit_choices = available_codecs().get(self.method)  # None for an unknown method: check_codec names it
        if self.bits == "auto" and bit_choices is not None and not {2, 3, 4, 8} <= set(bit_choices):
            raise ConfigError(f"quantization: bits: auto needs a quantizing method, not {self.method!r}")
        bits = self.bits_or_default
        try:
            for width in (2, 3, 4, 8) if bits == "auto" else (bits,):  # under auto, any of them may be picked
                check_codec(self.method, width, **self.params)
        except UnknownCodecError as e:
            raise ConfigError(str(e)) from None

    @property
    def bits_or_default(self) -> int | Literal["auto"] | None:
        """``bits`` as given, or :data:`DEFAULT_BITS` where it is left out and the method offers that width
        (what :func:`~cnr_torchrec.ckpt.config_resolve.resolve` settles it to)."""
        from cnr_torchrec.quant import available_codecs

        if self.bits is None and DEFAULT_BITS in available_codecs().get(self.method, ()):
            return DEFAULT_BITS
        return self.bits


# Most restores expected -> bits; beyond: fallback_bits. Measured by the accuracy studies over their seeds
# (docs/accuracy.md: adaptive rows within 0.01% logloss with one standard error to spare on both tasks, the
# error being the larger of the pooled paired one and the seeds' spread); Check-N-Run's table was
# {1: 2, 3: 3, 20: 4}. tests/test_accuracy_bench.py checks both against the committed studies.
DEFAULT_BITS_TABLE = {1: 4, 20: 8}
# The same, measured with quantization.residual: true (with and without background compaction), whose
# restores do not compound the codec's error.
RESIDUAL_BITS_TABLE = {3: 4, 20: 8}


def measured_bits_table(residual: bool) -> dict[int, int]:
    """The measured ``failure.bits_table`` of a coding: :data:`RESIDUAL_BITS_TABLE` with residual coding,
    :data:`DEFAULT_BITS_TABLE` without (a copy)."""
    return dict(RESIDUAL_BITS_TABLE if residual else DEFAULT_BITS_TABLE)


@dataclass(frozen=True)
class FailureConfig:
    """What the job expects of failures: it drives ``bits: auto`` and ``interval: auto``.

    Attributes:
        expected_restores: restores the job expects over its life. When left out it is
            ``ceil(failure_rate_per_hour * job_hours)``.
        failure_rate_per_hour: failures per hour of training (the whole job).
        job_hours: planned length of the job.
        mtbf_hours: mean time between failures; ``1 / failure_rate_per_hour`` when left out.
        bits_table: ``{most restores: bits}``; the smallest key not below the expected
            restores gives the bits, and more than the largest key gives ``fallback_bits``.
            None (the default): measured by our accuracy studies for the quantization's
            coding, :data:`DEFAULT_BITS_TABLE`, or :data:`RESIDUAL_BITS_TABLE` with
            residual coding, chosen once ``residual`` is decided (by the Checkpointer,
            :func:`~cnr_torchrec.ckpt.config_resolve.resolve`; the config keeps None).
            Check-N-Run's was 1 -> 2, 3 -> 3, 20 -> 4.
        fallback_bits: bits once the restores performed exceed the estimate (and beyond the table).
        recovery: ``full`` (every rank restores; Young/Daly interval) or ``partial`` (only
            failed ranks restore, CPR; the interval keeps the lost updates under target).
        target_lost_fraction: with partial recovery, the expected share of training updates
            that failures may lose.
    """

    expected_restores: int | None = None
    failure_rate_per_hour: float | None = None
    job_hours: float | None = None
    mtbf_hours: float | None = None
    bits_table: dict[int, int] | None = None
    fallback_bits: int = 8
    recovery: Literal["full", "partial"] = "full"
    target_lost_fraction: float = 0.001

    def __post_init__(self) -> None:
        if self.expected_restores is not None and self.expected_restores < 0:
            raise ConfigError(f"expected_restores must be >= 0, got {self.expected_restores}")
        for key in ("failure_rate_per_hour", "job_hours", "mtbf_hours"):
            value = getattr(self, key)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{key} must be a positive number, got {value}")
        if self.fallback_bits not in (2, 3, 4, 8):
            raise ConfigError(f"fallback_bits must be 2, 3, 4 or 8, got {self.fallback_bits}")
        if self.bits_table is not None:  # None: the Checkpointer takes the measured table of the coding it runs
            self._check_table(self.bits_table)
        if not 0.0 < self.target_lost_fraction < 1.0:
            raise ConfigError(f"target_lost_fraction must be in (0, 1), got {self.target_lost_fraction}")

    def _check_table(self, table: dict[int, int]) -> None:
        if not table or any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in table):
            raise ConfigError(f"bits_table keys must be restore counts >= 0, got {table}")
        bits = [table[k] for k in sorted(table)]
        if any(b not in (2, 3, 4, 8) for b in bits + [self.fallback_bits]):
            raise ConfigError(f"bits must be 2, 3, 4 or 8; got table {table}, fallback {self.fallback_bits}")
        if bits != sorted(bits) or self.fallback_bits < bits[-1]:
            raise ConfigError(
                f"bits_table must not lower the bits as restores grow, and fallback_bits must be at least "
                f"its last value; got {table}, fallback {self.fallback_bits}"
            )

    @property
    def estimate_restores(self) -> int | None:
        """Expected restores: given, or failure rate x job length (rounded up); None if unknown."""
        if self.expected_restores is not None:
            return self.expected_restores
        if self.failure_rate_per_hour is not None and self.job_hours is not None:
            return math.ceil(self.failure_rate_per_hour * self.job_hours - 1e-9)
        return None

    @property
    def mtbf_s(self) -> float | None:
        """Mean time between failures in seconds, or None if unknown."""
        if self.mtbf_hours is not None:
            return self.mtbf_hours * 3600.0
        if self.failure_rate_per_hour is not None:
            return 3600.0 / self.failure_rate_per_hour
        return None

    def bits_for(self, restores: int) -> int:
        """Bits for a job expecting ``restores`` restores."""
        if self.bits_table is None:
            raise ValueError("bits_table: None is settled once quantization.residual is decided, by "
                             "cnr_torchrec.ckpt.config_resolve.resolve; read the Checkpointer's config (ck.config)")
        for most in sorted(self.bits_table):
            if restores <= most:
                return self.bits_table[most]
        return self.fallback_bits


@dataclass(frozen=True)
class BudgetConfig:
    """CPR's budget-limited saves: at most ``max_rows_fraction`` of each shard's rows per save.

    Attributes:
        max_rows_fraction: share of a shard's rows a save may write (None: no limit). Rows
            left out stay dirty and go into a later save.
        priority: which dirty rows go first: ``mfu`` (most frequently updated, from exact
            per-row counters) or ``ssu`` (counters fed by a sample of the lookups).
        ssu_rate: share of looked-up ids that SSU counts.
    """

    max_rows_fraction: float | None = None
    priority: Literal["mfu", "ssu"] = "mfu"
    ssu_rate: float = 0.1

    def __post_init__(self) -> None:
        if self.max_rows_fraction is not None and not 0.0 < self.max_rows_fraction <= 1.0:
            raise ConfigError(f"max_rows_fraction must be in (0, 1], got {self.max_rows_fraction}")
        if not 0.0 < self.ssu_rate <= 1.0:
            raise ConfigError(f"ssu_rate must be in (0, 1], got {self.ssu_rate}")


DEFAULT_IMAGE_MAX_AGE_S = 86400.0
"""How long another root's memory images outlive their last change by default: a day, longer than a killed job
waits for its restart, short enough that images no job will take do not hold a host's memory for long."""


@dataclass(frozen=True)
class MemoryTierConfig:
    """The memory tier: each rank's restore image kept in host shared memory (docs/memory-tier.md).

    A restarted worker whose host kept its image restores its shards from it at memory speed;
    the others read storage. ``memory_tier: auto`` in YAML is ``{mode: auto}``.

    Attributes:
        mode: ``auto`` keeps an image only where it costs no memory: with residual coding, whose
            reconstruction (a float32 copy of the rank's shards) becomes the image. ``on`` keeps one with
            plain coding too, as an extra host copy. ``off`` keeps none.
        path: the directory of the images, on a memory file system (``/dev/shm``; in a container,
            give it room: Docker ``--shm-size``, Kubernetes an ``emptyDir`` with ``medium: Memory``). Each
            root keeps its images in a directory of its own under it, so several jobs can share it.
        max_age_s: a job that opens a root removes another root's images once nothing in them changed for
            this long (no commit, no job opening that root): the images of a job that will not be restarted
            do not hold the host's memory for ever. A killed job's images survive a restart within it.
    """

    mode: Literal["auto", "on", "off"] = "auto"
    path: str = "/dev/shm"
    max_age_s: float = DEFAULT_IMAGE_MAX_AGE_S

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "on", "off"):
            raise ConfigError(f"memory_tier.mode: {self.mode!r} is not one of ['auto', 'on', 'off']")
        if not self.path:
            raise ConfigError("memory_tier.path: give a directory on a memory file system, such as /dev/shm")
        if not self.max_age_s > 0:
            raise ConfigError(f"memory_tier.max_age_s: {self.max_age_s!r} is not a positive number of seconds "
                              f"(the default, {DEFAULT_IMAGE_MAX_AGE_S:g}, is a day)")

    @classmethod
    def from_scalar(cls, value: Any, where: str) -> MemoryTierConfig:
        """``memory_tier: auto | on | off`` (YAML reads on and off as booleans: both forms are taken)."""
        modes: dict[Any, Literal["auto", "on", "off"]] = {True: "on", False: "off", "on": "on", "off": "off",
                                                           "auto": "auto"}
        if isinstance(value, (dict, list)) or value not in modes:
            raise ConfigError(f"{where}: expected auto, on, off or a mapping (mode, path, max_age_s), got {value!r}")
        return cls(mode=modes[value])


@dataclass(frozen=True)
class IntegrityConfig:
    """An authenticated root: a secret key seals every manifest (HMAC-SHA256) and every chunk (keyed BLAKE2b),
    and every read checks them, so that what someone without the key wrote or altered is refused
    (:mod:`~cnr_torchrec.ckpt.format.bytes.integrity`, docs/checkpoints.md). Give one of the two; neither: no key.

    Attributes:
        key_file: a file that holds the key (its bytes, less one trailing line break; 16 bytes at least).
        key_env: the name of an environment variable that holds the key.
    """

    key_file: str | None = None
    key_env: str | None = None

    def __post_init__(self) -> None:
        if self.key_file and self.key_env:
            raise ConfigError("give key_file or key_env, not both (key_env names a variable that holds the key)")


@dataclass(frozen=True)
class KeepConfig:
    """What each commit keeps under the root; the rest is deleted.

    A checkpoint is kept with everything its chain needs, so any kept checkpoint restores.
    The newest checkpoint is always kept.

    Attributes:
        checkpoints: the newest N checkpoints stay restorable (None: no limit by count).
        bytes: keep the newest checkpoints while what they need, together, fits in this many
            bytes (None: no limit by size). With ``checkpoints`` too, both limits hold.
        chains: also keep every checkpoint of the newest K chains (None: none beyond the above).
        followers: the names of the followers (``Follower(lease=NAME)``, ``cnr publish --lease NAME``) whose
            leases keep what they have not read yet: every checkpoint committed from the one a follower
            serves on, with what their chains need (docs/publish.md).
        follower_max_age_s: a lease not renewed for this long keeps nothing (a follower that stopped).
    """

    checkpoints: int | None = None
    bytes: int | None = None
    chains: int | None = None
    followers: tuple[str, ...] = ()
    follower_max_age_s: float = 86400.0

    def __post_init__(self) -> None:
        from cnr_torchrec.ckpt.format.leases import check_name

        for name in ("checkpoints", "bytes", "chains"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"keep.{name}: must be at least 1 or null, got {value}")
        for follower in self.followers:
            check_name(follower, "keep.followers")
        if not (math.isfinite(self.follower_max_age_s) and self.follower_max_age_s > 0):
            raise ConfigError(f"keep.follower_max_age_s: must be a positive number of seconds, got "
                              f"{self.follower_max_age_s}")
        if self.checkpoints is None and self.bytes is None and self.chains is None:
            raise ConfigError("keep: give checkpoints, bytes or chains (or leave keep out: the newest 2 checkpoints "
                              "are kept)")


@dataclass(frozen=True)
class CompactionConfig:
    """Background, lossless compaction of the chain being written into a new baseline.

    When a save finds the chain past a trigger, the ranks fold it, from storage, into a
    baseline that keeps each row's stored bytes; the next deltas hang on it and the old
    chain is collected. Training waits for none of it.

    Attributes:
        max_chain: compact once the chain holds this many deltas (None: no limit by length).
        max_chain_bytes_ratio: compact once the chain's deltas hold this many times the
            baseline's bytes (None: no limit by size).
    """

    max_chain: int | None = None
    max_chain_bytes_ratio: float | None = None

    def __post_init__(self) -> None:
        if self.max_chain is not None and self.max_chain < 1:
            raise ConfigError(f"compaction.max_chain: must be at least 1 delta, got {self.max_chain}")
        ratio = self.max_chain_bytes_ratio
        if ratio is not None and not (math.isfinite(ratio) and ratio > 0):
            raise ConfigError(f"compaction.max_chain_bytes_ratio: must be a positive number, got {ratio}")
        if self.max_chain is None and ratio is None:
            raise ConfigError("compaction: give max_chain (deltas) or max_chain_bytes_ratio (deltas' bytes over the "
                              "baseline's), or leave compaction out")

    def due(self, deltas: int, baseline_bytes: int, delta_bytes: int) -> str:
        """Why a chain of ``deltas`` deltas holding ``delta_bytes`` on a baseline of ``baseline_bytes``
        is due for compaction; empty if it is not."""
        if self.max_chain is not None and deltas >= self.max_chain:
            return f"{deltas} deltas >= compaction.max_chain {self.max_chain}"
        ratio = self.max_chain_bytes_ratio
        if ratio is not None and deltas and delta_bytes >= ratio * baseline_bytes:
            return (f"deltas hold {delta_bytes / max(baseline_bytes, 1):.2f}x the baseline's bytes >= "
                    f"compaction.max_chain_bytes_ratio {ratio}")
        return ""


DEFAULT_COMPACTION = CompactionConfig(max_chain=8)
"""The compaction a consecutive chain gets unless its config says otherwise: a fold every 8 deltas
(docs/compaction.md has the restore times and fold costs it was chosen from). Other policies, and a
job with ``budget.max_rows_fraction``, get none by default."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Everything a :class:`~cnr_torchrec.ckpt.Checkpointer` needs to know.

    A config is what its author wrote: building one checks every value and combination, and
    never rewrites it. The defaults that follow from the job (``quantization.bits`` and
    ``failure.bits_table`` left out, ``quantization.residual: auto``, the default compaction)
    are settled once, by :func:`~cnr_torchrec.ckpt.config_resolve.resolve`, into the config
    the Checkpointer keeps as ``Checkpointer.config``, which it runs with and records.

    Attributes:
        root: where checkpoints go: a directory, or any torchsnapshot storage URI
            (``fs://...``, ``s3://bucket/prefix``, or a registered plugin).
        policy: ``full`` (every checkpoint a baseline), ``one_shot`` (rows dirty since the
            baseline), ``consecutive`` (rows dirty since the previous checkpoint) or
            ``intermittent`` (one_shot, plus a new baseline when the sizes say so).
        quantization: the codec for embedding weight rows, and the precision of the
            fused optimizer's row state. Dense parameters are always stored in full precision.
        keep_last: the newest N checkpoints stay restorable after a commit (with what their
            chains need); a shorthand for ``keep: {checkpoints: N}``. Default 2.
        keep: retention by checkpoints, bytes and chains (see :class:`KeepConfig`).
        compaction: background compaction of the chain (see :class:`CompactionConfig`); None: off. Left at
            :data:`DEFAULT_COMPACTION`, the Checkpointer runs it under policy consecutive without a row budget,
            and none otherwise; asked for (any other value) under another policy, it is refused.
        on_busy: what ``save`` does while the previous save is still writing: ``wait`` for
            it, or ``skip`` this save (the dirty rows carry over to the next one).
        full_shard_fraction: when at least this share of a table's rows is dirty, its
            shards are written whole, without row ids.
        save_timeout_s: how long rank 0 waits for every rank's report before the save fails (the others wait twice
            as long for its verdict).
        on_corrupt: what ``restore`` does when a file of the newest checkpoint fails its
            checks: ``fallback`` to the newest older checkpoint that is sound (logged), or
            ``fail`` with CorruptCheckpointError naming the file.
        failure: what the job expects of failures (see :class:`FailureConfig`).
        interval: steps between saves for :meth:`Checkpointer.should_save`: a number,
            ``auto`` (Young/Daly for full recovery, the lost-updates target for partial
            recovery, from the measured save cost and step time), or None (the caller decides).
        budget: CPR's budget-limited, priority-ordered saves (see :class:`BudgetConfig`).
        storage_options: passed to the torchsnapshot storage plugin.
        chunk_bytes: the largest object a rank's payload is cut into (a multiple of 4096, at
            most 5 GiB, S3's single-PUT limit); a save holds a few chunks beyond the staged rows.
        io_threads: threads per rank that write and read chunks in parallel.
        restore_threads: threads per rank that a restore decodes rows on (ATen's intra-op
            pool, widened during the restore only); None: the rank's share of the cores
            (see :func:`~cnr_torchrec.ckpt.restore.threads.decode_threads`).
        restore_rng: whether a restore also sets this process's global RNG states (torch,
            CUDA, Python's ``random``, NumPy) to those saved with the checkpoint, rank by rank.
            Off by default: a restore then leaves them as the job set them, so anything built
            after it (a data set drawn from the global RNG, dropout) is what it would be
            without the restore. On, a resumed job draws the same random numbers as the job
            that saved, which exact continuation of dropout or of managed-collision evictions
            (they re-initialise rows from the global RNG) needs; it needs the world size that saved.
        restore_rollback: keep a host copy of what a restore may overwrite (this rank's shards,
            their optimizer state, dense parameters and optimizer, eviction windows, extra_state)
            until the restore succeeds, so that a restore that fails leaves the model as it was.
            Off saves that memory (one copy of the rank's shards) for the restore's length; a
            failed restore then leaves the tables partly overwritten, and its error says so.
        memory_tier: each rank's restore image in host shared memory, for restarts on the same hosts
            (see :class:`MemoryTierConfig`).
        integrity: the root's key, which authenticates every manifest and chunk (see :class:`IntegrityConfig`);
            by default none.
    """

    root: str
    policy: Policy = "consecutive"
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    keep_last: int | None = None
    keep: KeepConfig | None = None
    compaction: CompactionConfig | None = DEFAULT_COMPACTION
    on_busy: Literal["wait", "skip"] = "wait"
    full_shard_fraction: float = 0.5
    save_timeout_s: float = 600.0
    on_corrupt: Literal["fail", "fallback"] = "fallback"
    failure: FailureConfig = field(default_factory=FailureConfig)
    interval: int | Literal["auto"] | None = None
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    storage_options: dict[str, Any] = field(default_factory=dict)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    io_threads: int = 4
    restore_threads: int | None = None
    restore_rng: bool = False
    restore_rollback: bool = True
    memory_tier: MemoryTierConfig = field(default_factory=MemoryTierConfig)
    integrity: IntegrityConfig = field(default_factory=IntegrityConfig)

    def __post_init__(self) -> None:
        if not self.root:
            raise ConfigError("root: give the directory or storage URI where checkpoints go")
        if not (4096 <= self.chunk_bytes <= 5 << 30 and self.chunk_bytes % 4096 == 0):
            raise ConfigError(f"chunk_bytes: must be a multiple of 4096 from 4096 to {5 << 30} (5 GiB, S3's "
                              f"single-PUT limit), got {self.chunk_bytes}; the default is {DEFAULT_CHUNK_BYTES}")
        if not 1 <= self.io_threads <= 64:
            raise ConfigError(f"io_threads: must be 1 to 64, got {self.io_threads}")
        if self.restore_threads is not None and not 1 <= self.restore_threads <= 1024:
            raise ConfigError(f"restore_threads: must be 1 to 1024, or null for the rank's share of the cores, got "
                              f"{self.restore_threads}")
        if self.keep_last is not None and self.keep_last < 1:
            raise ConfigError(f"keep_last: must be at least 1 (the checkpoint being written), got {self.keep_last}")
        if self.keep_last is not None and self.keep is not None:
            raise ConfigError("give keep_last or keep, not both: keep_last: N is keep: {checkpoints: N}")
        asked = self.compaction is not None and self.compaction is not DEFAULT_COMPACTION  # the default is no request
        if asked and self.policy != "consecutive":
            raise ConfigError(
                f"compaction needs policy consecutive, not {self.policy!r}: under full every checkpoint is a baseline "
                "already, a one_shot chain is two checkpoints long, and intermittent bounds its chains by writing "
                "baselines. Use policy consecutive with compaction, or leave compaction out"
            )
        why = self._why_no_residual()
        if why and self.quantization.residual is True:
            raise ConfigError("quantization.residual: true does not work with " + "; ".join(why))
        decided = self.residual_from_config
        if self.failure.bits_table is None and decided != "auto":  # the measured table it will run with, checked now
            self.failure._check_table(measured_bits_table(decided))
        if not 0.0 < self.full_shard_fraction <= 1.0:
            raise ConfigError(f"full_shard_fraction: must be in (0, 1], got {self.full_shard_fraction}")
        if self.quantization.bits == "auto" and self.failure.estimate_restores is None:
            raise ConfigError(
                "quantization: bits: auto needs a failure estimate: set failure.expected_restores, or "
                "failure.failure_rate_per_hour and failure.job_hours"
            )
        if isinstance(self.interval, int) and not isinstance(self.interval, bool) and self.interval < 1:
            raise ConfigError(f"interval: must be at least 1 step, 'auto', or null; got {self.interval}")
        if self.interval == "auto" and self.failure.mtbf_s is None:
            raise ConfigError(
                "interval: auto needs the failure rate: set failure.mtbf_hours or failure.failure_rate_per_hour"
            )
        if not (math.isfinite(self.save_timeout_s) and 0 < self.save_timeout_s <= _MAX_TIMEOUT_S):
            raise ConfigError(
                f"save_timeout_s: must be a positive number of seconds up to {_MAX_TIMEOUT_S:.0f}, "
                f"got {self.save_timeout_s}"
            )

    @property
    def residual_from_config(self) -> bool | Literal["auto"]:
        """``quantization.residual`` as far as the config decides it: ``auto`` is plain coding (False) where the
        policy or the method leaves residual coding nothing to do, and stays ``auto`` where the job decides
        (:func:`~cnr_torchrec.ckpt.config_resolve.resolve`)."""
        wanted = self.quantization.residual
        return False if wanted == "auto" and self._why_no_residual() else wanted

    def _why_no_residual(self) -> list[str]:
        """What in this config leaves residual coding nothing to do, in words; empty when nothing does."""
        why = []
        if self.policy != "consecutive":
            why.append(f"policy {self.policy!r} (a residual is coded against the previous checkpoint's rows; use "
                       "consecutive)")
        if self.quantization.method in ("none", "fp16", "bf16"):
            why.append(f"method {self.quantization.method!r}, which does not quantize (residuals gain nothing)")
        return why

    @property
    def retention(self) -> KeepConfig:
        """What a commit keeps: ``keep``, else the newest ``keep_last`` (default 2) checkpoints."""
        return self.keep or KeepConfig(checkpoints=self.keep_last or 2)


def load_config(source: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> CheckpointConfig:
    """Builds a :class:`CheckpointConfig` from a shipped config, a YAML file or a mapping.

    Overrides are laid over the file's values by
    :func:`~cnr_torchrec.ckpt.config_loading.merge_overrides`: a mapping given for a section
    (``quantization``, ``keep``, ``compaction``, ``failure``, ``budget``) merges into the file's
    section: ``load_config("consecutive", quantization={"bits": 8})`` keeps the file's method,
    params, state_dtype and residual. To replace a section whole, pass its dataclass
    (``quantization=QuantizationConfig(method="fp16")``); ``None`` turns an optional section off
    (``compaction=None``). Any other value, a ``dict`` field such as ``quantization.params`` or
    ``storage_options`` included, replaces the file's value whole.

    Args:
        source: the name of a config the package ships (``"consecutive"``, ``"full"``, ``"one_shot"``,
            ``"intermittent"``), the path of a YAML file, or a mapping with the same keys.
        overrides: config keys laid over the source's values, as above.

    Returns:
        The config, every value checked.

    Raises:
        ConfigError: the file is missing or not YAML, a key is unknown, a value has the
            wrong type or an inconsistent value. The message names the key, and the file
            (``with overrides`` when there are some, since the key may come from them).
    """
    data, where = read_mapping(source, "config file")
    return dataclass_with_overrides(CheckpointConfig, data, overrides, where)
