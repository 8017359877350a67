"""Fixtures shared by all test packages."""
from __future__ import annotations

import os

import pytest

# One intra-op thread per test process: make test runs two xdist workers on two cores, whose CLI subprocesses and
# ranks take their own threads; two per worker oversubscribed the cores (an in-process training test took 53-114 s
# instead of 8-10 s). make test-determinism reruns the bit-identity tests with 2.
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

from tests._util import make_image_tree, make_tiny_vae

os.environ.setdefault("HF_HUB_OFFLINE", "1")
for _k in [k for k in os.environ if k.startswith("SLURM_")]:  # run inside a Slurm job: still one process
    del os.environ[_k]


def pytest_addoption(parser):
    parser.addoption("--run-reliability", action="store_true", default=False,
                     help="run the full randomized fault-injection sweep (make test-reliability)")
    parser.addoption("--run-sweep", action="store_true", default=False,
                     help="run the further cases of features make test already runs end to end once (make test-sweep)")


def pytest_sessionfinish(session):
    """Under pytest-xdist each worker hands its reliability tallies to the controller (pytest_testnodedown)."""
    if hasattr(session.config, "workeroutput"):
        from tests.reliability.harness import COUNTS

        session.config.workeroutput["reliability_counts"] = dict(COUNTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from tests.reliability.harness import COUNTS

    COUNTS.update(getattr(node, "workeroutput", {}).get("reliability_counts", {}))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from tests.reliability.harness import COUNTS

    if COUNTS:
        terminalreporter.write_line(f"reliability: {COUNTS['faults']} faults injected, {COUNTS['inputs']} bad "
                                    "inputs tried")


def pytest_collection_modifyitems(config, items):
    skips = {"reliability": (config.getoption("--run-reliability"),
                             pytest.mark.skip(reason="full sweep: run with `make test-reliability`")),
             "sweep": (config.getoption("--run-sweep"),
                       pytest.mark.skip(reason="a further case of a feature tested end to end: `make test-sweep`"))}
    for item in items:
        for marker, (run, skip) in skips.items():
            # the marker itself: item.keywords would also match the tests/reliability/ folder name
            if not run and item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_vae_dir(tmp_path_factory):
    """A tiny random AutoencoderKL saved with save_pretrained (scaling_factor 0.5)."""
    return make_tiny_vae(tmp_path_factory.mktemp("vae") / "tiny-vae")


@pytest.fixture
def image_tree(tmp_path):
    """Three class folders (3, 2 and 4 JPEGs of 48x40)."""
    return make_image_tree(tmp_path / "images", counts=(3, 2, 4))


@pytest.fixture
def project_log():
    """The messages the project logger (`dit_pipeline`) emits during the test, at INFO and above. A handler on
    that logger itself: after an in-process command's setup_logging it no longer propagates to the root
    logger, where pytest's caplog listens (and only some pytest versions also listen on named loggers)."""
    import logging

    logger = logging.getLogger("dit_pipeline")
    messages: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
