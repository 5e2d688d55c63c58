"""The detector's thresholds, one small dataclass per rule, a docstring under every field.

:class:`DetectConfig` composes the groups. Files and ``--set`` may name a
setting flat (``flag_after = 3``, every name is unique across groups) or under
its group (``[detect.persistence] flag_after = 3``); both land in the same
field. Every value is a number >= 0, checked when the config is built, so a
bad file fails at start with its name, not mid-run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import tomllib


class _Checked:
    """Shared check: every field a number >= 0 of its declared kind."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            kind = float if f.type in ("float", float) else int
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"config {f.name}: expected a number, got {value!r}")
            if kind is int and not isinstance(value, int):
                raise ValueError(f"config {f.name}: expected an integer, got {value!r}")
            if value < 0:
                raise ValueError(f"config {f.name}: must be >= 0, got {value!r}")


@dataclass(frozen=True)
class BaselineConfig(_Checked):
    """The job's own step time, against which every slow-down is measured."""

    min_effect: float = 0.10
    """Smallest effect on step time that counts (0.10 = 10 %), for every cause."""

    history: int = 30
    """Steps of history kept: the job's baseline, each rank's own compute."""

    min_history: int = 5
    """Steps of history needed before a baseline (and so any score) exists."""

    restart_warmup: int = 5
    """Steps of a new attempt of a job (an elastic restart) judged as a warm-up,
    as a job's first ``min_history`` steps are: the restarted ranks load a
    checkpoint and open fresh connections, so neither their step times nor the
    flow samples of those steps (nor any sample that overlaps them) are
    evidence; ``rank_lost`` and ``hang`` are judged throughout."""

    baseline_adapt_steps: int = 50
    """After this many stretched steps with nobody to blame, the new step time
    becomes the baseline (a job that got slower for good, e.g. a new phase)."""


@dataclass(frozen=True)
class NoiseConfig(_Checked):
    """How high the compute bar rises on a noisy machine."""

    noise_k: float = 3.0
    """The bar is at least this many robust standard deviations of the relative
    score seen in quiet steps."""

    noise_lag: int = 6
    """A step's scores join the noise pool this many steps late, and only if
    nothing was suspect then, so a straggler's onset cannot raise the bar
    before it is flagged."""


@dataclass(frozen=True)
class ComputeConfig(_Checked):
    """``compute``: the rank that arrives last at its collectives."""

    individual_share: float = 0.0
    """When above 0, a compute flag also needs the rank's own compute to have
    grown by this share of the bar against its own history. Off by default: on
    a shared machine every rank's own history drifts with the load, which hid
    real stalls."""

    sustained_window: int = 9
    """Steps whose median relative score the sustained rule reads (0: off)."""

    sustained_share: float = 0.6
    """A smaller effect counts when the sustained median reaches this share of
    the bar (never under ``min_effect``): a 9-step median spreads about
    sqrt(pi / 18) of one step."""

    attributed_share: float = 0.25
    """When the job is stretched by at least ``min_effect``, no network
    hypothesis holds and nobody is flagged, a rank whose sustained median
    lateness is at least this share of the stretch (and clears the noise of
    such a median) is the compute straggler, though under ``min_effect``
    itself: a CPU-starved rank slows the collectives too (on a host without
    an accelerator its collective is CPU work), where nobody is late."""

    trend_window: int = 20
    """Steps of relative score the trend rule fits a line to (0: off)."""

    trend_slope: float = 0.2
    """Slope (relative score per 100 steps) a rank that ages must rise at."""

    trend_level: float = 0.05
    """... and the level its fitted line must have reached now (half of
    ``min_effect``: flagged before the slow-down is large)."""

    trend_bar_share: float = 0.5
    """... and this share of the compute bar, when the machine is noisy."""

    trend_concordance: float = 0.7
    """Share of the window's pairs of steps in which the later score is the
    higher (Kendall): 0.5 is noise, with a spread of 0.08 over 20 steps."""


