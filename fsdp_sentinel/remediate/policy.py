"""When to prioritise, and when to stop (pure: verdicts and figures in, decisions out).

``assess`` reads one ``network`` verdict with its host's :class:`Contention`
and says whether host tc can help, and why (or why not):

- the device sends much more than the job's flows (``foreign_tx_share`` at
  least ``min_foreign_share``): something else shares the egress; giving the
  job's flows priority takes their bandwidth back -> act;
- the device *receives* much more than the job's flows while its egress is
  the job's: others send into the host (or an incast at a switch); host tc on
  the egress cannot fix that -> leave tc alone and say so;
- neither: the link is slow (or lossy) with nothing competing; priority
  among one class of traffic changes nothing -> leave tc alone and say so.

:class:`Hysteresis` is the observe -> act -> undo cycle for one device: the
tree goes in on the first flagged verdict that ``assess`` approves, stays
while any rank of the host is flagged or foreign traffic still competes (the
rank is clean *because* of the tree then; removing it would bring the
slow-down straight back), and comes out after ``clean_windows`` windows in a
row with neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdp_sentinel.remediate.config import RemediateConfig
from fsdp_sentinel.remediate.contention import Contention

EGRESS = "egress"
INGRESS = "ingress"
NONE = "none"


@dataclass(frozen=True)
class Assessment:
    """``act``: install the tree; ``contended``: egress, ingress or none; ``why``: for people."""

    act: bool
    contended: str
    why: str

    def evidence(self) -> dict[str, Any]:
        return {"contended": self.contended, "tc": "prioritise" if self.act else "left alone",
                "why": self.why}  # fmt: skip


def assess(
    verdict: dict[str, Any], contention: Contention | None, managed: bool, cfg: RemediateConfig
) -> Assessment:
    """Whether prioritising the job's flows on the host's egress can help (module docstring)."""
    if contention is None or contention.foreign_tx_share is None:
        return Assessment(False, NONE, "no byte counts for the host's device yet")
    tx = contention.foreign_tx_share
    rx = contention.foreign_rx_share or 0.0
    floor = cfg.min_foreign_share
    if tx >= floor:
        if not managed:
            return Assessment(False, EGRESS, f"{tx:.0%} of the egress is not the job's, "
                              "but this host's device is not managed here")  # fmt: skip
        return Assessment(True, EGRESS, f"{tx:.0%} of the egress is not the job's: "
                          "prioritising the job's flows takes the link back")  # fmt: skip
    if rx >= floor:
        return Assessment(False, INGRESS, f"ingress, not egress: {rx:.0%} of what the host "
                          "receives is not the job's; tc on its egress cannot fix that, "
                          "left alone")  # fmt: skip
    return Assessment(False, NONE, f"only {max(tx, rx):.0%} of the link is not the job's: "
                      "the link is slow with no competing traffic, priority cannot help")  # fmt: skip


@dataclass
class Hysteresis:
    """observe -> act -> undo for one device (module docstring)."""

    clean_windows: int = 3
    min_foreign_share: float = 0.25
    active: bool = False
    flagged: set[int] = field(default_factory=set)
    clean: int = 0

    def on_verdict(self, rank: int, flagged: bool, act: bool) -> bool:
        """Note a verdict for a rank on this device; True when the tree should go in now."""
        if flagged:
            self.flagged.add(rank)
            self.clean = 0
        else:
            self.flagged.discard(rank)
        if flagged and act and not self.active:
            self.active = True
            return True
        return False

    def on_window(self, contention: Contention | None) -> bool:
        """One window of figures while active; True when the tree should come out now."""
        if not self.active:
            return False
        share = contention.foreign_tx_share if contention is not None else None
        competing = share is not None and share >= self.min_foreign_share
        if self.flagged or competing:
            self.clean = 0
            return False
        self.clean += 1
        if self.clean >= self.clean_windows:
            self.active = False
            self.clean = 0
            return True
        return False

    def reset(self) -> None:
        """The tree was removed (or failed to go in): back to observing."""
        self.active = False
        self.clean = 0
