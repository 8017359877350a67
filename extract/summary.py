"""What an extraction reports (`ExtractSummary`) and the version stamp of the files it writes; shared by the
latent extraction (extract/run.py) and the text extraction (extract/text.py)."""
from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

# Ranks wait in the final gather for the slowest one (a resumed run can be very uneven), so the collective
# timeout is long; a rank that dies is handled by torchrun, which stops the others.
EXTRACT_DIST_TIMEOUT_S = 24 * 3600


@dataclass
class ExtractSummary:
    out: str
    manifest: str
    images: int              # encoded by this run, all ranks
    skipped: int             # in the whole shard set
    total_samples: int       # in the whole shard set
    shards_written: int
    shards_kept: int         # finished by an earlier run and kept
    total_bytes: int
    wall_s: float
    fp32_retries: int

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall_s if self.wall_s > 0 else 0.0


def tool_version() -> str:
    try:
        return importlib.metadata.version("dit-pipeline")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