@dataclass(frozen=True)
class NetworkConfig(_Checked):
    """``network``: the job stretched while nobody is late, on slow or lossy flows."""

    net_ratio: float = 1.5
    """srtt (each flow's median over the window) of the flows touching a rank,
    or a link, over that of the other flows that counts as localised to it."""

    net_fast_ratio: float = 2.5
    """The same ratio from the newest probe poll alone that counts at once
    (strong evidence: found a few samples before the window's median moves)."""

    explained_excess_us: float = 1000.0
    """While another rank explains the job's stretch (flagged ``compute`` or
    ``network``, or the one the window's retransmits localise to), a new
    network candidate also needs its flows' srtt this many microseconds above
    the others': the ranks waiting on it show only their delayed ACKs (seen:
    230 vs 380 us beside a late rank on a loopback job; 1.1 vs 1.9 ms on a
    lossy host's ring neighbour in the lab), while a second, real network
    straggler adds queueing of milliseconds (4-6 ms at 150 Mbit/s)."""

    net_hold_ratio: float = 1.25
    """A rank flagged ``network`` stays so while its score holds this much
    (hysteresis)."""

    net_min_bytes: int = 65536
    """Bytes a pair must send in the flow window to count."""

    link_min_share: float = 0.1
    """A link is judged on its srtt only while it carries at least this share of
    the median link's bytes (both directions, over the window): a side group's
    sparse request-and-reply traffic (the trainer's checkpoint group between
    ranks that exchange no collective data) shows the far end's reply time in
    its srtt and carries nothing the job's collectives wait on."""

    retrans_min: int = 8
    """Retransmits in the window before their share can localise a problem."""

    retrans_share: float = 0.75
    """Share of the window's retransmits on a rank's (or a link's) flows that
    localises a problem to it."""

    retrans_p: float = 1e-4
    """How unlikely that share must be by chance (binomial, each retransmit
    landing on the rank's flows in proportion to the bytes they carry): a
    handful of retransmits never localises anything."""

    flow_window_steps: float = 4.0
    """Flow history the matrix covers, in baseline steps."""

    flow_floor_intervals: float = 3.0
    """... but never fewer than this many probe intervals (a flow's median
    needs samples: the probes report once an interval)."""

    flow_window_s: float = 3.0
    """Seconds of flow history before the job has a baseline step (or before
    the probes' interval is known)."""


@dataclass(frozen=True)
class LostConfig(_Checked):
    """``rank_lost``: a rank whose records stopped."""

    lost_grace_s: float = 0.5
    """Silence after its connections were torn before a rank is lost."""

    lost_silence_s: float = 5.0
    """Silence while the others carry on (the larger of this and
    ``lost_silence_steps`` baseline steps) before a rank is lost."""

    lost_silence_steps: float = 5.0
    """The same silence counted in baseline steps."""

    tick_s: float = 0.5
    """Stream seconds between liveness checks (the pipeline's clock ticks)."""


@dataclass(frozen=True)
class StallConfig(_Checked):
    """``hang`` and silent loss: a collective the ranks wait on and never finish."""

    hang_after_s: float = 2.0
    """A collective still pending this long (from its issue) is a stall, if it
    is also ``hang_after_steps`` steps long. Pending records come at 1 s and
    2 s of a collective's life, so one is named at about 2 s: within the 3 s
    budget even when the waiting ranks issue it a little after the culprit
    stopped, while a one-off wait of under 2 s (a long GC pause, a slow
    rank's first slow step) is no hang."""

    hang_after_steps: float = 3.0
    """The same in the job's recent step time (the larger counts): a slow job
    whose collectives take long, but complete, never stalls."""

    catching_up_s: float = 1.0
    """A rank behind the stalled collective that sent a hook record this
    recently is catching up, not hung (as the ranks a healed cut left behind
    do, while a quicker peer already waits on the next collective). Under
    ``hang_after_s``, so a rank that stopped as the stall began is still
    named at the first look."""

    pending_stale_s: float = 2.5
    """A rank's pending record older than this no longer says it is waiting
    (they come every second while it is)."""

    host_silence_s: float = 2.0
    """A host whose own probe records stopped this long (and at least
    ``host_silence_intervals`` of their interval) while another host's go on is
    silent."""

    host_silence_intervals: float = 2.0
    """The same silence, in the host's own probe interval."""

    unreachable_retrans: int = 2
    """Retransmits since a stall began, all on flows touching one rank, that
    say the rank (its host) is cut off when every rank is waiting."""


