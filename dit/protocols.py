"""The table of sampling protocols and the questions asked of it: `PROTOCOLS`, every release's row
(dit/release_protocols.py) then NanoGen's 78 sampling configs as rows `nanogen/<config file name>`
(dit/nanogen_protocols.py), each a `Protocol` record (dit/protocol_types.py); a row by name with the closest names
for a typo (`protocol`, `unknown`); which rows fit a model and why one does not (`fitting`, `fit_problem`, against
dit/protocol_fit.py's traits); what a row needs that this build lacks (`missing_features`); and `custom`, the
protocol dit-sample's own flags describe (dit-sample without --protocol). The samplers (sample/generate.py) read a
protocol, never a release's name. Pure data: no I/O.
"""
from __future__ import annotations

import difflib

from . import nanogen_protocols, release_protocols
from .protocol_fit import FEATURES, ModelTraits
from .protocol_types import Guidance, Protocol, TimeGrid

PROTOCOLS: dict[str, Protocol] = dict(release_protocols.ROWS)
RELEASE_ROWS = tuple(PROTOCOLS)  # the releases' own rows, before NanoGen's configs
PROTOCOLS.update(nanogen_protocols.rows())


def names() -> str:
    """The protocol names for a message: every release's, then NanoGen's configs as one pattern."""
    n = len(PROTOCOLS) - len(RELEASE_ROWS)
    return f"{', '.join(RELEASE_ROWS)}, nanogen/<NanoGen sampling config> ({n} rows: docs/nanogen-protocols.md)"


def _near(name: str) -> str:
    near = difflib.get_close_matches(name, list(PROTOCOLS), n=3, cutoff=0.8)
    return f" (did you mean {' or '.join(near)}?)" if near else ""


def unknown(name: str, flag: str = "--protocol") -> str:
    """The message for a protocol name that is not a row (with the closest names)."""
    return f"{flag} must be one of {names()}, got {name!r}{_near(name)}"


def protocol(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"unknown sampling protocol {name!r}; choose one of: {names()}{_near(name)}")
    return PROTOCOLS[name]


def fitting(traits: ModelTraits) -> list[str]:
    """The rows that fit a model, releases' first; rows needing a feature this build lacks are left out."""
    return [n for n, p in PROTOCOLS.items() if not p.applies_to.mismatches(traits) and not p.applies_to.missing()]


def fit_problem(p: Protocol, traits: ModelTraits, shown: int = 8,
                instead: str = "drop --protocol and choose the sampler with dit-sample's flags") -> str | None:
    """Why protocol `p` does not fit a model with `traits` (None: it fits), naming the rows that do and, last, what
    else to do (`instead`)."""
    wrong = p.applies_to.mismatches(traits)
    if not wrong:
        return None
    fits = fitting(traits)
    more = f" and {len(fits) - shown} more" if len(fits) > shown else ""
    which = f"Protocols that fit it: {', '.join(fits[:shown])}{more}" if fits else "No protocol fits it"
    return (f"--protocol {p.name} applies to {p.applies_to.describe()}; this is {traits.describe()} "
            f"({'; '.join(wrong)}). {which}; or {instead}")


def missing_features(p: Protocol) -> str | None:
    """Why protocol `p` cannot run in this build (None: it can): the features its release's sampler needs."""
    missing = p.applies_to.missing()
    if not missing:
        return None
    return (f"--protocol {p.name} needs {'; '.join(FEATURES[f] for f in missing)}, which this build does not have "
            "yet; no other setting samples it as the release does")


def custom(*, solver: str, steps: int, scale: float = 1.0, interval: tuple[float, float] | list[float] | None = None,
           channels: str = "all", last_step_size: float = 0.04, sample_eps: float = 1e-3, diffusion_form: str = "sigma",
           diffusion_norm: float = 1.0, time_shift: float = 1.0, labels: str = "uniform",
           guide_model: str | None = None) -> Protocol:
    """The protocol `dit-sample`'s own flags describe (no --protocol): uniform grids from 0 to 1 (the SDE: `steps`
    points from 0 (SBDM: sample_eps) to 1 - last_step_size, then its Mean step), shifted by `time_shift` with both
    ends kept, guidance on a closed interval, a single conditional pass outside it, DiT's image conversion."""
    grid: TimeGrid | None = None
    if solver in ("euler", "heun", "meanflow"):
        grid = TimeGrid(count_is="intervals", shift=time_shift, stretch=True)
    elif solver == "euler-maruyama":
        grid = TimeGrid(count_is="points", start=sample_eps if diffusion_form == "SBDM" else 0.0,
                        end=1.0 - last_step_size, append=1.0 if last_step_size > 0 else None, shift=time_shift,
                        stretch=True)
    rule = "autoguidance" if guide_model else ("cfg" if scale > 1.0 else "none")
    iv = None if interval is None else (float(interval[0]), float(interval[1]))
    return Protocol("custom", "dit-pipeline", ("dit-sample's flags",), solver=solver, count=int(steps),
                    guidance=Guidance(rule, float(scale), interval=iv, channels=channels, guide_model=guide_model),
                    conversion="dit", labels=labels, fid_reference="", grid=grid, diffusion_form=diffusion_form,
                    diffusion_norm=float(diffusion_norm))