@dataclass(frozen=True)
class PersistenceConfig(_Checked):
    """A change counts only when it lasts: a one-step spike never does."""

    window: int = 3
    """Steps in the rolling window whose median is scored (compute and the
    job's stretch)."""

    flag_after: int = 2
    """Consecutive bad windows before a rank is flagged."""

    clear_after: int = 3
    """Consecutive clean windows before a flagged rank is cleared."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1 or self.flag_after < 1 or self.clear_after < 1:
            raise ValueError("config window, flag_after and clear_after must be >= 1")


_GROUPS: dict[str, type] = {
    "baseline": BaselineConfig,
    "noise": NoiseConfig,
    "compute": ComputeConfig,
    "network": NetworkConfig,
    "lost": LostConfig,
    "stall": StallConfig,
    "persistence": PersistenceConfig,
}

#: flat setting name -> the group that holds it
_GROUP_OF: dict[str, str] = {f.name: g for g, cls in _GROUPS.items() for f in fields(cls)}


@dataclass(frozen=True)
class DetectConfig:
    """Thresholds of the detector, one group per rule; swappable while running."""

    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    """The job's step-time baseline and the smallest effect that counts."""

    noise: NoiseConfig = field(default_factory=NoiseConfig)
    """The compute bar on a noisy machine."""

    compute: ComputeConfig = field(default_factory=ComputeConfig)
    """The compute rule."""

    network: NetworkConfig = field(default_factory=NetworkConfig)
    """The network rule."""

    lost: LostConfig = field(default_factory=LostConfig)
    """The lost-rank rule and the liveness clock."""

    stall: StallConfig = field(default_factory=StallConfig)
    """The hang and silent-loss rules."""

    persistence: PersistenceConfig = field(default_factory=PersistenceConfig)
    """Rolling windows, flag and clear persistence."""

    @classmethod
    def from_mapping(cls, data: dict[str, Any], source: str = "config") -> DetectConfig:
        """Settings by flat name or by group (``{"network": {"net_ratio": 2}}``)."""
        grouped: dict[str, dict[str, Any]] = {g: {} for g in _GROUPS}
        unknown: list[str] = []
        for key, value in data.items():
            if key in _GROUPS and isinstance(value, dict):
                for sub, v in value.items():
                    if _GROUP_OF.get(sub) == key:
                        grouped[key][sub] = v
                    else:
                        unknown.append(f"{key}.{sub}")
            elif key in _GROUP_OF:
                grouped[_GROUP_OF[key]][key] = value
            else:
                unknown.append(key)
        if unknown:
            raise ValueError(f"{source}: unknown setting(s): {', '.join(sorted(unknown))}")
        try:
            return cls(**{g: _GROUPS[g](**kw) for g, kw in grouped.items()})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from e

    @classmethod
    def from_file(cls, path: str | Path) -> DetectConfig:
        """Read a JSON or TOML file (by suffix) of settings; a missing key keeps its default.

        A TOML file may hold the settings at top level or under ``[detect]``.
        """
        p = Path(path)
        text = p.read_text()
        try:
            data: Any = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        except (ValueError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"{p}: not valid {p.suffix.lstrip('.') or 'JSON'}: {e}") from e
        if isinstance(data, dict) and isinstance(data.get("detect"), dict):
            data = data["detect"]
        if not isinstance(data, dict):
            raise ValueError(f"{p}: expected an object of settings")
        return cls.from_mapping(data, str(p))

    def with_(self, **changes: Any) -> DetectConfig:
        """A copy with settings changed by flat name (``with_(flag_after=3)``)."""
        grouped: dict[str, dict[str, Any]] = {}
        for key, value in changes.items():
            if key not in _GROUP_OF:
                raise ValueError(f"unknown setting: {key}")
            grouped.setdefault(_GROUP_OF[key], {})[key] = value
        return replace(self, **{g: replace(getattr(self, g), **kw) for g, kw in grouped.items()})

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name (for printing and comparing)."""
        return {name: getattr(getattr(self, g), name) for name, g in _GROUP_OF.items()}
